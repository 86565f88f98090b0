"""The trusted side of grading: graders call the student's functions through the student's kernel.

`RemoteNamespace` stands in for the notebook's globals: `require(ns, "softmax")` returns a proxy,
and calling it sends the arguments (safe codec, `labkit_course.grading.codec`) to the agent in the
student's kernel. The channel is a Unix socket in the student's temporary folder that this side
listens on; one execute request starts the agent's loop, which connects and then answers one
length-prefixed JSON frame per request. Nothing the student prints, no IPython hook and no forged
line on stdout reaches it, and a per-request nonce ties each reply to its request. A reply can only
carry values (the student's answer and the arguments' new contents, written back in place); the
grader, its references and the score stay in this process.
"""

import functools
import os
import re
import select
import socket
import struct
import time
from pathlib import Path

from labkit_course.grading.codec import MAX_MESSAGE_BYTES, CodecError, Decoder, Encoder, Handle, dumps, identity, loads
from labkit_course.grading.core import GRADING, ExerciseFailed
from labkit_course.grading.forbidden import ForbiddenCall, defines, explain

FRAME = struct.Struct(">Q")


class KernelLost(ExerciseFailed):
    """The student's kernel stopped answering (a call ran out of time, or the kernel died)."""


class RemoteError(Exception):
    """The student's code raised; `type_name` is the type the student's code raised."""

    def __init__(self, type_name: str, message: str, where: str = ""):
        super().__init__(message)
        self.type_name = type_name
        self.where = where  # the line of the student's cell it was raised on, as the kernel says


def send_frame(sock: socket.socket, text: str) -> None:
    data = text.encode()
    sock.sendall(FRAME.pack(len(data)) + data)


def receive_frame(sock: socket.socket, limit: int = MAX_MESSAGE_BYTES, deadline: float | None = None) -> str:
    """One length-prefixed frame of at most `limit` bytes; with a `deadline` (time.monotonic()), a frame
    that is not whole by then raises TimeoutError."""
    (size,) = FRAME.unpack(_receive_exactly(sock, FRAME.size, deadline))
    if size > limit:
        raise CodecError(f"a message of {size} bytes exceeds the limit of {limit}")
    try:
        return _receive_exactly(sock, size, deadline).decode()
    except UnicodeDecodeError as error:
        raise CodecError(f"a message that is not UTF-8 ({error.reason})") from None


def _receive_exactly(sock: socket.socket, size: int, deadline: float | None) -> bytes:
    chunks, left = [], size
    while left:
        if deadline is not None:  # a whole frame by the deadline, however slowly it trickles in
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise TimeoutError(f"the message stopped after {size - left} of its {size} bytes")
            sock.settimeout(remaining)
        try:
            chunk = sock.recv(min(left, 2**20))
        except TimeoutError:
            raise TimeoutError(f"the message stopped after {size - left} of its {size} bytes") from None
        if not chunk:
            raise ConnectionError("the other side closed the grading channel")
        chunks.append(chunk)
        left -= len(chunk)
    return b"".join(chunks)


