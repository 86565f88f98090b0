"""One thread owns the engine; HTTP handlers talk to it through queues.

`LLM` is not thread-safe and `step()` is a long blocking call, so a single thread drives it:

    while serving:
        take new requests and aborts from the inbox        (between steps, never during one)
        step()                                             (one forward pass for the whole batch)
        send each request the text it gained                (to its own asyncio.Queue)

Each HTTP request submits its prompt and then reads `Delta`s from a queue of its own, keyed by the
server's request id, on the event loop's side. A handler that goes away (client disconnected)
closes its `generate` iterator, which sends an abort; the next pass through the loop frees the
request's blocks.

`batching="static"` is the baseline continuous batching is measured against: new requests wait
until the whole running batch has drained, then up to `max_num_seqs` of them start together.
"""

import asyncio
import logging
import threading
import time
from collections import deque
from collections.abc import AsyncIterator
from dataclasses import dataclass

import torch

from labkit.engine import LLM, FinishReason, RequestOutput
from labkit.serve.metrics import ServerMetrics

BATCHING_MODES = ("continuous", "static")
log = logging.getLogger("labkit.serve")


class QueueFull(Exception):
    """More requests are waiting than the server accepts; the client should retry later."""


class EngineStopped(Exception):
    """The engine loop is not running (shut down, or it failed)."""


class RequestFailed(Exception):
    """The engine finished this request with reason ERROR (its step failed); the others went on."""


@dataclass(frozen=True)
class Delta:
    """New text for one of a request's `n` samples; each sample's last one carries its finish reason
    and token counts. The request is over once every sample has sent its last."""

    text: str
    index: int = 0  # which sample (OpenAI's choice index)
    finish_reason: str | None = None  # OpenAI's: "stop" or "length"
    num_prompt_tokens: int = 0
    num_output_tokens: int = 0
    logprobs: list | None = None  # the engine's PositionLogprobs of the tokens since the last delta, if asked
    prompt_logprobs: list | None = None  # on sample 0's last delta, if asked: one per prompt token (None first)
    first_token_time: float | None = None  # on last deltas: perf_counter when the engine sampled the first token


@dataclass
class _Request:
    prompt: list[int]
    params: object
    queue: asyncio.Queue
    stream: bool  # send text as it grows, or only the final Delta (with all of it)
    submitted_at: float  # perf_counter when the server accepted it: TTFT counts queueing here too
    engine_id: int | None = None
    sent: list[int] | None = None  # per sample: characters of text already sent
    sent_tokens: list[int] | None = None  # per sample: tokens whose logprobs were already sent

    def __post_init__(self):
        self.sent, self.sent_tokens = [0] * self.params.n, [0] * self.params.n


