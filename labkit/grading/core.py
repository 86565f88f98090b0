"""Exercises, their graders, and the check cells that call them.

Graders live in `labkit.grading.labs.labNN` (outside the notebooks, so students can't edit them).
Each takes the namespace of the student's notebook, tests the student's own definitions on fresh
inputs, and either returns a short success message or raises `ExerciseFailed` with a reason that
names the likely misconception. The same function serves the notebook's check cells (instant
feedback) and `make check LABS=...` (the score report).
"""

import importlib
import inspect
import pkgutil
from collections.abc import Callable
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


_REGISTRY: dict[tuple[str, str], Exercise] = {}


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


def require(namespace: dict, name: str, kind: type | None = None):
    """The student's definition `name`, or a failure that says how to get it defined."""
    if name not in namespace:
        raise NotDefined(name)
    value = namespace[name]
    if kind is None and not callable(value):
        raise ExerciseFailed(f"`{name}` should be a function, but it is a {type(value).__name__}")
    if kind is not None and not isinstance(value, kind):
        raise ExerciseFailed(f"`{name}` should be a {kind.__name__}, but it is a {type(value).__name__}")
    return value


def expect_tensor(value, shape, what: str):
    """`value` if it is a tensor of `shape`; otherwise a failure that says what came back instead."""
    import torch

    if not isinstance(value, torch.Tensor):
        raise ExerciseFailed(f"{what} should be a torch.Tensor, got {type(value).__name__}")
    if tuple(value.shape) != tuple(shape):
        raise ExerciseFailed(f"{what} should have shape {tuple(shape)}, got {tuple(value.shape)}")
    return value


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


def run_exercise(ex: Exercise, namespace: dict) -> Outcome:
    """Grade one exercise; any failure becomes one readable reason, never a traceback."""
    try:
        message = ex.grader(namespace) or "correct"
        return Outcome(ex.lab, ex.name, ex.points, ex.points, message)
    except NotDefined as failure:
        return Outcome(ex.lab, ex.name, 0, ex.points, str(failure), missing=failure.name)
    except ExerciseFailed as failure:
        reason = str(failure)
    except NotImplementedError:
        reason = "not implemented yet: replace `raise NotImplementedError()` with your code"
    except Exception as error:  # the student's code crashed inside the grader's call
        first_line = (str(error).strip().splitlines() or [""])[0]
        reason = f"your code raised {type(error).__name__}: {first_line}".rstrip(": ")
    return Outcome(ex.lab, ex.name, 0, ex.points, reason)


def check(lab: str, name: str, namespace: dict | None = None) -> None:
    """A notebook's check cell: grade one exercise against the notebook's own definitions."""
    if namespace is None:
        namespace = inspect.currentframe().f_back.f_globals
    outcome = run_exercise(get_exercise(lab, name), namespace)
    if not outcome.passed:
        raise ExerciseFailed(f"{name}: {outcome.message}")
    print(f"✔ {name}: {outcome.message}")


def _load_graders() -> None:
    from labkit.grading import labs

    for module in pkgutil.iter_modules(labs.__path__):
        importlib.import_module(f"{labs.__name__}.{module.name}")
