"""Make the student notebooks from the solutions (nbgrader's "assign" step).

In each code cell, a `### BEGIN SOLUTION` ... `### END SOLUTION` region becomes `# YOUR CODE HERE`
and `raise NotImplementedError()` at the marker's indentation, and a `### BEGIN HIDDEN TESTS` ...
`### END HIDDEN TESTS` region is dropped. A student notebook shows no output the student's own code
has not produced yet: cells with a solution region lose their outputs, and so does every later cell
that uses a name one of them defines, transitively through what those cells define (Lab 05's "same
tokens as labkit's: True" is only true once the student's attention works). So do check cells, whose
stored "✔ passed" would be untrue in a notebook nobody has solved yet. `# NBVAL_...` markers, which
only steer the test suite's replay of the solutions, are dropped. The first markdown cell gets the
notebook's "Open in Colab" badge (the address comes from `labkit_course.course`).
"""

import ast
import copy
import re
from pathlib import Path

import nbformat

from labkit_course.course import colab_badge

SOLUTION = ("### BEGIN SOLUTION", "### END SOLUTION")
HIDDEN = ("### BEGIN HIDDEN TESTS", "### END HIDDEN TESTS")
CHECK_CALL = re.compile(r"^\s*check\(", re.MULTILINE)
MARKER_LIKE = re.compile(r"#+\s*(BEGIN|END)\b")  # a misspelt marker must not pass silently
NBVAL_MARKER = re.compile(r"^[ \t]*#\s*NBVAL_\w+[ \t]*\n?", re.MULTILINE)
MAGIC_LINE = re.compile(r"^([ \t]*)%%?\w+[ \t]*", re.MULTILINE)  # `%time f(x)` runs f(x); `%%time` nothing
SHELL_LINE = re.compile(r"^([ \t]*)!.*$", re.MULTILINE)
IDENTIFIER = re.compile(r"[A-Za-z_]\w*")


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


def _loads(node: ast.AST) -> set[str]:
    return {n.id for n in ast.walk(node) if isinstance(n, ast.Name) and isinstance(n.ctx, ast.Load)}


def _targets(node: ast.AST | None) -> set[str]:
    return set() if node is None else {n.id for n in ast.walk(node) if isinstance(n, ast.Name)}


def _own_names(node: ast.AST) -> set[str]:
    """Names bound inside `node` for its own use: comprehension and lambda variables, and a defined
    function's parameters and locals. Reading them reads nothing from earlier cells."""
    bound: set[str] = set()
    for child in ast.walk(node):
        if isinstance(child, ast.comprehension):
            bound |= _targets(child.target)
        elif isinstance(child, ast.FunctionDef | ast.AsyncFunctionDef | ast.Lambda):
            bound |= {arg.arg for arg in ast.walk(child.args) if isinstance(arg, ast.arg)}
            if not isinstance(child, ast.Lambda):
                bound |= {n.id for stmt in child.body for n in ast.walk(stmt)
                          if isinstance(n, ast.Name) and isinstance(n.ctx, ast.Store)}
    return bound


class _CellNames:
    """Walks a cell's statements in order: what it reads from earlier cells (function bodies included),
    what it binds or mutates (`x = ...`, `def x`, `x.attr = ...`, `x[i] = ...`), what it imports."""

    def __init__(self, tree: ast.Module):
        self.used: set[str] = set()
        self.defined: set[str] = set()
        self.imported: set[str] = set()
        self.scan(tree.body)

    def read(self, node: ast.AST | None) -> None:
        if node is not None:
            self.used |= _loads(node) - _own_names(node) - self.defined - self.imported

    def scan(self, statements: list[ast.stmt]) -> None:
        for st in statements:
            if isinstance(st, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
                self.read(st)
                self.defined.add(st.name)
            elif isinstance(st, ast.For | ast.AsyncFor):
                self.read(st.iter)
                self.defined |= _targets(st.target)
                self.scan(st.body + st.orelse)
            elif isinstance(st, ast.While | ast.If):
                self.read(st.test)
                self.scan(st.body + st.orelse)
            elif isinstance(st, ast.With | ast.AsyncWith):
                for item in st.items:
                    self.read(item.context_expr)
                    self.defined |= _targets(item.optional_vars)
                self.scan(st.body)
            elif isinstance(st, ast.Try):
                self.scan(st.body)
                for handler in st.handlers:
                    self.read(handler.type)
                    self.defined |= {handler.name} if handler.name else set()
                    self.scan(handler.body)
                self.scan(st.orelse + st.finalbody)
            else:
                self.read(st)
                self.bind(st)

    def bind(self, st: ast.stmt) -> None:
        for node in ast.walk(st):
            if isinstance(node, ast.Import | ast.ImportFrom):
                self.imported |= {(alias.asname or alias.name).split(".")[0] for alias in node.names}
            elif isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store | ast.Del):
                self.defined.add(node.id)
            elif isinstance(node, ast.Attribute | ast.Subscript) and isinstance(node.ctx, ast.Store | ast.Del):
                base = node.value
                while isinstance(base, ast.Attribute | ast.Subscript):
                    base = base.value
                if isinstance(base, ast.Name):
                    self.defined.add(base.id)


def _functions_named(source: str) -> set[str]:
    """The names of every function and class a cell defines, methods included."""
    try:
        tree = ast.parse(MAGIC_LINE.sub(r"\1", SHELL_LINE.sub(r"\1pass", source)))
    except SyntaxError:
        return set()
    return {node.name for node in ast.walk(tree)
            if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef)}


def names_used_and_defined(source: str) -> tuple[set[str], set[str], set[str]]:
    """What a cell reads from earlier cells, what it binds or mutates, and what it imports. A cell
    Python cannot parse is taken to read every identifier in it."""
    try:
        names = _CellNames(ast.parse(MAGIC_LINE.sub(r"\1", SHELL_LINE.sub(r"\1pass", source))))
    except SyntaxError:
        return set(IDENTIFIER.findall(source)), set(), set()
    return names.used, names.defined - names.imported, names.imported


def student_notebook(nb: nbformat.NotebookNode, name: str) -> nbformat.NotebookNode:
    """The student version of a whole solution notebook."""
    student = copy.deepcopy(nb)
    students_names: set[str] = set()  # defined by the student's code, or computed from it
    for index, cell in enumerate(student.cells, start=1):
        where = f"{name}, cell {index}"
        if cell.cell_type != "code":
            if any(m in cell.source for m in (*SOLUTION, *HIDDEN)):
                raise MarkerError(f"{where}: solution markers are only allowed in code cells")
            continue
        source = student_source(cell.source, where)
        used, defined, imported = names_used_and_defined(cell.source)
        runs_student_code = source != cell.source or bool(used & students_names)
        if runs_student_code:
            students_names |= defined
        else:
            students_names -= defined  # rebound by course code: no longer the student's
        students_names -= imported
        # A cell that defines a function or method under a student's name (a BlockManager subclass
        # overriding take_free_block) shows no output either: beside the student's own function of that
        # name, a stored result would read as theirs.
        if runs_student_code or CHECK_CALL.search(source) or _functions_named(cell.source) & students_names:
            cell.outputs = []
            cell.execution_count = None
        cell.source = NBVAL_MARKER.sub("", source)
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
