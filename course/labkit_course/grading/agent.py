"""The grader's hands inside a student's kernel: carry out one call, send back what happened.

The trusted grader (`labkit_course.grading.remote`) sends a request as the code of an execute request;
`Agent.serve` decodes the arguments with the safe codec, calls the student's definition with the
exercise's tripwires armed, and leaves the reply (the result, the arguments' new contents, the
error or tripwire if any) in `Agent.reply`, which the trusted side reads back as a user expression
of that same request. Everything here runs in the student's process, so it is the student's to
tamper with: a forged reply is only a forged *answer*, which the trusted side still judges.
"""

import inspect
import os
from contextlib import contextmanager
from types import CodeType

from labkit_course.grading.codec import CodecError, Decoder, Encoder, dumps, identity, loads
from labkit_course.grading.core import where_raised
from labkit_course.grading.forbidden import ForbiddenCall, Tripwires, explain, unguarded

OWN_KERNELS = "labkit.attention.triton_kernels.jit_kernels"  # what Lab 08's exercises forbid: labkit's kernels


class Agent:
    def __init__(self, namespace: dict):
        self.namespace = namespace
        self.handles: list = []  # objects the trusted side refers to by number
        self.reply = ""

    def serve(self, request_text: str) -> None:
        request = {}
        try:
            request = loads(request_text)
            body = self._carry_out(request)
        except BaseException as error:  # noqa: BLE001 - the student's code may raise anything, even SystemExit
            body = {"error": _describe_error(error)}
        body["nonce"] = request.get("nonce") if isinstance(request, dict) else None
        try:
            self.reply = dumps(body)
        except CodecError as error:
            self.reply = dumps({"nonce": body["nonce"], "error": _describe_error(error)})

    def serve_socket(self, path: str) -> None:
        """Answer the trusted side's requests on its socket until it hangs up."""
        import socket

        from labkit_course.grading.remote import receive_frame, send_frame

        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as channel:
            channel.connect(path)
            while True:
                try:
                    text = receive_frame(channel)
                except KeyboardInterrupt:  # a late interrupt meant for a call that already answered
                    continue
                except (ConnectionError, OSError):
                    return
                self.serve(text)
                send_frame(channel, self.reply)

    def _keep(self, value) -> int:
        self.handles.append(value)
        return len(self.handles) - 1

    def _handle(self, number, type_name):
        if type(number) is not int or not 0 <= number < len(self.handles):
            raise CodecError(f"unknown handle {number!r}")
        return self.handles[number]

    def _carry_out(self, request: dict) -> dict:
        op = request["op"]
        if op == "describe":
            name = request["name"]
            if name not in self.namespace:
                return {"defined": False}
            value = self.namespace[name]
            return {"defined": True, "type": type(value).__name__, "callable": callable(value),
                    "class": isinstance(value, type)}
        if op == "value":
            return {"result": Encoder(handles=self._keep).encode(self.namespace[request["name"]])}
        if op not in ("call", "getattr", "launch"):
            raise CodecError(f"unknown request {op!r}")
        target = self.namespace[request["name"]] if "name" in request else self._handle(request["handle"], "")
        decoder = Decoder(handle=self._handle, may_import=True)
        args, kwargs = decoder.decode(request.get("args", [])), decoder.decode(request.get("kwargs", {}))
        kept = {id(h) for h in self.handles}
        inputs = {n: obj for n, obj in decoder.objects.items() if id(obj) not in kept}
        wires = Tripwires(tuple(request.get("forbidden", ())))
        function = getattr(target, "__func__", target)
        body: dict = {}
        with wires.armed(self.namespace, getattr(function, "__globals__", {}), functions=(function,)):
            try:
                if op == "launch":
                    result = _launch(target, request.get("grid"), args, kwargs, wires)
                else:
                    result = target(*args, **kwargs) if op == "call" else getattr(target, request["attr"])
            except BaseException as error:  # noqa: BLE001
                body["error"] = _describe_error(error)
        encoder = Encoder(handles=self._keep, known={identity(obj): n for n, obj in inputs.items()})
        body["updates"] = [[n, encoder.contents(obj, n)] for n, obj in inputs.items()]
        if "error" not in body:
            body["result"] = encoder.encode(result)
        body["tripped"] = list(wires.tripped)
        return body


def _launch(kernel, grid, args, kwargs, wires: Tripwires) -> None:
    """`kernel[grid](*args, **kwargs)` for a Triton kernel (the grader's own launch of a student's
    `@triton.jit` function); its outputs come back as the arguments' new contents."""
    reached = check_triton_kernel(kernel)
    if not (type(grid) is list and 1 <= len(grid) <= 3 and all(type(n) is int and 0 < n <= 2**16 for n in grid)):
        raise CodecError(f"a launch grid is 1 to 3 positive ints, not {grid!r}")
    with _labkit_kernels_refused(kernel, reached, wires):
        kernel[tuple(grid)](*args, **kwargs)