class EngineLoop:
    def __init__(self, llm: LLM, *, batching: str = "continuous", max_waiting: int = 256,
                 metrics: ServerMetrics | None = None):
        if batching not in BATCHING_MODES:
            raise ValueError(f"batching must be one of {', '.join(BATCHING_MODES)}, got {batching!r}")
        self.llm, self.batching, self.max_waiting = llm, batching, max_waiting
        self.metrics = metrics or ServerMetrics()
        self._wake = threading.Condition()
        self._inbox: deque[tuple[str, str, _Request | None]] = deque()  # ("add" | "abort", id, request)
        # The engine thread's own state:
        self._pending: deque[str] = deque()  # accepted, not yet handed to the engine
        self._requests: dict[str, _Request] = {}  # request id -> request, until it finishes
        self._by_engine_id: dict[int, str] = {}
        self._thread: threading.Thread | None = None
        self._stopping = False
        self._loop: asyncio.AbstractEventLoop | None = None
        self.error: BaseException | None = None
        self.died: asyncio.Event | None = None  # set (on the event loop) if the engine thread failed

    # --- lifecycle (event-loop side) -------------------------------------------------------------
    def start(self) -> None:
        self._loop = asyncio.get_running_loop()
        self.died = asyncio.Event()
        self._thread = threading.Thread(target=self._run, name="labkit-engine", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        """Abort whatever is left and join the thread."""
        with self._wake:
            self._stopping = True
            self._wake.notify()
        if self._thread is not None:
            self._thread.join()

    @property
    def alive(self) -> bool:
        return self._thread is not None and self._thread.is_alive() and not self._stopping

    @property
    def num_waiting(self) -> int:
        """Requests accepted but not running yet: the server's queue and the scheduler's."""
        return len(self._pending) + len(self._inbox) + len(self.llm.scheduler.waiting)

    # --- requests (event-loop side) ----------------------------------------------------------------
    async def generate(self, request_id: str, prompt: list[int], params, stream: bool = True) -> AsyncIterator[Delta]:
        """Submit one request and yield its text as it grows (or all at once at the end, without
        `stream`); leaving early aborts it."""
        if not self.alive:
            raise EngineStopped("the engine is not running" + (f": {self.error}" if self.error else ""))
        if self.num_waiting >= self.max_waiting:
            raise QueueFull(f"{self.num_waiting} requests are already waiting (the limit is {self.max_waiting})")
        request = _Request(prompt, params, asyncio.Queue(), stream, time.perf_counter())
        self._send("add", request_id, request)
        finished, samples_left = False, params.n
        try:
            while True:
                item = await request.queue.get()
                if isinstance(item, BaseException):
                    finished = True  # the engine has already forgotten it
                    raise item
                samples_left -= item.finish_reason is not None
                finished = samples_left == 0
                yield item
                if finished:
                    return
        finally:
            if not finished:
                self._send("abort", request_id)

    def _send(self, action: str, request_id: str, request: _Request | None = None) -> None:
        with self._wake:
            self._inbox.append((action, request_id, request))
            self._wake.notify()

    def _deliver(self, request: _Request, item) -> None:
        self._deliver_all([(request, item)])

    def _deliver_all(self, items: list[tuple[_Request, object]]) -> None:
        """Hand items to their requests' queues in one wake-up of the event loop (not one per request)."""
        if items and not self._loop.is_closed():
            self._loop.call_soon_threadsafe(_put_all, items)

    # --- the engine thread -----------------------------------------------------------------------
    def _run(self) -> None:
        try:
            with torch.inference_mode():  # grad mode is per thread: this one runs the model
                while self._next_batch():
                    self._admit()
                    if self.llm.has_unfinished_requests():
                        self._step()
                    self.metrics.observe_engine(self.llm, self.num_waiting)
        except BaseException as error:  # noqa: BLE001 - every waiting client must hear of it
            self.error = error
            log.exception("the engine thread failed; every open request gets an error and the server exits")
        finally:
            self._shutdown()
        if self.error is not None and not self._loop.is_closed():
            self._loop.call_soon_threadsafe(self.died.set)

    def _next_batch(self) -> bool:
        """Wait until there is work; take the inbox. False once stopping."""
        with self._wake:
            while not self._stopping and not self._inbox and not self._pending \
                    and not self.llm.has_unfinished_requests():
                self._wake.wait()
            if self._stopping:
                return False
            inbox, self._inbox = list(self._inbox), deque()
        for action, request_id, request in inbox:
            if action == "add":
                self._requests[request_id] = request
                self._pending.append(request_id)
            else:
                self._abort(request_id)
        return True

    def _admit(self) -> None:
        if self.batching == "static":
            if self.llm.has_unfinished_requests():
                return  # the running batch drains first
            count = self.llm.scheduler.config.max_num_seqs
        else:
            count = len(self._pending)
        while self._pending and count > 0:
            request_id = self._pending.popleft()
            request = self._requests[request_id]
            try:
                request.engine_id = self.llm.add_request(request.prompt, request.params)
            except ValueError as error:  # e.g. it could never fit in the KV cache
                self._requests.pop(request_id)
                self._deliver(request, error)
                continue
            self._by_engine_id[request.engine_id] = request_id
            count -= 1

    def _abort(self, request_id: str) -> None:
        request = self._requests.pop(request_id, None)
        if request is None:
            return  # it had already finished
        if request.engine_id is None:  # still in the server's queue
            self._pending.remove(request_id)
        else:
            self._by_engine_id.pop(request.engine_id)
            self.llm.abort(request.engine_id)
        self.metrics.aborted()

    def _step(self) -> None:
        finished = {out.request_id: out for out in self.llm.step()}
        items = []
        for engine_id, request_id in list(self._by_engine_id.items()):
            request = self._requests[request_id]
            out = finished.get(engine_id)
            if out is not None:
                items += [(request, delta) for delta in self._finish(request_id, request, out)]
            elif request.stream:
                # Text is held back while a stop string might still be forming at its end; a sample
                # that finished early sends its last text when the whole request does.
                holdback = max((len(s) - 1 for s in request.params.stop), default=0)
                for sample in self.llm.request_output(engine_id).outputs:
                    if not sample.finished and len(sample.text) - holdback > request.sent[sample.index]:
                        items.append((request, self._delta(request, sample, len(sample.text) - holdback)))
        self._deliver_all(items)

    @staticmethod
    def _delta(request: _Request, sample, upto: int, **final) -> Delta:
        """Sample's text from where the last delta left it up to `upto`, with the logprobs of its new tokens."""
        i, tokens = sample.index, len(sample.token_ids)
        logprobs = None if sample.logprobs is None else sample.logprobs[request.sent_tokens[i]:tokens]
        delta = Delta(sample.text[request.sent[i]:upto], i, logprobs=logprobs, **final)
        request.sent[i], request.sent_tokens[i] = upto, tokens
        return delta

    def _finish(self, request_id: str, request: _Request, out: RequestOutput) -> list:
        del self._requests[request_id], self._by_engine_id[out.request_id]
        failed = next((s for s in out.outputs if s.finish_reason is FinishReason.ERROR), None)
        reason = "error" if failed else _openai_reason(out.outputs[0])
        self.metrics.finished(request.submitted_at, reason, out.metrics)  # before the client can hear of it
        if failed is not None:
            return [RequestFailed(f"the engine failed on this request: {failed.stop_reason}")]
        return [self._delta(request, sample, len(sample.text), finish_reason=_openai_reason(sample),
                            num_prompt_tokens=len(out.prompt_token_ids), num_output_tokens=len(sample.token_ids),
                            prompt_logprobs=out.prompt_logprobs if sample.index == 0 else None,
                            first_token_time=out.metrics.first_token_time)
                for sample in out.outputs]

    def _shutdown(self) -> None:
        """Abort every request still here and tell its client, so no handler waits forever."""
        error = EngineStopped("the server is shutting down" if self.error is None else f"the engine failed: "
                              f"{self.error!r}")
        with self._wake:
            self._stopping = True
            inbox, self._inbox = list(self._inbox), deque()
        self._requests.update((request_id, request) for action, request_id, request in inbox if action == "add")
        for request in self._requests.values():
            self._deliver(request, error)  # first: an engine too broken to abort must not keep a client waiting
            if request.engine_id is not None:
                try:
                    self.llm.abort(request.engine_id)
                except Exception:  # noqa: BLE001 - the engine failed already; the process is about to exit
                    if self.error is None:
                        raise
                    log.exception("aborting request %s after the engine failed", request.engine_id)
        self._requests.clear()
        self._by_engine_id.clear()
        self._pending.clear()


def _openai_reason(sample) -> str:
    return "length" if sample.finish_reason is FinishReason.MAX_TOKENS else "stop"  # OpenAI has no "eos"


def _put_all(items) -> None:
    for request, item in items:
        request.queue.put_nowait(item)
