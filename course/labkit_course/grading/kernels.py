"""A graded Triton kernel is the student's own Triton: what the grader's agent checks before and during a launch.

On a GPU Triton compiles a kernel, so a kernel can only be Triton: `tl` operations and other `@triton.jit`
functions. Under Triton's CPU interpreter (TRITON_INTERPRET=1) a kernel is plain Python, which can call
anything: torch, labkit's reference, numpy over raw memory. So before an interpreted launch the kernel must
also get through Triton's own compiler front end (to Triton IR for a GPU) with the launch's arguments, which
refuses all of that as a GPU would (graded; a notebook's own check cell has not kept triton.language as
imported, `remember_triton`, and skips it). What the front end does not see is refused beside it: what the kernels
name that Triton would run as Python while compiling (a `constexpr_function` or a "builtin" of the student's,
a constexpr holding an object of its own), functions of Triton, numpy or torch's tensors that the notebook
replaced (the interpreter hands them the grader's tensors), and labkit's own kernels in any form, also as
plain Python while the launch runs.

Like the tripwires (`labkit_course.grading.forbidden`), this runs in the student's process: it holds against
what the course rules (`labkit_course.grading.rules`) let a notebook do, not against code that reaches in here.
"""

import ast
import dis
import functools
import importlib.util
import inspect
import os
import site
import sys
import sysconfig
import textwrap
import types
from contextlib import contextmanager

from labkit_course.grading.core import ExerciseFailed
from labkit_course.grading.forbidden import ForbiddenCall, Tripwires, explain, unguarded

OWN_KERNELS = "labkit.attention.triton_kernels.jit_kernels"  # what Lab 08's exercises forbid: labkit's kernels
GPU_TARGET = ("cuda", 80, 32)  # the front end compiles for an A100: Triton IR does not depend on the GPU model
PLAIN = (int, float, bool, str, type(None))  # what a constexpr may hold: nothing of the student's runs on it
MACHINERY = ("triton", "numpy")  # the packages whose functions an interpreted launch runs
TENSOR_CLASSES = ("Tensor", "UntypedStorage", "TypedStorage")  # torch's classes it calls methods of
PRINTS = ("print", "static_print", "device_print")  # what a graded kernel may not call (see _check_what_it_names)
CODE_HOLDERS = (types.FunctionType, staticmethod, classmethod, property, functools.partial)


class NotTriton(ExerciseFailed):
    """The kernel is not Triton that a GPU could compile; the message says why (the student's feedback)."""


def check_triton_kernel(kernel, args=None, kwargs=None) -> list:
    """Refuse what is not a `@triton.jit` function, exactly (anything else with `kernel[grid](...)`, such as
    a subclass of triton's KernelInterface, can run torch code), a kernel that calls one of labkit's own
    kernels, and, given the launch's arguments under the interpreter, a kernel that is not Triton a GPU could
    compile: TypeError, ForbiddenCall or NotTriton, whose message is the student's feedback. Returns the
    kernels it reaches (`_kernels_reached`)."""
    if type(kernel) not in _kernel_types():
        raise TypeError(f"a {type(kernel).__name__} is not a Triton kernel: define it with @triton.jit")
    if getattr(kernel, "pre_run_hooks", None):
        raise TypeError("the kernel has pre-run hooks (add_pre_run_hook), Python that runs before the grid: "
                        "a graded kernel is the @triton.jit function alone")
    reached = _kernels_reached(kernel)
    used = _labkit_kernel_used(reached)
    if used:
        raise ForbiddenCall(explain(used))
    if args is not None and _interpreted(kernel):
        for jit in reached:
            _check_what_it_names(jit)
        bound = inspect.signature(kernel.fn).bind(*args, **kwargs or {})
        bound.apply_defaults()
        _check_arguments(kernel, bound.arguments)
        if _PRISTINE:  # graded (and in the tests); a notebook's own check cell has not kept triton as imported
            _compile_front_end(kernel, bound.arguments)
    replaced = _machinery_replaced()  # last: compiling may have run code of the student's
    if replaced:
        raise TypeError(f"`{replaced}` is not the function its package defines: the notebook replaced it, and a "
                        "launch runs it, so the grader cannot launch your kernel")
    return reached


def _interpreted(kernel) -> bool:
    from triton.runtime.interpreter import InterpretedFunction

    return type(kernel) is InterpretedFunction