def check_triton_kernel(kernel) -> list:
    """Refuse what is not a `@triton.jit` function, exactly (anything else with `kernel[grid](...)`, such as
    a subclass of triton's KernelInterface, can run torch code), and a kernel that calls one of labkit's own
    kernels as a device function: TypeError or ForbiddenCall, whose message is the student's feedback.
    Returns the kernels it reaches (`_kernels_reached`)."""
    if type(kernel) not in _kernel_types():
        raise TypeError(f"a {type(kernel).__name__} is not a Triton kernel: define it with @triton.jit")
    if getattr(kernel, "pre_run_hooks", None):
        raise TypeError("the kernel has pre-run hooks (add_pre_run_hook), Python that runs before the grid: "
                        "a graded kernel is the @triton.jit function alone")
    replaced = _launch_path_replaced()
    if replaced:
        raise TypeError(f"Triton's {replaced} is not Triton's own: the notebook replaced it, so the grader cannot "
                        "launch your kernel")
    reached = _kernels_reached(kernel)
    used = _labkit_kernel_used(reached)
    if used:
        raise ForbiddenCall(explain(used))
    return reached


def _launch_path_replaced() -> str | None:
    """The first of the functions a launch goes through (kernel[grid](...) to the grid's programs) that is not
    the one Triton's own files define, if the notebook replaced one: it could run torch instead of the kernel."""
    import triton
    from triton.runtime.interpreter import GridExecutor

    home = os.path.dirname(triton.__file__)
    for owner in (*_kernel_types(), GridExecutor):
        for name in ("__getitem__", "run", "__call__", "rewrite", "__init__"):
            if name not in dir(owner):
                continue
            code = getattr(getattr(owner, name), "__code__", None)
            if code is None or not code.co_filename.startswith(home):
                if not (name == "__init__" and getattr(owner, name) is object.__init__):
                    return f"{owner.__name__}.{name}"
    return None


def _kernel_types() -> tuple[type, ...]:
    """What `@triton.jit` returns: a JITFunction, or under TRITON_INTERPRET=1 an InterpretedFunction."""
    from triton.runtime.interpreter import InterpretedFunction
    from triton.runtime.jit import JITFunction

    return JITFunction, InterpretedFunction


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


def _kernels_reached(kernel) -> list:
    """`kernel` and the `@triton.jit` functions its code can call: the names it uses, looked up in its globals
    and closure, in the modules and classes it names, in objects' attributes and in lists, tuples and dicts,
    followed through each kernel found."""
    types, seen, todo, reached = _kernel_types(), set(), [kernel], []
    while todo:
        jit = todo.pop()
        fn = jit.fn
        if id(fn) in seen:
            continue
        seen.add(id(fn))
        reached.append(jit)
        names = _names(fn.__code__)
        scope = dict(fn.__globals__)
        for name, cell in zip(fn.__code__.co_freevars, fn.__closure__ or (), strict=True):
            try:
                scope[name] = cell.cell_contents
            except ValueError:  # an empty cell
                pass
        for value in (scope[n] for n in names if n in scope):
            todo += _kernels_in(value, names, types)
    return reached


def _kernels_in(value, names: set[str], types: tuple[type, ...], depth: int = 2) -> list:
    """The kernels `value` is or holds within `depth` steps: by the code's names in a module, a class or an
    object (read statically: no property or `__getattr__` of the student's runs), and the items of a short
    list, tuple or dict."""
    if type(value) in types:
        return [value]
    if depth == 0:
        return []
    if isinstance(value, list | tuple | dict):
        items = list(value.values() if isinstance(value, dict) else value)
        return [k for item in items[:64] for k in _kernels_in(item, names, types, depth - 1)]
    found = []
    for name in names:
        try:
            member = inspect.getattr_static(value, name)
        except Exception:  # noqa: BLE001 - not there, or an object that refuses to be looked at
            continue
        found += _kernels_in(getattr(member, "__func__", member), names, types, depth - 1)  # a staticmethod's too
    return found


@contextmanager
def _labkit_kernels_refused(kernel, reached: list, wires: Tripwires):
    """Under Triton's interpreter a kernel is plain Python, which can reach labkit's kernels by routes no look
    at its code follows: `globals()[...]`, a kernel's Python function (`.fn`), the interpreter's rewrite of it
    (`.rewrite()`). For the launch, labkit's kernels refuse to be launched or called, and what their code
    names (`tl`: in their closure, and for a rewrite in their module's globals) refuses to be used, so no
    copy of their function runs either. The student's kernels are rewritten from their own source, since the
    interpreter keeps each kernel's rewritten function in a cache keyed by its Python function, which the
    student's code could fill."""
    from triton.runtime.interpreter import InterpretedFunction

    if type(kernel) is not InterpretedFunction:
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
    cells = list({id(cell): cell for fn in functions for cell in fn.__closure__ or ()}.values())
    contents = [cell.cell_contents for cell in cells]
    free = {name for fn in functions for name in fn.__code__.co_freevars}
    module = functions[0].__globals__
    module_saved = {name: module[name] for name in free if name in module}
    for k in kernels:
        k.__class__ = RefusedKernel
    for cell in cells:
        cell.cell_contents = _Refused(refused)
    module.update(dict.fromkeys(free, _Refused(refused)))
    try:
        yield
    finally:
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


def _names(code: CodeType) -> set[str]:
    """Every global, attribute and free name a function's code (and the code nested in it) uses."""
    names = set(code.co_names) | set(code.co_freevars)
    for const in code.co_consts:
        if isinstance(const, CodeType):
            names |= _names(const)
    return names


def _describe_error(error: BaseException) -> dict:
    return {"type": type(error).__name__, "message": str(error)[:2000], "where": where_raised(error)}
