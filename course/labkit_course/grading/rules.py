"""Course rules checked on the notebook as handed in: no reaching around the tripwires.

Inside a student's kernel, what an exercise forbids is a tripwire (`labkit_course.grading.forbidden`), and
code in that kernel can undo one. So the trusted side also reads the notebook itself, which no
kernel can change, and fails a lab whose own code uses the tools that undo or sidestep tripwires:
reading or rebuilding code at run time (`inspect`, `__code__`, `exec`, `importlib.reload`, ...), the
grading machinery (`labkit_course.grading` beyond `check`), torch's internal operators, other processes,
shell escapes and magics that run files or commands. Cells the same as the handed-out notebook's are
the course's own and are not checked; in a course cell the student edited, only what the edit adds.

This is a best-effort check of a course rule, not a proof: code obfuscated past what an AST shows,
or labkit's code retyped by hand, is not caught by machine (the README lists what is known).
"""

import ast
import difflib
import re
import sys
import types
from collections import Counter
from pathlib import Path

import nbformat
from IPython.core.inputtransformer2 import TransformerManager

from labkit_course.grading.assign import NBVAL_MARKER

CELL_LIMIT = 2**20  # a cell longer than this is not parsed: it breaks the rules by its size alone
MODULES = {  # importing these is reaching around the tripwires
    "inspect": "reads code at run time", "importlib": "reloads or re-imports modules",
    "imp": "reloads or re-imports modules", "ctypes": "calls C and reads memory directly",
    "cffi": "calls C directly", "gc": "finds objects the grader holds", "builtins": "replaces built-ins",
    "marshal": "builds code objects", "types": "builds functions from code objects",
    "runpy": "runs code from files", "code": "runs code from strings", "codeop": "compiles code at run time",
    "linecache": "reads source files", "pydoc": "reads source files", "pickle": "can call any function",
    "dill": "copies functions", "cloudpickle": "copies functions", "copyreg": "changes how objects copy",
    "zipimport": "imports code from archives", "subprocess": "runs other processes",
    "py_compile": "compiles code files", "compileall": "compiles code files", "site": "adds import paths",
    "pkgutil": "finds and loads modules", "mock": "patches objects by name",
    "multiprocessing": "runs other processes", "pty": "runs other processes",
}
NAMES = {"exec": "runs code from a string", "eval": "runs code from a string", "compile": "builds code objects",
         "__import__": "imports by name at run time", "get_ipython": "drives the kernel the grader talks to"}
DUNDERS = {"__code__", "__globals__", "__closure__", "__wrapped__", "__builtins__", "__dict__", "__subclasses__",
           "__func__", "__file__", "__loader__", "__spec__", "__defaults__", "__kwdefaults__", "__getattribute__",
           "__bases__", "__mro__", "__base__", "__self__", "__objclass__", "__array_interface__",
           "__array_struct__", "mro"}  # mro(): a base class's own method, past a guard on the class
FRAMES = {"f_back", "f_locals", "f_globals", "f_builtins", "f_code", "tb_frame", "tb_next", "gi_frame", "cr_frame",
          "ag_frame", "gi_code", "co_code", "co_consts"}
DYNAMIC_ATTRIBUTE = {"getattr"}  # setattr only writes: what it could write is reached by other means
NAMESPACE_READERS = {"getattr", "vars"}  # passed around (reduce(getattr, ...)), they reach by computed names
SYS_ATTRIBUTES = {"modules", "meta_path", "path_hooks", "path_importer_cache", "_getframe", "settrace",
                  "setprofile", "addaudithook", "path"}
PROCESS_MEMBERS = {"create_subprocess_exec", "create_subprocess_shell", "subprocess_exec", "subprocess_shell",
                   "ProcessPoolExecutor", "Popen"}