def _kernel_types() -> tuple[type, ...]:
    """What `@triton.jit` returns: a JITFunction, or under TRITON_INTERPRET=1 an InterpretedFunction."""
    from triton.runtime.interpreter import InterpretedFunction
    from triton.runtime.jit import JITFunction

    return JITFunction, InterpretedFunction


# --- labkit's own kernels ----------------------------------------------------------------------------------

def _labkit_kernel_used(reached: list) -> str | None:
    """The dotted path of a labkit kernel among the `reached` ones (a kernel and what it calls): one defined
    in a labkit module, or one of the very kernels labkit's paged attention runs (their code, whatever their
    `__module__` was made to say)."""
    own = {id(code): f"labkit.attention.triton_kernels.{k.fn.__name__}"
           for k in _labkit_kernels() for code in (k.fn, k.fn.__code__)}
    for jit in reached:
        if id(jit.fn) in own or id(jit.fn.__code__) in own:
            return own[id(jit.fn.__code__)]
        if jit.fn.__module__.split(".")[0] in ("labkit", "labkit_course"):
            return f"{jit.fn.__module__}.{jit.fn.__name__}"
    return None


def _labkit_kernels() -> tuple:
    """labkit's store and paged-attention kernels (`jit_kernels` itself, not a guard or tripwire standing for it)."""
    return unguarded(OWN_KERNELS)()[:2]


@contextmanager
def labkit_kernels_refused(kernel, reached: list, wires: Tripwires):
    """Under Triton's interpreter a kernel is plain Python, which can reach labkit's kernels by routes no look
    at its code follows: `globals()[...]`, a kernel's Python function (`.fn`), the interpreter's rewrite of it
    (`.rewrite()`). For the launch, labkit's kernels refuse to be launched or called, and what their code
    names (`tl`: in their closure, and for a rewrite in their module's globals) refuses to be used, so no
    copy of their function runs either. The student's kernels are rewritten from their own source, since the
    interpreter keeps each kernel's rewritten function in a cache keyed by its Python function, which the
    student's code could fill."""
    from triton.runtime.interpreter import InterpretedFunction

    if not _interpreted(kernel):
        yield
        return

    def refused(*args, **kwargs):
        wires.tripped.append(OWN_KERNELS)
        raise ForbiddenCall(explain(OWN_KERNELS))

    class RefusedKernel(InterpretedFunction):
        __getitem__ = run = __call__ = refused

    for jit in reached:
        InterpretedFunction.rewritten_fn.pop(jit.fn, None)
    kernels = [k for k in _labkit_kernels() if type(k) is InterpretedFunction]
    functions = [k.fn for k in kernels]
    # labkit's kernels are nested in jit_kernels: what they name lives in closure cells, and a rewrite made
    # from their source looks the same names up in their module's globals
    cells = list({id(cell): cell for fn in functions for cell in fn.__closure__ or ()}.values())
    contents = [cell.cell_contents for cell in cells]
    free = {name for fn in functions for name in fn.__code__.co_freevars}
    module = functions[0].__globals__
    module_saved = {name: module[name] for name in free if name in module}
    standing = _Refused(refused)
    for k in kernels:
        k.__class__ = RefusedKernel
    for cell in cells:
        cell.cell_contents = standing
    module.update(dict.fromkeys(free, standing))
    try:
        yield
    finally:
        if any(module.get(name) is not standing for name in free) or any(
                cell.cell_contents is not standing for cell in cells):  # Python in the launch put one back
            wires.tripped.append(OWN_KERNELS)
        for k in kernels:
            k.__class__ = InterpretedFunction
        for cell, value in zip(cells, contents, strict=True):
            cell.cell_contents = value
        for name in free:
            module.pop(name, None)
        module.update(module_saved)


class _Refused:
    """What labkit's kernels' code finds for the names it uses during a graded launch: any use refuses."""

    def __init__(self, refuse):
        self._refuse = refuse

    def __getattr__(self, name):
        self._refuse()

    def __call__(self, *args, **kwargs):
        self._refuse()

    def __getitem__(self, key):
        self._refuse()


# --- what a kernel reaches -----------------------------------------------------------------------------------

