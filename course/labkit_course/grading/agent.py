"""The grader's hands inside a student's kernel: carry out one call, send back what happened.

The trusted grader (`labkit_course.grading.remote`) sends a request as the code of an execute request;
`Agent.serve` decodes the arguments with the safe codec, calls the student's definition with the
exercise's tripwires armed, and leaves the reply (the result, the arguments' new contents, the
error or tripwire if any) in `Agent.reply`, which the trusted side reads back as a user expression
of that same request. Everything here runs in the student's process, so it is the student's to
tamper with: a forged reply is only a forged *answer*, which the trusted side still judges.
"""

from labkit_course.grading.codec import CodecError, Decoder, Encoder, dumps, identity, loads
from labkit_course.grading.core import where_raised
from labkit_course.grading.forbidden import Tripwires
from labkit_course.grading.kernels import check_triton_kernel, labkit_kernels_refused, pristine_triton


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
    if not (type(grid) is list and 1 <= len(grid) <= 3 and all(type(n) is int and 0 < n <= 2**16 for n in grid)):
        raise CodecError(f"a launch grid is 1 to 3 positive ints, not {grid!r}")
    reached = check_triton_kernel(kernel, args, kwargs)
    with pristine_triton(), labkit_kernels_refused(kernel, reached, wires):
        kernel[tuple(grid)](*args, **kwargs)


def _describe_error(error: BaseException) -> dict:
    return {"type": type(error).__name__, "message": str(error)[:2000], "where": where_raised(error)}
