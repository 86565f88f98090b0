"""Running the app: `labkit serve` in the foreground, or a server in a thread or a child process.

The listening socket is bound here (port 0 picks a free one) before uvicorn starts, so whoever
started the server learns the real address without racing anyone for a port.
"""

import argparse
import json
import logging
import os
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.request
from dataclasses import replace

import h11
import torch
import uvicorn
from uvicorn.protocols.http.h11_impl import H11Protocol

from labkit.cache.kv_quant import KV_CACHE_DTYPES
from labkit.engine import LLM
from labkit.model.weight_formats import WEIGHT_FORMATS
from labkit.serve.access import Access, is_loopback
from labkit.serve.app import create_app
from labkit.serve.engine_loop import BATCHING_MODES
from labkit.serve.protocol import Limits, RequestError

READY_LINE = "labkit serve: listening on "


def bind(host: str = "127.0.0.1", port: int = 0) -> socket.socket:
    sock = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((host, port))
    sock.listen(128)
    return sock


def url_of(sock: socket.socket) -> str:
    host, port = sock.getsockname()[:2]
    return f"http://{f'[{host}]' if ':' in host else host}:{port}"


class _ReadDeadline(H11Protocol):
    """uvicorn's HTTP/1.1 protocol with a deadline on reading each request: its headers and body must
    have arrived `read_timeout` seconds after the connection opened (or its previous answer ended),
    or the connection is closed. uvicorn bounds idle keep-alive connections (timeout_keep_alive), the
    header size (h11_max_incomplete_event_size) and connections (limit_concurrency), but not a
    client that trickles its request in a byte at a time, or sends half of it and goes silent."""

    read_timeout = 10.0  # set per server by `uvicorn_config`

    def connection_made(self, transport) -> None:
        super().connection_made(transport)
        self._read_deadline = self.loop.call_later(self.read_timeout, self._read_too_slow)

    def data_received(self, data: bytes) -> None:
        super().data_received(data)
        if self.cycle is not None and not self.cycle.more_body and self._read_deadline is not None:
            self._read_deadline.cancel()  # the whole request is in
            self._read_deadline = None

    def on_response_complete(self) -> None:
        super().on_response_complete()  # may read a pipelined request already here
        waiting = self.cycle.response_complete or self.cycle.more_body  # for a next request, or the rest of it
        if waiting and not self.transport.is_closing() and self._read_deadline is None:  # the next request's clock
            self._read_deadline = self.loop.call_later(self.read_timeout, self._read_too_slow)

    def connection_lost(self, exc) -> None:
        if self._read_deadline is not None:
            self._read_deadline.cancel()
        super().connection_lost(exc)

    def send_400_response(self, msg: str) -> None:
        """uvicorn's answer to bytes that are no HTTP request (headers past h11's size limit too), in
        OpenAI's error JSON like every other refusal."""
        limit = self.config.h11_max_incomplete_event_size
        body = json.dumps(RequestError(f"{msg} (malformed, or its headers exceed {limit} bytes)", None,
                                       code="invalid_http").body()).encode()
        headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode()),
                   (b"connection", b"close")]
        for event in (h11.Response(status_code=400, headers=headers, reason=b"Bad Request"), h11.Data(data=body),
                      h11.EndOfMessage()):
            self.transport.write(self.conn.send(event))
        self.transport.close()

    def _read_too_slow(self) -> None:
        self._read_deadline = None
        if not self.transport.is_closing():
            self.logger.info("closing a connection whose request took over %.0f s to arrive", self.read_timeout)
            self.transport.close()


def uvicorn_config(app, log_level: str = "warning") -> uvicorn.Config:
    """What bounds a connection, from the app's `Limits`: uvicorn's own settings, and `_ReadDeadline`
    for slow requests."""
    limits = app.state.limits
    protocol = type("ReadDeadline", (_ReadDeadline,), {"read_timeout": limits.read_timeout_s})
    return uvicorn.Config(app, http=protocol, log_level=log_level, lifespan="on", timeout_graceful_shutdown=5,
                          timeout_keep_alive=limits.keep_alive_s, limit_concurrency=limits.max_connections,
                          h11_max_incomplete_event_size=limits.max_header_bytes, server_header=False)