def _kernels_reached(kernel) -> list:
    """`kernel` and the `@triton.jit` functions its code can call: the names it uses, looked up in its globals
    and closure, in the modules and classes it names, in objects' attributes and in lists, tuples and dicts,
    followed through each kernel found."""
    types_, seen, todo, reached = _kernel_types(), set(), [kernel], []
    while todo:
        jit = todo.pop()
        fn = jit.fn
        if id(fn) in seen:
            continue
        seen.add(id(fn))
        reached.append(jit)
        names = _names(fn.__code__)
        scope = _scope(fn)
        for value in (scope[n] for n in names if n in scope):
            todo += _kernels_in(value, names, types_)
    return reached


def _kernels_in(value, names: set[str], types_: tuple[type, ...], depth: int = 2) -> list:
    """The kernels `value` is or holds within `depth` steps: by the code's names in a module, a class or an
    object (read statically: no property or `__getattr__` of the student's runs), and the items of a short
    list, tuple or dict."""
    if type(value) in types_:
        return [value]
    if depth == 0:
        return []
    if isinstance(value, list | tuple | dict):
        items = list(value.values() if isinstance(value, dict) else value)
        return [k for item in items[:64] for k in _kernels_in(item, names, types_, depth - 1)]
    found = []
    for name in names:
        try:
            member = inspect.getattr_static(value, name)
        except Exception:  # noqa: BLE001 - not there, or an object that refuses to be looked at
            continue
        found += _kernels_in(getattr(member, "__func__", member), names, types_, depth - 1)  # a staticmethod's too
    return found


def _scope(fn) -> dict:
    """The globals a function sees, with its closure's cells over them."""
    scope = dict(fn.__globals__)
    for name, cell in zip(fn.__code__.co_freevars, fn.__closure__ or (), strict=True):
        try:
            scope[name] = cell.cell_contents
        except ValueError:  # an empty cell
            pass
    return scope


def _codes(code: types.CodeType):
    """A function's code and the code nested in it."""
    yield code
    for const in code.co_consts:
        if isinstance(const, types.CodeType):
            yield from _codes(const)


def _names(code: types.CodeType) -> set[str]:
    """Every global, attribute and free name a function's code (and the code nested in it) uses."""
    return {name for c in _codes(code) for name in (*c.co_names, *c.co_freevars)}


def _looked_up(code: types.CodeType) -> set[str]:
    """The names a function's code (and the code nested in it) looks up as globals or closure variables."""
    return {i.argval for c in _codes(code) for i in dis.get_instructions(c)
            if i.opname in ("LOAD_GLOBAL", "LOAD_NAME", "LOAD_DEREF", "LOAD_CLASSDEREF")}


# --- Triton a GPU could compile ------------------------------------------------------------------------------

def _check_what_it_names(jit) -> None:
    """What a kernel names must be Triton's (its modules, builtins, classes, constexpr functions), a kernel, or
    a constexpr holding a plain value: Triton runs anything else it accepts (a `constexpr_function`, a function
    marked as a builtin, a constexpr's own methods) as Python while it compiles, which could make the compiled
    kernel and the interpreted one differ."""
    import triton.language as tl

    fn = jit.fn
    scope = _scope(fn)
    lines = inspect.getsourcelines(fn)[0]
    if sum(line.strip().startswith("def ") for line in lines) != 1:  # what the interpreter runs: see the message
        raise NotTriton(f"the source of your kernel `{fn.__name__}` has more than one line starting with `def` (a "
                        "nested function, or a string): Triton's interpreter runs the function from the last such "
                        "line and its compiler the first, so a graded kernel has just one")
    printing = [node for node in ast.walk(ast.parse(textwrap.dedent("".join(lines))))
                if isinstance(node, ast.Name) and node.id in PRINTS or isinstance(node, ast.Attribute)
                and node.attr in PRINTS]
    for name in sorted(_looked_up(fn.__code__) & scope.keys()):
        value = scope[name]
        if value is print or _triton_own(value) and getattr(value, "__name__", None) in PRINTS:
            printing.append(name)
        elif not (type(value) in (*_kernel_types(), *PLAIN, tl.dtype, tl.pointer_type) or _triton_own(value)
                  or type(value) is tl.constexpr and _plain(value.value)):
            raise NotTriton(f"your kernel `{fn.__name__}` uses `{name}`, a {type(value).__name__} that is not "
                            "Triton's, which Triton would run as Python: a graded kernel uses only triton.language, "
                            "other @triton.jit functions and constexprs of numbers, strings or booleans")
    if printing:  # under the interpreter a print is Python's, whose output and formatting the notebook controls
        raise NotTriton(f"your kernel `{fn.__name__}` prints (print, tl.static_print or tl.device_print): remove the "
                        "prints from a kernel you hand in")
    for parameter in inspect.signature(fn).parameters.values():
        annotation = parameter.annotation
        if not (annotation is inspect.Parameter.empty or annotation is tl.constexpr or type(annotation) is str
                or _triton_own(annotation) or type(annotation) in (tl.dtype, tl.pointer_type)):
            raise NotTriton(f"the parameter `{parameter.name}` of `{fn.__name__}` is annotated with a "
                            f"{type(annotation).__name__}: use tl.constexpr or leave it unannotated")