OS_ATTRIBUTES = re.compile(r"^(system|popen|exec\w*|spawn\w*|fork\w*|posix_spawn\w*|kill\w*|setsid)$")
GRADING_ALLOWED = {"check", "ExerciseFailed", "records"}
# The grading machinery named in a string, but for what students use.
GRADING_NAMED = re.compile(r"^labkit_course\.grading\.(?!(check|ExerciseFailed|records)(\.|$))\w")
MAGICS_RUNNING_CODE = {"time", "timeit", "capture", "prun"}  # their line and cell are checked as code
MAGICS_ALLOWED = {"matplotlib", "env", "pinfo", "pinfo2", "who", "whos", "who_ls", "config", "precision", "pprint",
                  "load_ext", "autoreload", "debug", "pdb", "history", "lsmagic", "magic", "xdel", "page"}
MAGIC_OPTIONS = re.compile(r"^\s*(?:-[nrpsTDl]\s*\S+\s+|-[tcqo]+\s+)*")  # -n 10, -r 3, -o ...
STAR_REFUSED = {"os", "posix", "nt", "sys"}  # `from os import *` then `system(...)`
CODE_RUNNERS = {"timeit": ("timeit", "repeat", "Timer"), "cProfile": ("run", "runctx"), "profile": ("run", "runctx"),
                "pdb": ("run", "runeval", "runctx"), "torch.utils.benchmark": ("Timer",)}  # they run strings


def course_cells(handed_out: nbformat.NotebookNode | None) -> set[str]:
    """The sources of the handed-out notebook's code cells, as `as_handed_out` writes them (empty
    without one)."""
    return {as_handed_out(c.source) for c in handed_out.cells if c.cell_type == "code"} if handed_out else set()


def as_handed_out(source: str) -> str:
    """A cell's source as compared with the handed-out notebook's: without the test suite's `# NBVAL_...`
    markers (which the handed-out notebooks drop) and without trailing spaces and blank lines."""
    return "\n".join(line.rstrip() for line in NBVAL_MARKER.sub("", source).strip("\n").splitlines())


def violations(nb: nbformat.NotebookNode, handed_out: nbformat.NotebookNode | None) -> list[str]:
    """What the notebook's own cells (those not as handed out) do that the course rules forbid, one
    line each, naming the cell. A name is read as every module any cell binds it to (`import torch as
    T` in one cell makes `T.ops` in another `torch.ops`). A course cell the student edited answers
    only for what the edit added: what the handed-out cell most like it already does is not counted."""
    course = course_cells(handed_out)
    aliases = notebook_aliases(nb)
    found = []
    for number, cell in enumerate(nb.cells, start=1):
        if cell.cell_type != "code" or as_handed_out(cell.source) in course:
            continue
        added = Counter(cell_violations(cell.source, aliases))
        original = _closest(as_handed_out(cell.source), course)
        if original is not None:
            added -= Counter(cell_violations(original, aliases))
        first = next((line.strip() for line in cell.source.splitlines() if line.strip()), "")
        found += [f"cell {number} (`{first[:40]}`) {what}" for what in added]
    return list(dict.fromkeys(found))


def _closest(source: str, course: set[str]) -> str | None:
    """The handed-out cell this one most likely is, edited (at least 60% alike), or None."""
    scored = [(difflib.SequenceMatcher(None, source, c, autojunk=False).ratio(), c) for c in course]
    best = max(scored, default=(0.0, None))
    return best[1] if best[0] >= 0.6 else None