class ServerThread:
    """uvicorn in a background thread of this process, for tests:

        with ServerThread(create_app(llm, "tiny")) as server:
            client = openai.OpenAI(base_url=server.url + "/v1", api_key="none")
    """

    def __init__(self, app, host: str = "127.0.0.1", port: int = 0):
        self.app, self.host, self.port = app, host, port
        self.engine_died = False

    def __enter__(self) -> "ServerThread":
        self.sock = bind(self.host, self.port)
        self.url = url_of(self.sock)
        self.server = uvicorn.Server(uvicorn_config(self.app))
        self.app.state.on_engine_death = self._engine_died
        self.thread = threading.Thread(target=self.server.run, kwargs={"sockets": [self.sock]},
                                       name="labkit-serve", daemon=True)
        self.thread.start()
        deadline = time.monotonic() + 30
        while not self.server.started:
            if not self.thread.is_alive() or time.monotonic() > deadline:
                self.__exit__(None, None, None)
                raise RuntimeError("the server did not start")
            time.sleep(0.01)
        return self

    def _engine_died(self) -> None:
        self.engine_died = self.server.should_exit = True

    def __exit__(self, *exc) -> None:
        self.server.should_exit = True
        self.thread.join(timeout=30)
        self.sock.close()
        if self.thread.is_alive():
            raise RuntimeError("the server thread did not stop")


class ServerProcess:
    """`labkit serve` in a child process (what a notebook or the load generator talks to).

    Reads the address from the child's ready line (after its loading line), waits until /health answers,
    and on exit stops the child (SIGTERM, then SIGKILL) so no process or port is left behind.
    """

    def __init__(self, *args: str, timeout: float = 300):
        self.args, self.timeout = [str(a) for a in args], timeout
        self.process = self.url = self._drain = None

    def __enter__(self) -> "ServerProcess":
        return self.start().wait()

    def start(self) -> "ServerProcess":
        """Launch the child and return at once (it loads the model meanwhile); `wait` for it later."""
        command = [sys.executable, "-m", "labkit", "serve", "--host", "127.0.0.1", "--port", "0",
                   "--exit-with-parent", str(os.getpid()), *self.args]
        self.process = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        return self

    def wait(self) -> "ServerProcess":
        """Block until the child answers /health (stopping it if it never does)."""
        if self.url is None:
            try:
                self.url = self._wait_ready()
            except BaseException:
                self.stop()
                raise
        return self

    def _wait_ready(self) -> str:
        deadline = time.monotonic() + self.timeout
        lines = []
        for line in self.process.stdout:  # the child prints its address once the model is loaded
            lines.append(line)
            if line.startswith(READY_LINE):
                url = line[len(READY_LINE):].strip()
                break
        else:
            raise RuntimeError("labkit serve exited before it was ready:\n" + "".join(lines[-20:]))
        # Keep the pipe drained, or a chatty child would block on a full pipe.
        self._drain = threading.Thread(target=self.process.stdout.read, daemon=True)
        self._drain.start()
        direct = urllib.request.build_opener(urllib.request.ProxyHandler({}))  # 127.0.0.1 never via a proxy
        while time.monotonic() < deadline:
            try:
                with direct.open(url + "/health", timeout=5) as response:
                    if response.status == 200:
                        return url
            except OSError:
                time.sleep(0.1)
        raise RuntimeError(f"labkit serve at {url} did not answer /health within {self.timeout:.0f} s")

    def __exit__(self, *exc) -> None:
        self.stop()

    def stop(self) -> None:
        if self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(timeout=15)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()
        if self._drain is not None:
            self._drain.join(timeout=10)  # the child is gone, so its pipe is at its end
        self.process.stdout.close()


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="labkit serve", description="An OpenAI-compatible HTTP server on labkit's engine.")
    p.add_argument("--model", default="smollm2", help="a model name, a .gguf file or an HF folder")
    p.add_argument("--served-model-name", help="the name clients use and /v1/models shows (default: --model)")
    p.add_argument("--host", default="127.0.0.1", help="address to listen on (default: this machine only)")
    p.add_argument("--port", type=int, default=8000, help="0 picks a free port")
    p.add_argument("--batching", choices=BATCHING_MODES, default="continuous",
                   help="continuous: admit between steps; static: wait for the running batch to drain")
    p.add_argument("--max-num-seqs", type=int, default=16)
    p.add_argument("--max-num-batched-tokens", type=int, default=1024)
    p.add_argument("--max-model-len", type=int, default=2048)
    p.add_argument("--num-kvcache-blocks", type=int, help="default: sized from memory")
    p.add_argument("--device", help="cpu or cuda (default: CUDA when present)")
    p.add_argument("--dtype", choices=("auto", "float32", "bfloat16", "float16"), default="auto",
                   help="weights and activations; auto: fp32 on a CPU, bf16/fp16 on a GPU")
    p.add_argument("--weight-format", choices=WEIGHT_FORMATS, default="dequantized",
                   help="q4_1: the GGUF's own 4-bit weights; int8: per-row int8 (both bf16, CPU only)")
    p.add_argument("--kv-cache-dtype", choices=KV_CACHE_DTYPES, default="auto",
                   help="K/V storage; int8/fp8 keep per-block scales (torch attention backend only)")
    defaults = Limits()
    p.add_argument("--max-body-bytes", type=int, default=defaults.max_body_bytes)
    p.add_argument("--max-prompt-tokens", type=int, help="default: what max-model-len leaves room for")
    p.add_argument("--max-waiting", type=int, default=defaults.max_waiting,
                   help="requests queued beyond this get 503")
    p.add_argument("--read-timeout", type=float, default=defaults.read_timeout_s,
                   help="seconds a request's headers and body may take to arrive")
    p.add_argument("--keep-alive-timeout", type=float, default=defaults.keep_alive_s,
                   help="seconds an idle keep-alive connection stays open")
    p.add_argument("--max-connections", type=int, default=defaults.max_connections,
                   help="open connections; a request beyond them gets 503")
    p.add_argument("--api-key", default=os.environ.get("LABKIT_API_KEY"),
                   help="clients must send 'Authorization: Bearer <key>' to /v1/*, /tokenize, /detokenize and "
                        "/metrics (default: $LABKIT_API_KEY; none: no key)")
    p.add_argument("--allowed-hosts", nargs="*", default=[], metavar="HOST",
                   help="Host names requests may use besides the address they reach (guards against DNS "
                        "rebinding); '*' takes any")
    p.add_argument("--allowed-origins", nargs="*", default=[], metavar="ORIGIN",
                   help="web origins (e.g. http://localhost:3000) whose pages may call the server, with CORS; "
                        "default: none")
    p.add_argument("--async-scheduling", action="store_true",
                   help="launch each decode step before the last one's tokens reach the host "
                        "(labkit/engine/overlap.py)")
    p.add_argument("--threads", type=int, help="torch threads (default: torch's choice)")
    p.add_argument("--exit-with-parent", type=int, metavar="PID", help=argparse.SUPPRESS)
    return p


