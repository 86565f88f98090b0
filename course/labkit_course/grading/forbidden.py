"""No answers one import away: what an exercise forbids, enforced while the student's code runs.

An exercise names dotted paths ("labkit.sampling.filter_logits", "torch.Tensor.softmax") that
answer it. While the student's code is being graded each of them is replaced by a tripwire that
fails the exercise with a message naming it, and so is every other name bound to the same object:
in the student's namespace (`from labkit.sampling import filter_logits as f`), in every loaded
labkit module and its classes (labkit re-exports its functions: `labkit.sampling.sampler.apply_top_k`,
`Sampler.top_k = staticmethod(apply_top_k)`), in what the student's namespace holds a few steps deep
(the body of a class of its own, `class M(BlockManager): alloc = BlockManager.allocate`; an object's
attributes; lists, dicts and tuples; the defaults and closures of its functions), and what a forbidden
object wraps (`functools.wraps`'s `__wrapped__`, a partial's `func`, a staticmethod's function) counts
as the object itself. Everything is restored afterwards. A static look at the definition's source
catches the forbidden names even on a path the tests do not exercise.

In a graded kernel, `install_guards` runs before the notebook's first cell: each function the lab
forbids (labkit's or torch's) is replaced, where its path names it and wherever labkit holds it, by a
guard that trips while a graded call forbids it, so the notebook never holds the function itself, in
whatever holder it keeps it.

This is a rule the course states, not a wall. Code running in the student's own process can always
undo a tripwire: it can reach this module (`labkit_course.grading.forbidden`) and replace
`Tripwires.armed` with a no-op, patch the agent that arms it, or, in a notebook's own check cells
where no guard stands, keep a forbidden function deeper than the scan looks (`HOLDER_DEPTH`); and a
hand copy of labkit's source passes. `labkit_course.grading.rules`
fails the notebooks that visibly do such things; what stops a forged *score* is that the score is
computed elsewhere (see `labkit_course.grading.remote`).
"""

import ast
import functools
import importlib
import inspect
import sys
import textwrap
from contextlib import contextmanager

from labkit_course.grading.core import ExerciseFailed

HOLDER_DEPTH = 3  # how deep the scan looks into what the student's namespace holds: ns -> class -> list -> item
HOLDER_WIDTH = 512  # a list, dict or tuple longer than this is data, not a hiding place: not looked into
# `x.append(...)` in a student's source is a list's far more often than BlockManager's: a forbidden method
# named like a built-in container's is left to the tripwires alone, which see what the call reaches.
CONTAINER_METHODS = frozenset(name for kind in (list, dict, set, tuple, str, bytes) for name in dir(kind)
                              if not name.startswith("_"))


class ForbiddenCall(ExerciseFailed):
    """The student's code used what the exercise asks them to write."""


_ARMED: list = []  # the Tripwires of the graded call running now, for the guards (`install_guards`)
_GUARDED: dict[str, object] = {}  # path -> labkit's own object, where a guard now stands for it


def unguarded(path: str):
    """labkit's own object at `path`, even where a guard stands for it (for the grader's agent)."""
    if path in _GUARDED:
        return _GUARDED[path]
    owner, name = resolve(path)
    saved = [value for tripwires in _ARMED for home, key, _, value in tripwires._saved if (home, key) == (owner, name)]
    return saved[0] if saved else getattr(owner, name)  # a tripwire stands there while a call is armed


def install_guards(paths) -> None:
    """Before a graded notebook's first cell: each forbidden function, labkit's or torch's, becomes a guard
    (where its path names it, and wherever labkit holds it) that calls it, except while a graded call that
    forbids it runs, when it trips.

    The notebook then never holds the function itself, so no container, weak reference, generator or
    object it keeps it in, however deep, hides it from the tripwires. (Paths that do not resolve in the
    kernel, a grader's own reference, are left out: the sandbox hides the graders. Classes are left to the
    tripwires.)"""
    namespaces, classes = _labkit_homes(len(sys.modules))
    for path in dict.fromkeys(paths):
        try:
            owner, name = resolve(path)
        except (ValueError, AttributeError):
            continue
        original = getattr(owner, name, None)
        if not callable(original) or isinstance(original, type):
            continue
        guard = _guard(path, original)
        _GUARDED[path] = original
        setattr(owner, name, guard)
        for namespace in namespaces:  # labkit's re-exports
            for key in [key for key, value in namespace.items() if value is original]:
                namespace[key] = guard
        for klass in classes:
            for key, value in list(vars(klass).items()):
                if _unwrapped(value) is original:
                    setattr(klass, key, type(value)(guard) if value is not original else guard)