def notebook_aliases(nb: nbformat.NotebookNode) -> dict[str, set[str]]:
    """Every name a cell's imports bind, and the modules (or module members) it is bound to; then every name a
    cell assigns such a module to (`lc = labkit_course`, `interp = triton.runtime.interpreter`)."""
    aliases: dict[str, set[str]] = {}
    nodes = [node for cell in nb.cells if cell.cell_type == "code" and len(cell.source) <= CELL_LIMIT
             for node in ast.walk(_parse(cell.source) or ast.Module(body=[], type_ignores=[]))]
    for node in nodes:
        if isinstance(node, ast.Import):
            for alias in node.names:
                name = alias.asname or alias.name.split(".")[0]
                aliases.setdefault(name, set()).add(alias.name if alias.asname else alias.name.split(".")[0])
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            for alias in node.names:
                aliases.setdefault(alias.asname or alias.name, set()).add(f"{node.module}.{alias.name}")
    for node in nodes:
        if isinstance(node, ast.Assign | ast.AnnAssign | ast.NamedExpr) and node.value is not None:
            modules = _bases(node.value, aliases) if isinstance(node.value, ast.Name | ast.Attribute) else set()
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            for target in targets:
                if modules and isinstance(target, ast.Name):
                    aliases.setdefault(target.id, set()).update(modules)
    return aliases


def cell_violations(source: str, aliases: dict[str, set[str]] | None = None) -> list[str]:
    """What one cell does that the rules forbid. The cell is read as IPython runs it (its magics and
    shell escapes turned into the calls they make); a cell that is not Python even then cannot run."""
    if len(source) > CELL_LIMIT:
        return [f"is over {CELL_LIMIT // 2**10} KiB, too long to check"]
    tree = _parse(source)
    if tree is None:
        return []
    if aliases is None:
        aliases = notebook_aliases(nbformat.v4.new_notebook(cells=[nbformat.v4.new_code_cell(source)]))
    found: list[str] = []
    called = {id(node.func) for node in ast.walk(tree) if isinstance(node, ast.Call)}
    todo: list[ast.AST] = [tree]
    while todo:
        node = todo.pop()
        magic = _ipython_call(node)
        if magic is not None:
            found += _magic_violations(*magic, aliases)
            continue
        if isinstance(node, ast.Name) and node.id in NAMESPACE_READERS and id(node) not in called:
            found.append(f"passes `{node.id}` around as a value, which hides what it reaches")
        found += _node_violations(node, aliases)
        todo += ast.iter_child_nodes(node)
    return found


def _parse(source: str) -> ast.Module | None:
    """The cell as IPython runs it, or None if even IPython could not (then it never runs)."""
    try:
        return ast.parse(TransformerManager().transform_cell(source))
    except (SyntaxError, ValueError, RecursionError, MemoryError):
        return None


def _ipython_call(node: ast.AST) -> tuple[str, list] | None:
    """("magic name" or "!", its string arguments) for `get_ipython().<method>(...)`, as IPython
    writes magics and shell escapes."""
    if not (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
            and isinstance(node.func.value, ast.Call) and isinstance(node.func.value.func, ast.Name)
            and node.func.value.func.id == "get_ipython"):
        return None
    args = [a.value if isinstance(a, ast.Constant) else None for a in node.args]
    if node.func.attr in ("run_line_magic", "run_cell_magic") and args and isinstance(args[0], str):
        return args[0], args[1:]
    return ("!", args) if node.func.attr in ("system", "getoutput") else None


def _magic_violations(name: str, args: list, aliases: dict[str, set[str]]) -> list[str]:
    if name in MAGICS_RUNNING_CODE:  # %time, %%capture...: their line (less options) and cell run as code
        if not all(isinstance(a, str) for a in args):
            return [f"runs `%{name}` on code that cannot be checked"]
        line, *cell = args
        return _code_violations([MAGIC_OPTIONS.sub("", line), *cell], f"`%{name}`", aliases)
    if name in MAGICS_ALLOWED:
        return []
    shown = "a shell command" if name == "!" else f"the magic `%{name}`"
    return [f"runs {shown} (magics that run shell commands, write or run files, or install are not allowed)"]


def _code_violations(sources: list, runner: str, aliases: dict[str, set[str]]) -> list[str]:
    """What code handed to `runner` as strings (a magic's cell, timeit's statement) does."""
    found = [v for code in sources if isinstance(code, str) for v in cell_violations(code, aliases)]
    unreadable = [code for code in sources if not isinstance(code, str) or code.strip() and not _parses(code)]
    return found + ([f"runs {runner} on code that cannot be checked"] if unreadable else [])