class KernelLink:
    """One request, one reply, with the agent in a running kernel."""

    def __init__(self, kernel_manager, client, socket_path: Path, call_timeout_s: float, uid: int | None = None,
                 deadline: float = float("inf"), interrupt_grace_s: float = 5.0, reply_bytes: int = 64 * 2**20):
        self.km, self.kc = kernel_manager, client
        self.call_timeout_s, self.interrupt_grace_s = call_timeout_s, interrupt_grace_s
        self.reply_bytes = reply_bytes
        self.deadline = deadline  # time.monotonic() after which no call starts: grading has its own budget
        self.lost: str | None = None
        self.listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.listener.bind(str(socket_path))
        if uid is not None:
            os.chown(socket_path, uid, uid)
        self.listener.listen(1)
        self.socket_path = socket_path
        self.channel: socket.socket | None = None

    def install_agent(self) -> None:
        """Start the agent's loop with one execute request and take its connection."""
        self.kc.execute("import labkit_course.grading.agent\n"
                        "labkit_course.grading.agent.Agent(get_ipython().user_ns)"
                        f".serve_socket({str(self.socket_path)!r})", silent=True, store_history=False)
        self.listener.settimeout(0.5)
        deadline = time.monotonic() + self.call_timeout_s
        while self.channel is None:
            self._check_alive()
            if time.monotonic() > deadline:
                self.lost = "the grading agent did not start in your kernel"
                raise KernelLost(self.lost)
            try:
                self.channel, _ = self.listener.accept()
            except TimeoutError:
                continue
        self.listener.close()

    def close(self) -> None:
        for sock in (self.channel, self.listener):
            if sock is not None:
                sock.close()

    def request(self, body: dict) -> dict:
        if self.lost:
            raise KernelLost(self.lost)
        timeout = min(self.call_timeout_s, self.deadline - time.monotonic())
        if timeout <= 0:
            self.lost = "grading your notebook ran past its time limit"
            raise KernelLost(self.lost)
        nonce = os.urandom(16).hex()
        try:
            send_frame(self.channel, dumps({**body, "nonce": nonce}))
            text = self._reply(timeout)
            if text is None:
                self.km_interrupt()
                text = self._reply(self.interrupt_grace_s)
                if text is None:
                    self.lost = f"your code ran past {timeout:.0f} s and the kernel stopped answering"
                    raise KernelLost(self.lost)
                raise KernelLost(f"your code ran past the time limit of {timeout:.0f} s and was interrupted")
        except (OSError, ConnectionError) as error:
            self.lost = f"the grading channel to your kernel broke ({error})"
            raise KernelLost(self.lost) from None
        answer = loads(text)
        if type(answer) is not dict or answer.get("nonce") != nonce:
            raise CodecError("the kernel's reply does not answer this request")
        return answer

    def km_interrupt(self) -> None:
        from jupyter_core.utils import run_sync

        run_sync(self.km.interrupt_kernel)()

    def _reply(self, timeout_s: float) -> str | None:
        """The reply, or None if none began within `timeout_s`; a reply that begins must be whole by then
        (or by the grace after it), and within the size limit."""
        deadline = time.monotonic() + timeout_s
        while (left := deadline - time.monotonic()) > 0:
            ready, _, _ = select.select([self.channel], [], [], min(left, 0.5))
            if ready:
                try:
                    return receive_frame(self.channel, self.reply_bytes, deadline + self.interrupt_grace_s)
                except (TimeoutError, CodecError) as error:
                    self.lost = f"your kernel's reply was cut off or too large ({error})"
                    raise KernelLost(self.lost) from None
            self._check_alive()
        return None

    def _check_alive(self) -> None:
        if not kernel_alive(self.km):
            self.lost = "your kernel died while running your code"
            raise KernelLost(self.lost)


def kernel_alive(kernel_manager) -> bool:
    process = getattr(kernel_manager.provisioner, "process", None)
    return process is not None and process.poll() is None