def _plain(value) -> bool:
    return type(value) in PLAIN or type(value) is tuple and all(_plain(v) for v in value)


def _triton_own(value) -> bool:
    """Whether `value` is Triton's own: one of its modules, or a class, function or object of one of its classes
    that one of its modules holds under the value's name (read without running anything of the notebook's)."""
    kind = type(value)
    if kind is types.ModuleType:
        return value.__name__.partition(".")[0] == "triton" and sys.modules.get(value.__name__) is value
    if kind is type:
        module, name = vars(value).get("__module__"), value.__name__
    elif kind is types.FunctionType or _triton_own(kind):  # a class of Triton's runs only Triton's code here
        module, name = getattr(value, "__module__", None), getattr(value, "__name__", None)
    else:
        return False
    if not (isinstance(module, str) and module.partition(".")[0] == "triton" and isinstance(name, str)):
        return False
    home = sys.modules.get(module)
    return home is not None and vars(home).get(name) is value and not _foreign(value)


def _check_arguments(kernel, arguments: dict) -> None:
    """The launch's arguments, defaults included, are the grader's tensors and plain values: an object of the
    notebook's (a default) would run its own methods while Triton compiles or launches the kernel."""
    import torch
    import triton.language as tl

    for name, value in arguments.items():
        if not (type(value) is torch.Tensor or _plain(value) or type(value) in (tl.constexpr, tl.dtype)):
            raise NotTriton(f"`{name}` of `{kernel.fn.__name__}` is a {type(value).__name__}: a graded kernel's "
                            "parameters take tensors and numbers, its defaults numbers, strings or booleans")


def _compile_front_end(kernel, arguments: dict) -> None:
    """Compile the kernel to Triton IR for a GPU, as launching it there with `arguments` would: a kernel that
    calls plain Python (torch, numpy, a function of the notebook's) or reads the interpreter's internals does
    not compile. Each of its kernels is compiled as the function it is, its helpers as kernels."""
    from triton._C.libtriton import ir
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource
    from triton.compiler.compiler import make_backend
    from triton.runtime.jit import mangle_type

    jit = _for_compiler(kernel, {})
    signature, constants = {}, {}
    for parameter in jit.params:
        value = arguments[parameter.name]
        if parameter.is_constexpr or value is None:
            signature[parameter.name], constants[parameter.name] = "constexpr", value
        else:
            signature[parameter.name] = mangle_type(value)
    target = GPUTarget(*GPU_TARGET)
    backend = make_backend(target)
    options = backend.parse_options({})
    context = ir.context()
    ir.load_dialects(context)
    backend.load_dialects(context)
    try:
        with _triton_compiles():
            ASTSource(jit, signature, constants).make_ir(
                target, options, backend.get_codegen_implementation(options), backend.get_module_map(), context)
    except Exception as error:  # noqa: BLE001 - Triton's compile errors come in many types
        while error.__cause__ is not None:  # an error in a function the kernel calls: that function's
            error = error.__cause__
        lines = [line.strip() for line in str(error).strip().splitlines() if line.strip()]
        raise NotTriton(f"your kernel would not compile for a GPU, so it is not graded as Triton (under the CPU "
                        f"interpreter a kernel may run Python a GPU cannot): {(lines or [''])[-1][:400]}") from None


