"""Make the student notebooks from the solutions (nbgrader's "assign" step).

In each code cell, a `### BEGIN SOLUTION` ... `### END SOLUTION` region becomes `# YOUR CODE HERE`
and `raise NotImplementedError()` at the marker's indentation, and a `### BEGIN HIDDEN TESTS` ...
`### END HIDDEN TESTS` region is dropped. Cells that change lose their outputs, and so do check
cells, whose stored "✔ passed" would be untrue in a notebook nobody has solved yet. The first
markdown cell gets the notebook's "Open in Colab" badge (the address comes from `labkit.course`).
"""

import copy
import re
from pathlib import Path

import nbformat

from labkit.course import colab_badge

SOLUTION = ("### BEGIN SOLUTION", "### END SOLUTION")
HIDDEN = ("### BEGIN HIDDEN TESTS", "### END HIDDEN TESTS")
CHECK_CALL = re.compile(r"^\s*check\(", re.MULTILINE)
MARKER_LIKE = re.compile(r"#+\s*(BEGIN|END)\b")  # a misspelt marker must not pass silently


class MarkerError(ValueError):
    """A marker that is unterminated, unopened, nested or misplaced; names notebook and cell."""


def student_source(source: str, where: str) -> str:
    """The student version of one code cell's source."""
    out: list[str] = []
    open_marker: tuple[str, int] | None = None  # (kind, line number)
    for lineno, line in enumerate(source.splitlines(), start=1):
        stripped = line.strip()
        for begin, end in (SOLUTION, HIDDEN):
            if stripped == begin:
                if open_marker:
                    raise MarkerError(f"{where}, line {lineno}: {begin} inside the region opened on "
                                      f"line {open_marker[1]} ({open_marker[0]})")
                open_marker = (begin, lineno)
                if begin == SOLUTION[0]:
                    indent = line[: len(line) - len(line.lstrip())]
                    out += [f"{indent}# YOUR CODE HERE", f"{indent}raise NotImplementedError()"]
                break
            if stripped == end:
                if not open_marker or open_marker[0] != begin:
                    raise MarkerError(f"{where}, line {lineno}: {end} without a matching {begin}")
                open_marker = None
                break
        else:
            if MARKER_LIKE.match(stripped):
                raise MarkerError(f"{where}, line {lineno}: unknown marker {stripped!r}")
            if open_marker is None:
                out.append(line)
    if open_marker:
        raise MarkerError(f"{where}: {open_marker[0]} on line {open_marker[1]} is never closed")
    return "\n".join(out)


def student_notebook(nb: nbformat.NotebookNode, name: str) -> nbformat.NotebookNode:
    """The student version of a whole solution notebook."""
    student = copy.deepcopy(nb)
    for index, cell in enumerate(student.cells, start=1):
        where = f"{name}, cell {index}"
        if cell.cell_type != "code":
            if any(m in cell.source for m in (*SOLUTION, *HIDDEN)):
                raise MarkerError(f"{where}: solution markers are only allowed in code cells")
            continue
        source = student_source(cell.source, where)
        if source != cell.source or CHECK_CALL.search(source):
            cell.source = source
            cell.outputs = []
            cell.execution_count = None
    add_colab_badge(student, name)
    return student


def add_colab_badge(nb: nbformat.NotebookNode, name: str) -> None:
    """Put the notebook's "Open in Colab" badge on the first line of its first markdown cell (if any)."""
    cell = next((c for c in nb.cells if c.cell_type == "markdown"), None)
    if cell is not None:
        cell.source = f"{colab_badge(name)}\n\n{cell.source}"


def generate(solutions: Path, notebooks: Path, check_only: bool = False) -> list[Path]:
    """Write (or, with check_only, compare) every student notebook; return those that differ."""
    differing = []
    for path in sorted(solutions.glob("*.ipynb")):
        nb = nbformat.read(path, as_version=nbformat.NO_CONVERT)
        text = nbformat.writes(student_notebook(nb, path.name)) + "\n"
        target = notebooks / path.name
        if not target.exists() or target.read_text(encoding="utf-8") != text:
            differing.append(target)
            if not check_only:
                notebooks.mkdir(parents=True, exist_ok=True)
                target.write_text(text, encoding="utf-8")
    expected = {p.name for p in solutions.glob("*.ipynb")}
    for stale in sorted(notebooks.glob("*.ipynb")):
        if stale.name not in expected:
            differing.append(stale)
            if not check_only:
                stale.unlink()
    return differing