def _parses(code: str) -> bool:
    try:
        ast.parse(code)
    except (SyntaxError, ValueError, RecursionError, MemoryError):
        return False
    return True


def _node_violations(node: ast.AST, aliases: dict[str, set[str]]) -> list[str]:
    if isinstance(node, ast.Import):
        return [v for alias in node.names for v in _module_violations(alias.name)]
    if isinstance(node, ast.ImportFrom):
        if node.level:
            return [f"imports from `{'.' * node.level}{node.module or ''}`, a module of the notebook's folder"]
        module = node.module or ""
        found = _module_violations(module)
        if any(alias.name == "*" for alias in node.names) and _resolve(module) in STAR_REFUSED | set(MODULES):
            found.append(f"imports * from `{module}`, which hides what it brings in")
        for alias in node.names:  # `from x import y` reaches what `x.y` does
            found += _member_violations(_resolve(module), alias.name) + _module_violations(f"{module}.{alias.name}")
            if alias.name in MODULES:
                found.append(f"imports `{alias.name}` from `{module}`, which {MODULES[alias.name]}")
        return found
    if isinstance(node, ast.Name):
        return _name_violations(node.id, aliases)
    if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "super" and node.args:
        return ["uses `super(...)` with arguments, which reaches a base class's methods past the course's guards"]
    if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "vars" and node.args:
        modules = _bases(node.args[0], aliases)
        if modules:  # a module's namespace: what it holds, by computed names (vars(labkit_course)["grad" + "ing"])
            return [f"uses `vars` on the module `{sorted(modules)[0]}`, which reaches what it holds by computed names"]
    if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id in DYNAMIC_ATTRIBUTE:
        name = node.args[1] if len(node.args) > 1 else None
        if not (isinstance(name, ast.Constant) and isinstance(name.value, str)):
            return [f"uses `{node.func.id}` with a computed name, which hides what it reaches"]
        return _attribute_violations(name.value, node.args[0], aliases)  # getattr(x, "y") reaches x.y
    if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute):
        runner = next((b for b in _bases(node.func.value, aliases) if node.func.attr in CODE_RUNNERS.get(b, ())), None)
        strings = [a for a in [*node.args, *(k.value for k in node.keywords)] if isinstance(a, ast.Constant)
                   and isinstance(a.value, str)]
        if runner is not None and strings:  # timeit.timeit("exec(...)"): the string is code too
            return _code_violations([a.value for a in strings], f"`{runner}.{node.func.attr}`", aliases)
        if runner in ("pdb", "cProfile", "profile") and node.args:  # they take code only as a string
            return [f"runs `{runner}.{node.func.attr}` on code built at run time"]
    if isinstance(node, ast.Attribute):
        return _attribute_violations(node.attr, node.value, aliases)
    if isinstance(node, ast.Constant) and isinstance(node.value, str):
        if node.value in DUNDERS:
            return [f"names `{node.value}`, which reaches into code and modules"]
        if GRADING_NAMED.match(node.value):  # mock.patch("labkit_course.grading.forbidden.Tripwires.armed")
            return [f"names `{node.value[:60]}`, the grading machinery"]
    return []


def _name_violations(name: str, aliases: dict[str, set[str]]) -> list[str]:
    if name in NAMES:
        return [f"uses `{name}`, which {NAMES[name]}"]
    if name in DUNDERS:
        return [f"uses `{name}`, which reaches into code and modules"]
    return [v for module in aliases.get(name, ()) for v in _module_violations(module)]  # a course cell's import