def _guard(path: str, original):
    """`original`, but tripping while a graded call forbids `path` (it keeps no `__wrapped__` to unwrap)."""
    def guard(*args, **kwargs):
        if _ARMED and path in _ARMED[-1].forbidden:
            _ARMED[-1].tripped.append(path)
            raise ForbiddenCall(explain(path))
        return original(*args, **kwargs)

    for attribute in ("__name__", "__qualname__", "__doc__", "__module__"):
        setattr(guard, attribute, getattr(original, attribute, None))
    return guard


def explain(path: str) -> str:
    name = path.rsplit(".", 1)[-1]
    if path.startswith(("labkit.", "labkit_course.")):
        return f"`{name}` is labkit's answer to this exercise: write your own"
    return f"`{path}` is what this exercise asks you to write: build it from simpler operations"


def resolve(path: str) -> tuple[object, str]:
    """The object holding the last attribute of `path`, and that attribute's name."""
    parts = path.split(".")
    for split in range(len(parts) - 1, 0, -1):
        try:
            owner = importlib.import_module(".".join(parts[:split]))
        except ImportError:
            continue
        for part in parts[split:-1]:
            owner = getattr(owner, part)
        if not hasattr(owner, parts[-1]):
            break
        return owner, parts[-1]
    raise ValueError(f"forbidden path {path!r} names nothing importable")


