"""Exercises, their graders, and the check cells that call them.

Graders live in `labkit_course.grading.labs.labNN` (outside the notebooks, so students can't edit them).
Each takes the namespace of the student's notebook, tests the student's own definitions on fresh
inputs (drawn through `case_seed`, so that, graded, no notebook knows them in advance), and either
returns a short success message or raises `ExerciseFailed` with a reason that names the likely
misconception. The same function serves the notebook's check cells (instant
feedback, in the notebook's own process) and `make check LABS=...` (the score report, where the
namespace is a `labkit_course.grading.remote.RemoteNamespace`: the grader runs in the trusted process and
each call of the student's function is carried out in the student's kernel).

What a grader passes to the student's code must be what `labkit_course.grading.codec` carries (numbers,
strings, bytes, lists, tuples, dicts, OrderedDicts, deques, sets, tensors, dtypes, devices,
generators, and dataclasses from `labkit.cache.block_manager` or a grader module); the student's
changes to those arguments are written back in place, so mutation checks read the same either way.
An exception from the student's code arrives as itself only for NotImplementedError; any other
is a `RemoteError` whose `type_name` names the student's exception type.
"""

import contextlib
import hashlib
import importlib
import inspect
import os
import pkgutil
import random
import secrets
import struct
from collections.abc import Callable
from contextvars import ContextVar
from dataclasses import dataclass


class ExerciseFailed(Exception):
    """A readable reason why an exercise is not solved yet (shown without a traceback)."""

    def _render_traceback_(self):  # IPython shows this instead of a traceback
        return [f"✘ {self}"]


class NotDefined(ExerciseFailed):
    """The student's definition is missing, usually because its cell was not run or failed."""

    def __init__(self, name: str):
        super().__init__(f"`{name}` is not defined: run the cell that defines it (did it fail?)")
        self.name = name


@dataclass(frozen=True)
class Exercise:
    lab: str
    name: str
    points: int
    grader: Callable[[dict], str | None]
    # Dotted paths ("labkit.sampling.filter_logits", "torch.softmax") that answer this exercise:
    # calling one while the student's code is graded fails the exercise.
    forbidden: tuple[str, ...] = ()


@dataclass(frozen=True)
class Outcome:
    lab: str
    name: str
    points: int
    max_points: int
    message: str  # the success message, or the reason it failed
    missing: str | None = None  # the undefined name that failed it, if that was the reason

    @property
    def passed(self) -> bool:
        return self.points == self.max_points


FEEDBACK_CHARS = 1000  # the longest feedback kept for one exercise
_REGISTRY: dict[tuple[str, str], Exercise] = {}
# The tripwires of the exercise being graded right now (see labkit_course.grading.forbidden).
GRADING: ContextVar = ContextVar("labkit_grading", default=None)
DRAWING_FOR: ContextVar = ContextVar("labkit_drawing_for", default="")  # the exercise whose inputs are drawn


def exercise(lab: str, name: str, points: int = 1, forbidden: tuple[str, ...] = ()):
    """Register the decorated function as the grader of exercise `name` in lab `lab` ("03").

    `forbidden` names what the student may not call while graded (the exercise's own answer).
    """

    def register(grader):
        key = (lab, name)
        if key in _REGISTRY and _REGISTRY[key].grader.__qualname__ != grader.__qualname__:
            raise ValueError(f"exercise {lab}/{name} is registered twice")
        _REGISTRY[key] = Exercise(lab, name, points, grader, tuple(forbidden))
        return grader

    return register


def require(namespace, name: str, kind: type | None = None):
    """The student's definition `name`, or a failure that says how to get it defined.

    `kind` is None (a function), `type` (a class) or a data type such as `dict` (a value the student
    fills in, copied out of the student's kernel). While an exercise is graded, a function or class
    comes back guarded: calling what the exercise forbids from inside it fails the exercise.
    """
    if name not in namespace:
        raise NotDefined(name)
    if kind not in (None, type):
        value = namespace.value(name) if hasattr(namespace, "value") else namespace[name]
        if not isinstance(value, kind):
            raise ExerciseFailed(f"`{name}` should be a {kind.__name__}, but it is a {type(value).__name__}")
        return value
    value = namespace[name]
    describe = getattr(value, "_describe", None)
    type_name, is_callable, is_class = describe() if describe else (
        type(value).__name__, callable(value), isinstance(value, type))
    if kind is None and not is_callable:
        raise ExerciseFailed(f"`{name}` should be a function, but it is a {type_name}")
    if kind is type and not is_class:
        raise ExerciseFailed(f"`{name}` should be a class, but it is a {type_name}")
    wires = GRADING.get()
    if wires is None:
        return value
    from labkit_course.grading.forbidden import ForbiddenCall, explain, guarded, static_violations

    source = namespace.definition_source(name) if describe else _source(value)
    for path in static_violations(source, name, wires.forbidden):
        wires.tripped.append(path)
        raise ForbiddenCall(explain(path))
    return value if describe else guarded(wires, namespace, value)