def _for_compiler(kernel, made: dict):
    """A JITFunction of `kernel`'s function whose globals and closure hold JITFunctions for the kernels it
    names: under the interpreter they are InterpretedFunctions, which Triton's compiler does not take."""
    from triton.runtime.jit import JITFunction

    fn = kernel.fn
    if id(fn) in made:
        return made[id(fn)]
    scope = dict(fn.__globals__)
    cells = tuple(types.CellType(_compiled_or_same(cell, made)) for cell in fn.__closure__ or ())
    copy = types.FunctionType(fn.__code__, scope, fn.__name__, fn.__defaults__, cells or None)
    copy.__kwdefaults__, copy.__annotations__ = fn.__kwdefaults__, fn.__annotations__
    copy.__qualname__ = fn.__qualname__
    made[id(fn)] = JITFunction(copy)
    for name in _looked_up(fn.__code__) & scope.keys():
        if type(scope[name]) in _kernel_types():
            scope[name] = _for_compiler(scope[name], made)
    return made[id(fn)]


_PRISTINE: list[tuple[object, dict]] = []  # triton's modules and classes as imported, before any launch


def remember_triton() -> None:
    """Keep Triton's modules and classes as they are before any kernel runs (graded, before the notebook's
    first cell), for compiling and launching the student's kernels on them (`pristine_triton`). Triton is
    imported as the labs' first cells import it: interpreted where there is no CUDA. (Nothing without triton.)"""
    if _PRISTINE or importlib.util.find_spec("triton") is None:
        return
    import torch

    if not torch.cuda.is_available():
        os.environ.setdefault("TRITON_INTERPRET", "1")
    import triton.language  # noqa: F401 - its modules are what is kept
    import triton.runtime.interpreter  # noqa: F401

    for name, module in list(sys.modules.items()):
        if module is not None and name.partition(".")[0] == "triton":
            _PRISTINE.append((module, dict(vars(module))))
            _PRISTINE.extend((value, dict(vars(value))) for value in vars(module).values()
                             if type(value) is type and value.__module__ == name)


@contextmanager
def pristine_triton():
    """Triton as `remember_triton` kept it, while Triton compiles or a graded kernel launches: the interpreter
    patches triton.language for each launch and, after a device function call, leaves some of it patched, which
    the compiler trips over; and whatever the notebook put in Triton's modules or classes (`tl.device_print`, a
    step of the launch) would run in the launch the compiler did not see. (Nothing without `remember_triton`.)"""
    changed = []
    for owner, kept in _PRISTINE:
        now = vars(owner)
        for key in (kept.keys() | now.keys()) - {"__dict__", "__weakref__"}:
            if now.get(key, _MISSING) is not kept.get(key, _MISSING):
                changed.append((owner, key, now.get(key, _MISSING)))
                _set(owner, key, kept.get(key, _MISSING))
    try:
        yield
    finally:
        for owner, key, value in reversed(changed):
            _set(owner, key, value)


_MISSING = object()


def _set(owner, key: str, value) -> None:
    if value is _MISSING:
        delattr(owner, key)
    else:
        setattr(owner, key, value)


@contextmanager
def _triton_compiles():
    """Triton's compiler on Triton as imported (`pristine_triton`), where its own `@jit` functions
    (tl.max, tl.sum, ...), InterpretedFunctions under the interpreter, which the compiler does not take, are
    JITFunctions again, in Triton's modules and as methods of tl.tensor (`x.sum(0)`)."""
    import triton.language as tl
    from triton.runtime.interpreter import InterpretedFunction

    with pristine_triton():
        swapped = []  # (owner, name, what it holds, the InterpretedFunction that is or wraps)
        for name, module in list(sys.modules.items()):
            if module is not None and name.partition(".")[0] == "triton":
                swapped += [(module, key, value, value) for key, value in vars(module).items()
                            if type(value) is InterpretedFunction]
        for key, value in vars(tl.tensor).items():  # a member is a wrapper closing over the function
            held = [c.cell_contents for c in value.__closure__ or ()] if type(value) is types.FunctionType else []
            swapped += [(tl.tensor, key, value, inner) for inner in held if type(inner) is InterpretedFunction]
        for owner, key, _, interpreted in swapped:
            setattr(owner, key, _jit_twin(interpreted))
        try:
            yield
        finally:
            for owner, key, value, _ in swapped:
                setattr(owner, key, value)


_TWINS: dict[int, tuple] = {}  # id(InterpretedFunction) -> (it, its JITFunction): each made once