class Tripwires:
    """Replaces the forbidden objects (and the student's aliases of them) while armed."""

    def __init__(self, forbidden: tuple[str, ...]):
        self.forbidden = tuple(forbidden)
        self.tripped: list[str] = []
        self._depth = 0
        self._saved: list[tuple[object, str, bool, object]] = []  # owner, name, own attribute?, value
        self._aliases: list[tuple[dict, str, object]] = []
        self._captured: list = []  # how to restore defaults and closure cells that held a forbidden object

    def _wire_captured(self, function, targets: dict[int, str]) -> None:
        """`def f(x, _f=torch.softmax)` and closures keep their own reference: wire those too."""
        defaults, kwdefaults, cells = _captures(function)
        if any(id(v) in targets for v in defaults):
            function.__defaults__ = tuple(self._wire(targets[id(v)]) if id(v) in targets else v for v in defaults)
            self._captured.append(lambda: setattr(function, "__defaults__", defaults))
        if any(id(v) in targets for v in kwdefaults.values()):
            function.__kwdefaults__ = {k: self._wire(targets[id(v)]) if id(v) in targets else v
                                       for k, v in kwdefaults.items()}
            self._captured.append(lambda: setattr(function, "__kwdefaults__", kwdefaults))
        for cell in cells:
            try:
                held = cell.cell_contents
            except ValueError:  # an empty cell
                continue
            if id(held) in targets:
                cell.cell_contents = self._wire(targets[id(held)])
                self._captured.append(lambda cell=cell, held=held: setattr(cell, "cell_contents", held))

    def _wire_aliases(self, namespace: dict, targets: dict[int, str]) -> None:
        """A labkit module's names bound to a forbidden object (its re-exports)."""
        for key, value in list(namespace.items()):
            if id(value) in targets:
                self._aliases.append((namespace, key, value))
                namespace[key] = self._wire(targets[id(value)])

    def _wire_namespace(self, namespace: dict, targets: dict[int, str]) -> None:
        """The student's names, and what they hold (`_disarmed`)."""
        seen: set[int] = set()
        home = namespace.get("__name__")  # the module the student's own functions and classes say they are from
        for key, value in list(namespace.items()):
            try:
                wired = self._disarmed(value, targets, HOLDER_DEPTH, seen, home)
            except Exception:  # noqa: BLE001 - an object whose attributes raise hides nothing the rules allow
                continue
            if wired is not None:
                self._aliases.append((namespace, key, value))
                namespace[key] = wired

    def _disarmed(self, value, targets: dict[int, str], depth: int, seen: set[int], home: str | None):
        """A tripwire to hold instead of `value` if it is (or stands for) a forbidden object, else None.
        On the way, what the student's own functions (defaults, closures), classes, objects (its own or
        labkit's), lists and dicts hold is wired in place, and a tuple holding a forbidden object is given
        back rebuilt. Other libraries' classes and objects are not looked into."""
        held = _held(value, targets)
        if held is not None:
            return self._wire(held)
        if depth == 0 or id(value) in seen:
            return None
        seen.add(id(value))
        kind = type(value)
        if kind is tuple and len(value) <= HOLDER_WIDTH:
            items = [self._disarmed(item, targets, depth - 1, seen, home) for item in value]
            return None if all(i is None for i in items) else tuple(
                old if new is None else new for old, new in zip(value, items, strict=True))
        if kind in (list, dict) and len(value) <= HOLDER_WIDTH:
            keys = range(len(value)) if kind is list else list(value)
            self._wire_items(value, keys, targets, depth, seen, home)
        elif inspect.isfunction(value) and value.__module__ == home:
            self._wire_captured(value, targets)
        elif isinstance(value, type) and value.__module__ == home and len(vars(value)) <= HOLDER_WIDTH:
            self._wire_items(vars(value), list(vars(value)), targets, depth, seen, home, owner=value)
        elif _looked_into(value, home):
            self._wire_items(vars(value), list(vars(value)), targets, depth, seen, home)
        return None

    def _wire_items(self, holder, keys, targets, depth: int, seen: set[int], home: str | None,
                    owner: type | None = None) -> None:
        """Wire what `holder` (a list, a dict, an object's `__dict__`, or `owner`'s class body) holds at `keys`."""
        for key in keys:
            old = holder[key]
            new = self._disarmed(old, targets, depth - 1, seen, home)
            if new is None:
                continue
            if owner is not None:  # a class body is a read-only mapping: set the attribute
                setattr(owner, key, new)
                self._captured.append(lambda owner=owner, key=key, old=old: setattr(owner, key, old))
            else:
                holder[key] = new
                self._captured.append(lambda holder=holder, key=key, old=old: holder.__setitem__(key, old))

    def _wire(self, path: str):
        def tripwire(*args, **kwargs):
            self.tripped.append(path)
            raise ForbiddenCall(explain(path))

        tripwire.__name__ = path.rsplit(".", 1)[-1]
        return tripwire

    @contextmanager
    def armed(self, *namespaces: dict, functions: tuple = ()):
        """Tripwires in place for the duration, in the forbidden objects' homes, in every labkit module and
        class that holds them (or what they wrap), under every name bound to them in `namespaces`, and in the
        default arguments and closures of `functions`; a function that is itself a forbidden object, or
        wraps one, is tripped at once. Nested arming is a no-op."""
        if not self.forbidden or self._depth:
            self._depth += 1
            try:
                yield self
            finally:
                self._depth -= 1
            return
        self._depth += 1
        _ARMED.append(self)
        try:
            homes = [(path, *resolve(path)) for path in self.forbidden]
            targets = {}
            for path, owner, name in homes:
                targets.update((id(link), path) for link in _links(getattr(owner, name)) if id(link) not in targets)
            for path, owner, name in homes:
                self._saved.append((owner, name, name in vars(owner), getattr(owner, name)))
                setattr(owner, name, self._wire(path))
            namespaces_of_labkit, classes_of_labkit = _labkit_homes(len(sys.modules))
            for namespace in namespaces_of_labkit:
                self._wire_aliases(namespace, targets)
            for klass in classes_of_labkit:
                for name, value in list(vars(klass).items()):
                    if id(_unwrapped(value)) in targets:  # `Sampler.top_k = staticmethod(apply_top_k)` too
                        self._saved.append((klass, name, True, value))
                        setattr(klass, name, self._wire(targets[id(_unwrapped(value))]))
            for namespace in {id(ns): ns for ns in namespaces}.values():
                self._wire_namespace(namespace, targets)
            for function in functions:
                self._wire_captured(function, targets)
                held = _held(function, targets)
                if held:  # the student's definition *is* the reference (`f = labkit's f`, or a wrapper of it)
                    self.tripped.append(held)
            yield self
        finally:
            self._depth -= 1
            _ARMED.remove(self)
            for restore in reversed(self._captured):
                restore()
            self._captured.clear()
            for namespace, key, value in reversed(self._aliases):
                namespace[key] = value
            for owner, name, own, original in reversed(self._saved):
                if own:
                    setattr(owner, name, original)
                else:
                    delattr(owner, name)
            self._aliases.clear()
            self._saved.clear()


def _unwrapped(value):
    """The function a staticmethod or classmethod in a class body holds; anything else as it is."""
    return value.__func__ if isinstance(value, staticmethod | classmethod) else value


def _held(value, targets: dict[int, str]) -> str | None:
    """The forbidden path `value` is or stands for (see `_links`), or None."""
    return next((targets[id(link)] for link in _links(value) if id(link) in targets), None)


def _looked_into(value, home: str | None) -> bool:
    """Whether an object's attributes are scanned: the student's own objects and labkit's (an EngineParts
    made in the notebook), not another library's (a tensor, a torch module) nor one with many attributes."""
    attributes = getattr(value, "__dict__", None)
    module = str(type(value).__module__)
    return (type(attributes) is dict and len(attributes) <= HOLDER_WIDTH
            and (module == home or module.partition(".")[0] in ("labkit", "labkit_course")))