def _source(value) -> str:
    try:
        return inspect.getsource(value)
    except (OSError, TypeError):
        return ""


def expect_tensor(value, shape, what: str):
    """`value` if it is a tensor of `shape`; otherwise a failure that says what came back instead."""
    import torch

    if not isinstance(value, torch.Tensor):
        raise ExerciseFailed(f"{what} should be a torch.Tensor, got {type(value).__name__}")
    if tuple(value.shape) != tuple(shape):
        raise ExerciseFailed(f"{what} should have shape {tuple(shape)}, got {tuple(value.shape)}")
    return value


def tensors_close(got, want, atol: float = 1e-5) -> bool:
    """Whether `got` is a tensor of `want`'s shape and values, compared in float64 so that a float32
    answer is judged at float32 precision (a float64 reference still needs a float64 answer's)."""
    import torch

    if not isinstance(got, torch.Tensor) or got.shape != want.shape:
        return False
    return torch.allclose(got.to(torch.float64), want.to(torch.float64), atol=atol)


def close_at_precision(got, want) -> bool:
    """`tensors_close`, holding a float64 answer to float64 precision (the worked example computes in float64)."""
    import torch

    return tensors_close(got, want, atol=1e-9 if getattr(got, "dtype", None) == torch.float64 else 1e-5)


_SECRET = 0  # mixed into every seed a grader draws its inputs from (see case_seed); 0 mixes nothing


def keep_inputs_secret(secret: int | None = None) -> None:
    """From now on, every grader in this process draws its inputs from seeds mixed with a secret (a fresh one
    unless given): the trusted side calls this before it grades a notebook, so each notebook gets inputs of
    its own that no notebook can know in advance."""
    global _SECRET
    _SECRET = secrets.randbits(64) | 1 if secret is None else secret


def case_seed(seed: int) -> int:
    """The seed a grader's inputs are drawn from. In a notebook's own check it is `seed`, as published with
    the course. Graded, it is mixed with the secret: otherwise a notebook could rebuild the inputs ahead of
    time, run labkit on them while no grader watches, and hand in a table of answers instead of the lesson.
    The exercise being graded is mixed in too: a seed one exercise hands the student (in a generator it
    passes) tells nothing about another exercise's inputs, whose labkit answers are not forbidden meanwhile."""
    if not _SECRET:
        return seed
    digest = hashlib.blake2b(f"{DRAWING_FOR.get()}:{seed}".encode(), key=_SECRET.to_bytes(8, "little"),
                             digest_size=8).digest()
    return int.from_bytes(digest, "little") >> 1


_MT_STATE = struct.Struct("<QiiQ624Q")  # the head of torch's CPU generator state: seed, left, seeded, next, words


def seeded_generator(seed: int):
    """A torch generator for `case_seed(seed)`. torch seeds its Mersenne Twister from 32 bits of a seed, so one
    tensor it drew would give its stream away after 2^32 tries, and with it every later draw; graded, all 624
    words of its state come from the whole seed instead."""
    import torch

    drawn_from = case_seed(seed)
    generator = torch.Generator().manual_seed(drawn_from)
    if not _SECRET:
        return generator
    state = bytearray(generator.get_state().numpy().tobytes())
    if _MT_STATE.unpack_from(state)[:3] != (drawn_from, 1, 1):
        raise RuntimeError(f"torch {torch.__version__} lays out its generator's state in a way grading does not know")
    words = random.Random(drawn_from).getrandbits(32 * 624)
    _MT_STATE.pack_into(state, 0, drawn_from, 1, 1, 0, *((words >> 32 * i) & 0xFFFFFFFF for i in range(624)))
    generator.set_state(torch.frombuffer(state, dtype=torch.uint8).clone())
    return generator


def seeded_random(seed: int) -> random.Random:
    """A Python `random.Random` seeded with `case_seed(seed)`."""
    return random.Random(case_seed(seed))


@contextlib.contextmanager
def naming(call: str):
    """A failure on a drawn input names it, so the student can reproduce it."""
    try:
        yield
    except ExerciseFailed as failure:
        raise ExerciseFailed(f"{call}: {failure}") from None


def float64_randn(*shape, seed: int):
    """Fresh float64 inputs drawn from `case_seed(seed)`."""
    import torch

    return torch.randn(*shape, generator=seeded_generator(seed), dtype=torch.float64)


