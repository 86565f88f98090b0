"""The course drives the engine only through its public names: no course module or notebook reads,
writes or names (as an attribute, through getattr/setattr/hasattr/delattr, or in a forbidden path
string) a private attribute that labkit defines. import-linter (`.importlinter`) keeps labkit from
importing the course; this keeps the course off labkit's privates, so renaming one can never break a
grader.

Two course mechanisms touch labkit objects generically, by design, and name no private: the
tripwires (grading/forbidden.py) rebind whatever names hold a forbidden object in labkit's modules and
classes while a student's code runs, and the grading codec (grading/codec.py) rebuilds the labkit
dataclasses it may carry (a Block) from their public fields."""

import ast
import json
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _private_names_of_labkit() -> set[str]:
    """Every `_name` (not dunder) that labkit defines: module functions and globals, methods, class
    attributes, and attributes set on `self`."""
    names = set()
    for path in (ROOT / "labkit").rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
                names.add(node.name)
            elif isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Store):
                names.add(node.attr)
            elif isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store):
                names.add(node.id)
    return {name for name in names if name.startswith("_") and not name.startswith("__")}


def _course_sources() -> list[tuple[str, str]]:
    sources = [(str(path.relative_to(ROOT)), path.read_text())
               for path in sorted((ROOT / "course" / "labkit_course").rglob("*.py"))]
    for path in sorted((ROOT / "solutions").glob("*.ipynb")):
        cells = json.loads(path.read_text())["cells"]
        code = "\n".join("".join(c["source"]) for c in cells if c["cell_type"] == "code")
        python = "\n".join(line for line in code.splitlines() if not line.lstrip().startswith(("%", "!")))
        sources.append((str(path.relative_to(ROOT)), python))
    return sources


def _uses_of(private: set[str], source: str) -> list[str]:
    found = []
    for node in ast.walk(ast.parse(source)):
        own = isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id in ("self", "cls")
        if isinstance(node, ast.Attribute) and node.attr in private and not own:
            found.append(f"line {node.lineno}: .{node.attr}")
        elif (isinstance(node, ast.Call) and isinstance(node.func, ast.Name)
              and node.func.id in ("getattr", "setattr", "hasattr", "delattr") and len(node.args) > 1
              and isinstance(node.args[1], ast.Constant) and node.args[1].value in private):
            found.append(f"line {node.lineno}: {node.func.id}(..., {node.args[1].value!r})")
        elif isinstance(node, ast.Constant) and isinstance(node.value, str):
            found += [f"line {node.lineno}: {m}" for m in re.findall(r"\blabkit\.[\w.]*\._\w+", node.value)
                      if m.rsplit(".", 1)[1] in private]
    return sorted(found, key=lambda use: int(use.split(":")[0].split()[1]))


def test_the_course_uses_no_private_name_of_the_engine():
    private = _private_names_of_labkit()
    assert {"_release", "_run_step"} <= private  # the scan sees labkit's privates
    offences = {name: uses for name, source in _course_sources() if (uses := _uses_of(private, source))}
    assert not offences, f"the course reaches into labkit's privates: {offences}"


def test_the_scan_finds_a_private_read_a_write_and_a_forbidden_path():
    private = {"_free_cached", "_victim"}
    source = ("bm._free_cached.clear()\nbm._free_cached = {}\n"
              "FORBIDDEN = ('labkit.engine.scheduler.Scheduler._victim',)\nself._free_cached = 1\n"
              "setattr(bm, '_free_cached', {})\ngetattr(bm, 'free_cached')\n")
    assert _uses_of(private, source) == ["line 1: ._free_cached", "line 2: ._free_cached",
                                         "line 3: labkit.engine.scheduler.Scheduler._victim",
                                         "line 5: setattr(..., '_free_cached')"]