def _exit_with_parent(pid: int) -> None:
    """Stop (as on Ctrl-C) once process `pid` is gone: a notebook kernel that dies leaves no server behind."""
    def watch():
        while os.getppid() == pid:
            time.sleep(1.0)
        os.kill(os.getpid(), signal.SIGTERM)

    threading.Thread(target=watch, name="labkit-parent-watch", daemon=True).start()


def main(argv=None) -> None:
    args = parser().parse_args(argv)
    if args.exit_with_parent:
        _exit_with_parent(args.exit_with_parent)
    access = Access(args.api_key or None, tuple(args.allowed_hosts), tuple(args.allowed_origins))
    if not is_loopback(args.host) and access.api_key is None:
        print(f"labkit serve: WARNING: listening on {args.host}, beyond this machine, with no API key: anyone who "
              "can reach it can use it (set --api-key or LABKIT_API_KEY)", file=sys.stderr, flush=True)
    if args.threads:
        torch.set_num_threads(args.threads)
    print(f"labkit serve: loading {args.model}… (reading the weights, sizing the KV cache)", flush=True)
    llm = LLM(args.model, max_num_seqs=args.max_num_seqs, max_num_batched_tokens=args.max_num_batched_tokens,
              max_model_len=args.max_model_len, num_kvcache_blocks=args.num_kvcache_blocks, device=args.device,
              dtype=None if args.dtype == "auto" else getattr(torch, args.dtype), weight_format=args.weight_format,
              kv_cache_dtype=args.kv_cache_dtype, async_scheduling=args.async_scheduling)
    limits = replace(Limits(), max_body_bytes=args.max_body_bytes, max_prompt_tokens=args.max_prompt_tokens,
                     max_waiting=args.max_waiting, read_timeout_s=args.read_timeout,
                     keep_alive_s=args.keep_alive_timeout, max_connections=args.max_connections)
    app = create_app(llm, args.served_model_name or args.model, batching=args.batching, limits=limits, access=access)
    sys.exit(run(app, bind(args.host, args.port)))


def _log_requests() -> None:
    """The access log and the server's errors on stderr, one line each, as vLLM logs its requests."""
    logger = logging.getLogger("labkit.serve")
    if not logger.handlers:
        handler = logging.StreamHandler()
        handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
        logger.addHandler(handler)
        logger.setLevel(logging.INFO)


def run(app, sock: socket.socket) -> int:
    """Serve `app` on `sock` until stopped (SIGINT, SIGTERM) or its engine dies; the exit status:
    0 after a stop, 1 after the engine died, so a supervisor restarts the server."""
    server = uvicorn.Server(uvicorn_config(app, os.environ.get("LABKIT_LOG_LEVEL", "warning")))
    died = []

    def engine_died():
        died.append(True)
        server.should_exit = True

    app.state.on_engine_death = engine_died
    _log_requests()
    print(f"{READY_LINE}{url_of(sock)}", flush=True)
    try:
        server.run(sockets=[sock])
    finally:
        sock.close()
    if died:
        print("labkit serve: the engine failed; exiting with status 1", file=sys.stderr, flush=True)
    return 1 if died else 0