def exercises(lab: str | None = None) -> list[Exercise]:
    """All registered exercises (of one lab), in the order their graders were defined."""
    _load_graders()
    return [ex for ex in _REGISTRY.values() if lab is None or ex.lab == lab]


def get_exercise(lab: str, name: str) -> Exercise:
    _load_graders()
    try:
        return _REGISTRY[(lab, name)]
    except KeyError:
        known = ", ".join(ex.name for ex in exercises(lab)) or "none"
        raise KeyError(f"lab {lab} has no exercise {name!r} (its exercises: {known})") from None


def run_exercise(ex: Exercise, namespace) -> Outcome:
    """Grade one exercise; any failure becomes one readable reason, never a traceback."""
    from labkit_course.grading.forbidden import Tripwires, explain

    wires = Tripwires(ex.forbidden)
    token, drawing = GRADING.set(wires), DRAWING_FOR.set(f"{ex.lab}/{ex.name}")
    try:
        message = ex.grader(namespace) or "correct"
        if not wires.tripped:
            return Outcome(ex.lab, ex.name, ex.points, ex.points, message)
        reason = ""
    except NotDefined as failure:
        return Outcome(ex.lab, ex.name, 0, ex.points, str(failure), missing=failure.name)
    except ExerciseFailed as failure:
        reason = str(failure)
    except NotImplementedError:
        reason = "not implemented yet: replace `raise NotImplementedError()` with your code"
    except Exception as error:  # the student's code crashed inside the grader's call
        first_line = (str(error).strip().splitlines() or [""])[0]
        name = raised_type(error)
        where = getattr(error, "where", "") or where_raised(error)
        reason = f"your code raised {name}: {first_line}".rstrip(": ") + (f" ({where})" if where else "")
    finally:
        GRADING.reset(token)
        DRAWING_FOR.reset(drawing)
    if wires.tripped:  # even if the student's code caught the tripwire's exception
        reason = explain(wires.tripped[0])
    if len(reason) > FEEDBACK_CHARS:  # a message may quote what the student's code gave or raised
        reason = reason[:FEEDBACK_CHARS - 1] + "…"
    return Outcome(ex.lab, ex.name, 0, ex.points, reason)


def where_raised(error: BaseException) -> str:
    """Where in the student's notebook `error` was raised: the innermost frame in a notebook cell
    (IPython names cell code `<ipython-input-…>`, ipykernel `…/ipykernel_<pid>/<hash>.py`), as
    "in f, line 3 of its cell: `code`"; "" if no cell's code is on the traceback."""
    import linecache
    import traceback

    cell_frames = [frame for frame in traceback.extract_tb(error.__traceback__)
                   if frame.filename.startswith("<ipython-input-") or "/ipykernel_" in frame.filename]
    if not cell_frames:
        return ""
    frame = cell_frames[-1]
    code = (frame.line or linecache.getline(frame.filename, frame.lineno or 0)).strip()
    return f"in {frame.name}, line {frame.lineno} of its cell" + (f": `{code[:120]}`" if code else "")


def raised_type(error: BaseException) -> str:
    """The type the student's code raised: a RemoteError carries it across the channel by name."""
    return getattr(error, "type_name", type(error).__name__)


def expect_value_error(call, what: str, hint: str = "") -> None:
    """Fail unless `call()` raises a ValueError; `what` names the bad input, `hint` what is wrong with it."""
    try:
        call()
    except ExerciseFailed:
        raise
    except Exception as error:
        if raised_type(error) != "ValueError":
            raise ExerciseFailed(f"{what} raised {raised_type(error)}: raise a ValueError that says what is "
                                 "wrong") from None
    else:
        raise ExerciseFailed(f"{what} was accepted: {hint + '; ' if hint else ''}raise a ValueError")


def check(lab: str, name: str, namespace: dict | None = None) -> None:
    """A notebook's check cell: grade one exercise against the notebook's own definitions. Under
    `make check LABS=...` the graders are not in the student's kernel: they run outside it."""
    if os.environ.get("LABKIT_GRADED"):
        print(f"{name}: graded outside this kernel")
        return
    if namespace is None:
        namespace = inspect.currentframe().f_back.f_globals
    outcome = run_exercise(get_exercise(lab, name), namespace)
    if not outcome.passed:
        raise ExerciseFailed(f"{name}: {outcome.message}")
    print(f"✔ {name}: {outcome.message}")


def _load_graders() -> None:
    from labkit_course.grading import labs

    for module in pkgutil.iter_modules(labs.__path__):
        importlib.import_module(f"{labs.__name__}.{module.name}")