class RemoteObject(Handle):
    """A function, class or object that lives in the student's kernel."""

    def __init__(self, link: KernelLink, target: dict, type_name: str, is_callable: bool = True,
                 is_class: bool = False):
        super().__init__(target.get("handle"), type_name)
        self._link, self._target = link, target
        self._description = (type_name, is_callable, is_class)

    def _describe(self) -> tuple[str, bool, bool]:
        return self._description

    def __repr__(self) -> str:
        return f"<{self._type_name} in the student's kernel>"

    def __call__(self, *args, **kwargs):
        return self._send({"op": "call"}, (list(args), dict(kwargs)))

    def __getitem__(self, grid):
        """`kernel[grid]`, as Triton launches a kernel: the call it returns runs in the student's kernel."""
        grid = list(grid) if isinstance(grid, tuple) else [grid]
        return lambda *args, **kwargs: self._send({"op": "launch", "grid": grid}, (list(args), dict(kwargs)))

    def __getattr__(self, attr: str):
        if attr.startswith("_"):
            raise AttributeError(attr)
        return self._send({"op": "getattr", "attr": attr}, ([], {}))

    def _send(self, body: dict, arguments: tuple[list, dict]):
        wires = GRADING.get()
        encoder = Encoder()
        args, kwargs = encoder.encode(arguments[0]), encoder.encode(arguments[1])
        originals = {encoder.ids[identity(obj)]: obj for obj in encoder.keep}
        decoder = Decoder(handle=lambda number, type_name: _remote_type(type_name)(
            self._link, {"handle": number}, type_name), known=originals)
        try:
            answer = self._link.request({**body, **self._target, "args": args, "kwargs": kwargs,
                                         "forbidden": _wired_in_kernel(wires)})
            for number, node in answer.get("updates", []):
                if number not in originals or type(node) is not dict:
                    raise CodecError(f"the reply updates an unknown argument {number!r}")
                decoder.fill(originals[number], node)
            result = decoder.decode(answer["result"]) if "result" in answer else None
        except (CodecError, KeyError, TypeError, ValueError, RecursionError) as error:
            raise ExerciseFailed(f"your kernel's reply could not be read ({type(error).__name__}: "
                                 f"{str(error)[:200]})") from None
        tripped = [str(path) for path in answer.get("tripped", []) if wires and path in wires.forbidden]
        if tripped:
            wires.tripped.extend(tripped)
            raise ForbiddenCall(explain(tripped[0]))
        error = answer.get("error")
        if error is not None:
            if type(error) is not dict:
                raise ExerciseFailed("your kernel's reply could not be read (a malformed error)")
            type_name, message = _short(error.get("type", "Exception"), 80), _short(error.get("message", ""), 2000)
            if type_name == "NotImplementedError":
                raise NotImplementedError(message)
            raise RemoteError(type_name, message, _short(error.get("where", ""), 200))
        return result


def _wired_in_kernel(wires) -> list[str]:
    """The forbidden paths the kernel can arm: not the graders' own (hidden from it by the sandbox)."""
    return [path for path in wires.forbidden if not path.startswith("labkit_course.grading.labs.")] if wires else []


def _short(value, limit: int) -> str:
    """A string from the kernel, cut to `limit` characters before anything else reads it."""
    return value[:limit] if type(value) is str else type(value).__name__


@functools.cache
def _remote_type(type_name: str) -> type:
    """A RemoteObject subclass named like the student's type, so `type(got).__name__` reads right."""
    name = type_name if type_name.isidentifier() else "RemoteObject"
    return type(name, (RemoteObject,), {"__module__": "student"})


class RemoteNamespace:
    """The globals of a student's kernel, as graders see them."""

    def __init__(self, link: KernelLink, cell_sources: list[str]):
        self.link, self.cell_sources = link, cell_sources
        self._descriptions: dict[str, dict] = {}

    def _describe(self, name: str) -> dict:
        if name not in self._descriptions:
            answer = self.link.request({"op": "describe", "name": name})
            self._descriptions[name] = answer if answer.get("defined") is not None else {"defined": False}
        return self._descriptions[name]

    def __contains__(self, name: str) -> bool:
        return bool(self._describe(name).get("defined"))

    def __getitem__(self, name: str) -> RemoteObject:
        found = self._describe(name)
        if not found.get("defined"):
            raise KeyError(name)
        return RemoteObject(self.link, {"name": name}, _short(found.get("type", "object"), 80),
                            bool(found.get("callable")), bool(found.get("class")))

    def value(self, name: str):
        """The data bound to `name` in the student's kernel (the codec's types), copied here."""
        answer = self.link.request({"op": "value", "name": name})
        decoder = Decoder(handle=lambda number, type_name: _remote_type(type_name)(
            self.link, {"handle": number}, type_name))
        try:
            return decoder.decode(answer["result"])
        except (CodecError, KeyError, TypeError, ValueError, RecursionError) as error:
            raise ExerciseFailed(f"`{name}` could not be read from your kernel ({type(error).__name__}: "
                                 f"{str(error)[:200]})") from None

    def definition_source(self, name: str) -> str:
        """The last cell that defines `name` (a `def` or `class` statement, not a string that looks like
        one), from the notebook as read by the trusted side."""
        definition = re.compile(rf"^[ \t]*(?:async[ \t]+)?(?:def|class)[ \t]+{re.escape(name)}\b", re.MULTILINE)
        for source in reversed(self.cell_sources):
            if definition.search(source) and defines(source, name):
                return source
        return ""
