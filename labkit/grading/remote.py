"""The trusted side of grading: graders call the student's functions through the student's kernel.

`RemoteNamespace` stands in for the notebook's globals: `require(ns, "softmax")` returns a proxy,
and calling it sends the arguments (safe codec, `labkit.grading.codec`) to the agent in the
student's kernel as one execute request. The reply comes back on that request's own execute_reply,
as the value of a user expression, never through stdout, so nothing the student prints, no IPython
hook and no forged JSON line on the output stream is read as a reply; a per-request nonce ties the
reply to its request. The reply can only carry values (the student's answer and the arguments' new
contents, written back in place); the grader, its references and the score stay in this process.
"""

import ast
import queue
import secrets
import time

from labkit.grading.codec import CodecError, Decoder, Encoder, Handle, dumps, identity, loads
from labkit.grading.core import GRADING, ExerciseFailed
from labkit.grading.forbidden import ForbiddenCall, explain

AGENT = "__labkit_agent__"
INSTALL = f"import labkit.grading.agent\n{AGENT} = labkit.grading.agent.Agent(get_ipython().user_ns)"


class KernelLost(ExerciseFailed):
    """The student's kernel stopped answering (a call ran out of time, or the kernel died)."""


class RemoteError(Exception):
    """The student's code raised; `type_name` is the type the student's code raised."""

    def __init__(self, type_name: str, message: str):
        super().__init__(message)
        self.type_name = type_name


class KernelLink:
    """One request, one reply, over the execute channel of a running kernel."""

    def __init__(self, kernel_manager, client, call_timeout_s: float, interrupt_grace_s: float = 5.0):
        self.km, self.kc = kernel_manager, client
        self.call_timeout_s, self.interrupt_grace_s = call_timeout_s, interrupt_grace_s
        self.lost: str | None = None

    def install_agent(self) -> None:
        reply = self._execute(INSTALL, {}, self.call_timeout_s)
        if reply["content"].get("status") != "ok":
            raise KernelLost(f"the grading agent could not start in your kernel: {reply['content'].get('ename')}")

    def request(self, body: dict) -> dict:
        nonce = secrets.token_hex(16)
        code = f"{AGENT}.serve({dumps({**body, 'nonce': nonce})!r})"
        reply = self._execute(code, {"reply": f"{AGENT}.reply"}, self.call_timeout_s)
        expression = reply["content"].get("user_expressions", {}).get("reply", {})
        try:
            text = ast.literal_eval(expression["data"]["text/plain"])
            if type(text) is not str:
                raise TypeError("not a string")
            answer = loads(text)
        except (KeyError, TypeError, ValueError, SyntaxError, MemoryError, RecursionError) as error:
            raise CodecError(f"the kernel's reply is not a grading reply ({type(error).__name__})") from None
        if type(answer) is not dict or answer.get("nonce") != nonce:
            raise CodecError("the kernel's reply does not answer this request")
        return answer

    def _execute(self, code: str, expressions: dict, timeout_s: float) -> dict:
        if self.lost:
            raise KernelLost(self.lost)
        msg_id = self.kc.execute(code, silent=True, store_history=False, user_expressions=expressions,
                                 allow_stdin=False)
        reply = self._wait(msg_id, timeout_s)
        if reply is None:
            self.km.interrupt_kernel()
            reply = self._wait(msg_id, self.interrupt_grace_s)
            if reply is None:
                self.lost = f"your code ran past {timeout_s:.0f} s and the kernel stopped answering"
                raise KernelLost(self.lost)
            raise KernelLost(f"your code ran past the time limit of {timeout_s:.0f} s and was interrupted")
        return reply

    def _wait(self, msg_id: str, timeout_s: float) -> dict | None:
        deadline = time.monotonic() + timeout_s
        while (left := deadline - time.monotonic()) > 0:
            self._drain_output()
            if not kernel_alive(self.km):
                self.lost = "your kernel died while running your code"
                raise KernelLost(self.lost)
            try:
                message = self.kc.get_shell_msg(timeout=min(left, 0.5))
            except queue.Empty:
                continue
            if message.get("parent_header", {}).get("msg_id") == msg_id:
                return message
        return None

    def _drain_output(self) -> None:
        """What the student's code prints while graded is not kept (nor read as anything)."""
        while True:
            try:
                self.kc.get_iopub_msg(timeout=0)
            except queue.Empty:
                return


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

    def __getattr__(self, attr: str):
        if attr.startswith("_"):
            raise AttributeError(attr)
        return self._send({"op": "getattr", "attr": attr}, ([], {}))

    def _send(self, body: dict, arguments: tuple[list, dict]):
        wires = GRADING.get()
        encoder = Encoder()
        args, kwargs = encoder.encode(arguments[0]), encoder.encode(arguments[1])
        originals = {encoder.ids[identity(obj)]: obj for obj in encoder.keep}
        answer = self._link.request({**body, **self._target, "args": args, "kwargs": kwargs,
                                     "forbidden": list(wires.forbidden) if wires else []})
        decoder = Decoder(handle=lambda number, type_name: RemoteObject(
            self._link, {"handle": number}, type_name), known=originals)
        try:
            for number, node in answer.get("updates", []):
                if number not in originals or type(node) is not dict:
                    raise CodecError(f"the reply updates an unknown argument {number!r}")
                decoder.fill(originals[number], node)
            result = decoder.decode(answer["result"]) if "result" in answer else None
        except (KeyError, TypeError, RecursionError) as error:
            raise CodecError(f"malformed reply ({type(error).__name__})") from None
        tripped = [str(path) for path in answer.get("tripped", []) if wires and path in wires.forbidden]
        if tripped:
            wires.tripped.extend(tripped)
            raise ForbiddenCall(explain(tripped[0]))
        error = answer.get("error")
        if error is not None:
            type_name, message = str(error.get("type", "Exception")), str(error.get("message", ""))
            if type_name == "NotImplementedError":
                raise NotImplementedError(message)
            raise RemoteError(type_name, message)
        return result


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
        return RemoteObject(self.link, {"name": name}, str(found.get("type", "object")),
                            bool(found.get("callable")), bool(found.get("class")))

    def definition_source(self, name: str) -> str:
        """The last cell that defines `name`, from the notebook as read by the trusted side."""
        defining = [s for s in self.cell_sources if f"def {name}" in s or f"class {name}" in s]
        return defining[-1] if defining else ""