def _links(value, limit: int = 16):
    """`value` and what it stands for: `functools.wraps`'s `__wrapped__` (an `lru_cache` too), a
    partial's `func`, a bound method's or a staticmethod's `__func__`, followed down the chain."""
    seen = set()
    while value is not None and id(value) not in seen and len(seen) < limit:
        seen.add(id(value))
        yield value
        value = next((getattr(value, attribute) for attribute in ("__wrapped__", "func", "__func__")
                      if getattr(value, attribute, None) is not None), None)


@functools.lru_cache(maxsize=1)
def _labkit_homes(modules_loaded: int) -> tuple[list[dict], list[type]]:
    """The namespaces of the loaded modules of labkit and of the course (not its graders), and the
    classes they define: where labkit re-exports its answers. Found again when the number of loaded
    modules changes (an import)."""
    modules = [(name, module) for name, module in list(sys.modules.items())
               if name.startswith("labkit") and name.partition(".")[0] in ("labkit", "labkit_course")
               and not name.startswith("labkit_course.grading") and module is not None]
    classes = {id(value): value for name, module in modules for value in list(vars(module).values())
               if isinstance(value, type) and value.__module__ == name}
    return [vars(module) for _, module in modules], list(classes.values())


def _captures(function) -> tuple:
    """The default arguments and closure cells of a plain function (none for anything else)."""
    return (getattr(function, "__defaults__", None) or (), getattr(function, "__kwdefaults__", None) or {},
            getattr(function, "__closure__", None) or ())


def guarded(wires: Tripwires, namespace: dict, value):
    """The student's function (or class) with the tripwires armed whenever it runs (in-process grading)."""
    if isinstance(value, type):
        wrapped = {}
        for klass in value.__mro__[:-1]:
            for name, member in vars(klass).items():
                if name not in wrapped and inspect.isfunction(member):
                    wrapped[name] = guarded(wires, namespace, member)
        return type(value.__name__, (value,), {**wrapped, "__module__": value.__module__})

    @functools.wraps(value)
    def call(*args, **kwargs):
        with wires.armed(namespace, getattr(value, "__globals__", {}), functions=(value,)):
            return value(*args, **kwargs)

    return call


def defines(source: str, name: str) -> bool:
    """Whether the cell's code has a `def` or `class` statement named `name`."""
    tree = _parse(source)
    return tree is not None and any(isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef)
                                    and node.name == name for node in ast.walk(tree))


def static_violations(source: str, name: str, forbidden: tuple[str, ...]) -> list[str]:
    """Forbidden paths that the definition of `name` in `source` mentions (attribute or import)."""
    tree = _parse(source)
    if tree is None or not forbidden:
        return []
    definitions = [node for node in ast.walk(tree)
                   if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef) and node.name == name]
    nodes = [n for d in definitions[-1:] for n in ast.walk(d)]
    found = []
    for node in nodes:
        if isinstance(node, ast.Attribute) and node.attr not in CONTAINER_METHODS:
            candidates = [p for p in forbidden if p.rpartition(".")[2] == node.attr]
            found += [_likeliest(_dotted(node), candidates)] if candidates else []
        elif (isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "getattr"
              and len(node.args) > 1 and isinstance(node.args[1], ast.Constant)):  # getattr(torch, "softmax")
            candidates = [p for p in forbidden if p.rpartition(".")[2] == node.args[1].value]
            found += [_likeliest(f"{_dotted(node.args[0])}.{node.args[1].value}", candidates)] if candidates else []
        elif isinstance(node, ast.ImportFrom):
            for alias in node.names:
                found += [p for p in forbidden if p.rpartition(".")[2] == alias.name
                          and p.split(".")[0] == (node.module or "").split(".")[0]]
    return list(dict.fromkeys(found))


def _dotted(node: ast.expr) -> str:
    parts = []
    while isinstance(node, ast.Attribute):
        parts.append(node.attr)
        node = node.value
    parts.append(node.id if isinstance(node, ast.Name) else "?")
    return ".".join(reversed(parts))


def _likeliest(dotted: str, candidates: list[str]) -> str:
    """The forbidden path `x.softmax` most likely is: itself if spelled out, a method if on a variable."""
    if dotted in candidates:
        return dotted
    base = dotted.split(".")[0]
    if all(base != p.split(".")[0] for p in candidates):
        methods = [p for p in candidates if p.split(".")[-2][:1].isupper()]
        return (methods or candidates)[0]
    return candidates[0]


def _parse(source: str) -> ast.Module | None:
    """The cell's Python, with IPython's magics and shell escapes blanked out."""
    lines = ["" if line.lstrip().startswith(("%", "!")) else line for line in source.splitlines()]
    try:
        return ast.parse(textwrap.dedent("\n".join(lines)))
    except (SyntaxError, ValueError):
        return None