def _jit_twin(interpreted):
    from triton.runtime.jit import JITFunction

    if id(interpreted) not in _TWINS:
        _TWINS[id(interpreted)] = (interpreted, JITFunction(interpreted.fn, **interpreted.kwargs))
    return _TWINS[id(interpreted)][1]


def _compiled_or_same(cell, made: dict):
    try:
        value = cell.cell_contents
    except ValueError:  # an empty cell
        return None
    return _for_compiler(value, made) if type(value) in _kernel_types() else value


# --- the machinery a launch runs -----------------------------------------------------------------------------

def _machinery_replaced() -> str | None:
    """The first function a launch may run that is not its package's: in Triton's and numpy's modules and the
    standard modules Triton's use (inspect, math, ...), their classes and the objects they hold, and torch's
    tensor and storage classes (the interpreter calls their methods on the grader's tensors before the grid: a
    notebook's function there is handed them)."""
    import torch

    namespaces = [(f"torch.{name}", vars(getattr(torch, name))) for name in TENSOR_CLASSES]
    modules = {name: module for name, module in list(sys.modules.items())
               if module is not None and name.partition(".")[0] in MACHINERY}
    used = {value.__name__: value for module in modules.values() if module.__name__.startswith("triton")
            for value in list(vars(module).values()) if type(value) is types.ModuleType}
    namespaces += [(name, vars(module)) for name, module in {**modules, **used}.items()]
    seen: set[int] = set()
    classes: dict = {}
    for where, namespace in namespaces:
        for key, value in list(namespace.items()):
            if id(value) in seen:
                continue
            seen.add(id(value))
            if _foreign(value, classes):
                return f"{where}.{key}"
            inner = {} if type(value) in (types.ModuleType, types.FunctionType) else _attributes(value)
            found = next((k for k, v in inner.items() if _foreign(v, classes)), None)
            if found is not None:
                return f"{where}.{key}.{found}"
    return None


def _attributes(value) -> dict:
    """A class's or an object's own attributes (its class holding only installed code: `_foreign`)."""
    try:
        own = object.__getattribute__(value, "__dict__")
    except AttributeError:
        return {}
    return dict(own) if type(own) in (dict, types.MappingProxyType) else {}


def _foreign(value, classes: dict | None = None) -> bool:
    """Whether `value` may run Python code that no installed package defines (the notebook's) when it is called
    or looked up: a function; a method, static or class method, property or partial (what it wraps); an object
    whose class or one of its bases holds such a member (`__call__`, `__get__`, ...), or whose `fn` (a kernel's
    or a constexpr function's Python) is one. `classes` remembers the classes already looked at."""
    classes = {} if classes is None else classes
    kind = type(value)
    if kind in (staticmethod, classmethod, types.MethodType):
        return _foreign(value.__func__, classes)
    if kind is property:
        return any(_foreign(f, classes) for f in (value.fget, value.fset, value.fdel) if f is not None)
    if kind is functools.partial:
        return _foreign(value.func, classes)
    if kind is types.FunctionType:
        return not _installed(value.__code__.co_filename)
    if kind in (type, types.ModuleType):  # a class's members are looked at where it is held (_attributes)
        return False
    if id(kind) not in classes:
        classes[id(kind)] = any(type(member) in CODE_HOLDERS and _foreign(member, classes)
                                for base in kind.__mro__[:-1] for member in list(vars(base).values()))
    if classes[id(kind)]:
        return True
    inner = _attributes(value).get("fn")
    return type(inner) is types.FunctionType and not _installed(inner.__code__.co_filename)


def _installed(filename: str) -> bool:
    """Whether code comes from an installed package, the standard library or the course (the sandbox mounts
    them read-only), or was generated by one (`<string>`: dataclasses, namedtuples), not from the notebook."""
    return filename == "<string>" or filename.startswith("<frozen ") or filename.startswith(_installed_roots())


@functools.cache
def _installed_roots() -> tuple[str, ...]:
    import labkit
    import labkit_course

    paths = sysconfig.get_paths()
    roots = {paths[key] for key in ("stdlib", "platstdlib", "purelib", "platlib")}
    roots |= set(site.getsitepackages())
    roots |= {os.path.dirname(package.__file__) for package in (labkit, labkit_course)}
    return tuple(os.path.join(os.path.realpath(root), "") for root in roots) + tuple(
        os.path.join(root, "") for root in roots)