def _attribute_violations(attr: str, owner: ast.expr, aliases: dict[str, set[str]]) -> list[str]:
    if attr in DUNDERS:
        return [f"uses `{attr}`, which reaches into code and modules"]
    if attr in FRAMES:
        return [f"uses `{attr}`, which reaches into the grader's frames and code"]
    bases = _bases(owner, aliases)
    if attr in ("attrgetter", "methodcaller") and "operator" in bases:
        return [f"uses `operator.{attr}`, which reaches attributes by computed names"]
    return [v for base in bases for v in _member_violations(base, attr)]


def _bases(owner: ast.expr, aliases: dict[str, set[str]]) -> set[str]:
    """What `owner` (x, or x.y.z) may be, as dotted names through modules: its first name read through
    every import that binds it, then each step through a module attribute named by the module it reaches."""
    dotted = _dotted(owner)
    first, _, rest = dotted.partition(".")
    if first not in aliases:  # a variable (`code`, `site`, `model`), not a module the notebook imported
        return set()
    return {_resolve(f"{start}.{rest}" if rest else start) for start in aliases[first]}


def _resolve(dotted: str) -> str:
    """`os.sys` -> `sys`, `dataclasses.inspect` -> `inspect`: follows module attributes that hold modules,
    among the modules already imported here (nothing is imported for it)."""
    parts = dotted.split(".")
    for cut in range(len(parts), 0, -1):
        module = sys.modules.get(".".join(parts[:cut]))
        if module is not None:
            break
    else:
        return dotted
    name, rest = module.__name__, parts[cut:]
    while rest and isinstance(vars(module).get(rest[0]), types.ModuleType):
        module = vars(module)[rest[0]]
        name, rest = module.__name__, rest[1:]
    return ".".join([name, *rest])


def _member_violations(base: str, name: str) -> list[str]:
    """What `base.name` (an attribute, or `from base import name`) reaches, if the rules forbid it."""
    if name in PROCESS_MEMBERS or (base, name) == ("torch", "multiprocessing"):
        return [f"uses `{name}`, which runs other processes"]
    flagged = [part for part in base.split(".") if part in MODULES]
    if flagged:  # a member of a module the rules refuse, however it was reached
        return [f"uses `{base}.{name}`, which {MODULES[flagged[0]]}"]
    if base == "sys" and name in SYS_ATTRIBUTES:
        return [f"uses `sys.{name}`, which reaches around the grader"]
    if base in ("os", "posix", "nt") and OS_ATTRIBUTES.match(name):
        return [f"uses `{base}.{name}`, which runs or signals other processes"]
    internal = name.startswith("_") and not name.endswith("__") or name in ("ops", "library")
    if base == "torch" and internal:
        return [f"uses `torch.{name}`, torch's internal operators"]
    if (base, name) == ("labkit_course", "grading") or GRADING_NAMED.match(f"{base}.{name}"):
        return [f"uses `{base}.{name}`, the grading machinery"]
    return []


def _module_violations(name: str) -> list[str]:
    flagged = [part for part in name.split(".") if part in MODULES]  # torch.multiprocessing too
    if flagged:
        return [f"imports `{name}`, which {MODULES[flagged[0]]}"]
    if name.startswith("labkit_course.grading.") and name.split(".")[2] not in GRADING_ALLOWED:
        return [f"imports `{name}`, the grading machinery"]
    parts = name.split(".")  # `import torch._C as C` reaches what `torch._C` does
    return next((found for cut in range(1, len(parts)) if (found := _member_violations(".".join(parts[:cut]),
                                                                                       parts[cut]))), [])


def _dotted(node: ast.expr) -> str:
    parts = []
    while isinstance(node, ast.Attribute):
        parts.append(node.attr)
        node = node.value
    if not isinstance(node, ast.Name):
        return ""
    return ".".join([node.id, *reversed(parts)])


def handed_out(lab: str, root: Path) -> nbformat.NotebookNode | None:
    """The student notebook of `lab` as the course hands it out (None if the course has none)."""
    found = sorted((root / "notebooks").glob(f"{lab}_*.ipynb"))
    return nbformat.read(found[0], as_version=4) if found else None
