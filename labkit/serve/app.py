"""The HTTP side: OpenAI's routes on Starlette, in front of one `EngineLoop`.

    POST /v1/completions, /v1/chat/completions   JSON answers, or server-sent events with "stream": true
    GET  /v1/models, /health, /metrics
    POST /tokenize, /detokenize; GET /version    vLLM's own

Every refusal is OpenAI's error JSON. A request the engine fails on gets a 500 (or, streaming, an
error event); if the engine thread dies, /health turns 503 and the server stops (see
`_exit_if_engine_dies`). access.py checks the API key, Host and Origin before any route runs.

A body is refused before it is read whole when it is larger than the limit (by its Content-Length,
or while reading a chunked one), and a prompt before it is tokenized when its UTF-8 size alone
proves it longer than the token limit (no token is longer than the vocabulary's longest).
"""

import asyncio
import contextlib
import functools
import json
import logging
import time
import uuid
from collections import defaultdict
from dataclasses import replace

import anyio
from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.middleware import Middleware
from starlette.requests import ClientDisconnect, Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

import labkit
from labkit.engine import LLM
from labkit.engine.inputs import render_chat
from labkit.serve.access import Access
from labkit.serve.engine_loop import EngineLoop, EngineStopped, QueueFull, RequestFailed, log
from labkit.serve.metrics import CONTENT_TYPE
from labkit.serve.protocol import (
    Limits,
    RequestError,
    parse_chat,
    parse_completion,
    parse_detokenize,
    parse_json,
    parse_tokenize,
)

access_log = logging.getLogger("labkit.serve.access")


def create_app(llm: LLM, model_name: str, *, batching: str = "continuous", limits: Limits | None = None,
               access: Access | None = None) -> Starlette:
    """The app serving `llm` under `model_name`; its lifespan starts and stops the engine loop. `access`
    (access.py): the API key, Host allow-list and web origins; by default no key, this address only,
    no other origin."""
    limits = limits or Limits()
    engine = EngineLoop(llm, batching=batching, max_waiting=limits.max_waiting)
    server = _Server(llm, engine, model_name, limits)

    @contextlib.asynccontextmanager
    async def lifespan(app):
        engine.start()
        watcher = asyncio.create_task(_exit_if_engine_dies(app, engine, limits.death_drain_s))
        try:
            yield
        finally:
            watcher.cancel()
            engine.stop()

    routes = [
        Route("/v1/completions", server.completions, methods=["POST"]),
        Route("/v1/chat/completions", server.chat, methods=["POST"]),
        Route("/v1/models", server.models, methods=["GET"]),
        Route("/health", server.health, methods=["GET"]),
        Route("/metrics", server.metrics, methods=["GET"]),
        Route("/tokenize", server.tokenize, methods=["POST"]),
        Route("/detokenize", server.detokenize, methods=["POST"]),
        Route("/version", server.version, methods=["GET"]),
    ]
    middleware = [Middleware(AccessLog), *(access or Access()).middleware()]
    app = Starlette(routes=routes, lifespan=lifespan, middleware=middleware,
                    exception_handlers={HTTPException: _http_error, Exception: _server_error})
    app.state.engine, app.state.limits = engine, limits
    app.state.on_engine_death = None  # what runs the app sets it: how to stop serving
    return app


class AccessLog:
    """One log line per request once its answer has ended (a stream's too): client, method, path and
    status, and for a generation its id, prompt and completion tokens, time to first token and total
    time. Routes note what they know in the scope's "labkit.log" dict."""

    def __init__(self, app):
        self.app = app

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        start, status, note = time.perf_counter(), [499], {}
        scope["labkit.log"] = note

        async def sending(message):
            if message["type"] == "http.response.start":
                status[0] = message["status"]
            await send(message)

        try:
            await self.app(scope, receive, sending)
        finally:
            first = note.get("first_token_time")
            ttft = "-" if first is None else f"{first - start:.3f}s"
            client = ":".join(map(str, scope.get("client") or ("-", "-")))
            access_log.info("%s %s %s %d id=%s prompt_tokens=%s completion_tokens=%s ttft=%s total=%.3fs", client,
                            scope["method"], scope["path"], status[0], note.get("id", "-"),
                            note.get("prompt_tokens", "-"), note.get("completion_tokens", "-"), ttft,
                            time.perf_counter() - start)


async def _exit_if_engine_dies(app, engine: EngineLoop, drain_s: float) -> None:
    """vLLM's rule: a dead engine ends the server, so a supervisor restarts it. Every open request has
    had its error already; for `drain_s` more seconds /health says why, then the server stops and the
    process exits with a non-zero status (`app.state.on_engine_death` does that)."""
    await engine.died.wait()
    await asyncio.sleep(drain_s)
    if app.state.on_engine_death is not None:
        app.state.on_engine_death()


async def _server_error(request: Request, error: Exception) -> JSONResponse:
    """Whatever escaped a route: still OpenAI's error JSON (the traceback goes to the log)."""
    log.error("%s %s failed", request.method, request.url.path, exc_info=error)
    return error_response(RequestError(f"internal server error: {type(error).__name__}", None, status=500,
                                       type="server_error"))


async def _http_error(request: Request, error: HTTPException) -> JSONResponse:
    """An unknown path or method, answered in OpenAI's error shape like every other refusal."""
    return error_response(RequestError(f"{request.method} {request.url.path}: {error.detail}", None,
                                       status=error.status_code))


def error_response(error: RequestError) -> JSONResponse:
    headers = {"Retry-After": "1"} if error.status in (429, 503) else None
    return JSONResponse(error.body(), status_code=error.status, headers=headers)


class _Server:
    def __init__(self, llm: LLM, engine: EngineLoop, model_name: str, limits: Limits):
        self.llm, self.engine, self.model_name, self.limits = llm, engine, model_name, limits
        # One sequence can hold no more than the whole KV cache: a cache smaller than max_model_len
        # (a fixed num_kvcache_blocks) is the context this server serves and advertises, so a request
        # without max_tokens is filled to what fits instead of refused.
        cache_tokens = llm.block_manager.num_blocks * llm.block_manager.block_size
        self.max_model_len = min(llm.scheduler.config.max_model_len, cache_tokens)
        self.max_num_seqs = llm.scheduler.config.max_num_seqs
        self.max_prompt_tokens = min(limits.max_prompt_tokens or self.max_model_len - 1, self.max_model_len - 1)
        self.longest_token_bytes = max(len(token) for token in llm.tokenizer.vocab)
        self.created = int(time.time())

    # --- routes --------------------------------------------------------------------------------
    async def models(self, request: Request) -> Response:
        return JSONResponse({"object": "list", "data": [{
            "id": self.model_name, "object": "model", "created": self.created, "owned_by": "labkit",
            "max_model_len": self.max_model_len}]})

    async def health(self, request: Request) -> Response:
        if self.engine.alive:
            return JSONResponse({"status": "ok"})
        return JSONResponse({"status": "engine stopped"}, status_code=503)

    async def metrics(self, request: Request) -> Response:
        return Response(self.engine.metrics.render(), media_type=CONTENT_TYPE)

    async def completions(self, request: Request) -> Response:
        try:
            parsed = parse_completion(await self._read_json(request), self.model_name, self.limits)
            prompt = parsed.prompt
            if isinstance(prompt, str):
                ids = await self._tokenize(prompt, "prompt")
            else:
                vocab = self.llm.model.config.vocab_size
                if min(prompt) < 0 or max(prompt) >= vocab:
                    raise RequestError(f"prompt token ids must lie in [0, {vocab})", "prompt")
                ids = self._check_length(prompt, "prompt")
            params = self._fill_max_tokens(parsed.params, parsed.max_tokens_given, len(ids))
        except RequestError as error:
            return error_response(error)
        echo = ""
        if parsed.echo:
            echo = prompt if isinstance(prompt, str) else self.llm.tokenizer.decode(prompt)
        answer = _Answer("cmpl", "text_completion", self.model_name, parsed.include_usage, _completion_choice)
        return await self._respond(request, answer, ids, params, parsed.stream, echo)

    async def chat(self, request: Request) -> Response:
        try:
            parsed = parse_chat(await self._read_json(request), self.model_name, self.limits)
            text = self._chat_text(parsed.messages, True)
            ids = await self._tokenize(text, "messages")
            params = self._fill_max_tokens(parsed.params, parsed.max_tokens_given, len(ids))
        except RequestError as error:
            return error_response(error)
        answer = _Answer("chatcmpl", "chat.completion", self.model_name, parsed.include_usage,
                         _chat_choice(parsed.top_logprobs))
        return await self._respond(request, answer, ids, params, parsed.stream)

    async def tokenize(self, request: Request) -> Response:
        """vLLM's /tokenize: the ids the server would run for a prompt (or chat messages), and the context size."""
        try:
            parsed = parse_tokenize(await self._read_json(request), self.model_name)
            text = parsed.prompt
            if parsed.messages is not None:
                text = self._chat_text(parsed.messages, parsed.add_generation_prompt)
            ids = await anyio.to_thread.run_sync(
                functools.partial(self.llm.tokenizer.encode, text, add_special_tokens=parsed.add_special_tokens))
        except RequestError as error:
            return error_response(error)
        strs = [self.llm.tokenizer.id_to_token(i) for i in ids] if parsed.return_token_strs else None
        return JSONResponse({"count": len(ids), "max_model_len": self.max_model_len, "tokens": ids,
                             "token_strs": strs})

    async def detokenize(self, request: Request) -> Response:
        try:
            ids = parse_detokenize(await self._read_json(request), self.model_name, self.llm.model.config.vocab_size)
        except RequestError as error:
            return error_response(error)
        return JSONResponse({"prompt": self.llm.tokenizer.decode(ids)})

    async def version(self, request: Request) -> Response:
        return JSONResponse({"version": labkit.__version__})

    # --- checks ----------------------------------------------------------------------------------
    def _chat_text(self, messages: list[dict], add_generation_prompt: bool) -> str:
        try:
            return render_chat(self.llm.tokenizer, messages, add_generation_prompt)
        except ValueError as error:  # e.g. the template refuses an order of roles
            raise RequestError(f"messages: {error}", "messages") from None

    async def _read_json(self, request: Request) -> dict:
        limit = self.limits.max_body_bytes
        too_large = RequestError(f"request body is larger than the server's limit of {limit} bytes", None,
                                 status=413, code="request_too_large")
        length = request.headers.get("content-length")
        if length is not None and (not length.isdigit() or int(length) > limit):
            raise too_large
        body = bytearray()
        try:
            async for chunk in request.stream():
                body += chunk
                if len(body) > limit:
                    raise too_large
        except ClientDisconnect:
            raise RequestError("the client went away while sending its body", None) from None
        return parse_json(bytes(body))

    async def _tokenize(self, text: str, param: str) -> list[int]:
        # No token is longer than the longest in the vocabulary, so this size alone proves it too long.
        if len(text.encode("utf-8")) > self.max_prompt_tokens * self.longest_token_bytes:
            raise self._too_long(None, param)
        ids = await anyio.to_thread.run_sync(self.llm.tokenizer.encode, text)
        if not ids:
            raise RequestError(f"{param} encodes to no tokens", param)
        return self._check_length(ids, param)

    def _check_length(self, ids: list[int], param: str) -> list[int]:
        if len(ids) > self.max_prompt_tokens:
            raise self._too_long(len(ids), param)
        return ids

    def _too_long(self, count: int | None, param: str) -> RequestError:
        size = "is" if count is None else f"has {count} tokens,"
        return RequestError(f"{param} {size} longer than this server's limit of {self.max_prompt_tokens} "
                            "prompt tokens", param, code="context_length_exceeded")

    def _fill_max_tokens(self, params, given: bool, num_prompt_tokens: int):
        """Without max_tokens a request may fill the context; with it, it must fit there. (Checked
        here too: the n samples must be able to run at once, as the engine requires.)"""
        if params.n > self.max_num_seqs:
            raise RequestError(f"n={params.n} samples cannot run at once on this server (its max_num_seqs is "
                               f"{self.max_num_seqs})", "n")
        room = self.max_model_len - num_prompt_tokens
        if params.min_tokens > room:
            raise RequestError(f"min_tokens is {params.min_tokens} but the prompt's {num_prompt_tokens} tokens "
                               f"leave room for {room} in this model's context of {self.max_model_len}",
                               "min_tokens", code="context_length_exceeded")
        if not given:
            return replace(params, max_tokens=room)
        if params.max_tokens > room:
            raise RequestError(f"max_tokens is {params.max_tokens} but the prompt's {num_prompt_tokens} tokens "
                               f"leave room for {room} in this model's context of {self.max_model_len}",
                               "max_tokens", code="context_length_exceeded")
        return params

    # --- answering -------------------------------------------------------------------------------
    async def _respond(self, request: Request, answer: "_Answer", ids: list[int], params, stream: bool,
                       prefix: str = "") -> Response:
        answer.note = request.scope.get("labkit.log", {})
        answer.note["id"] = answer.id
        deltas = self.engine.generate(answer.id, ids, params, stream)
        if not stream:
            return await _unless_disconnected(request, self._whole(answer, deltas, prefix))
        # A stream may wait in the queue a while before its first token: a client that leaves meanwhile
        # has its request aborted there, before its prompt is prefilled.
        first = await _unless_disconnected(request, _first_delta(deltas))
        if isinstance(first, Response):
            return first
        return StreamingResponse(answer.events(first, deltas, prefix), media_type="text/event-stream",
                                 headers={"Cache-Control": "no-cache"})

    async def _whole(self, answer: "_Answer", deltas, prefix: str) -> Response:
        first = await _first_delta(deltas)
        if isinstance(first, Response):
            return first
        try:
            return await answer.collect(first, deltas, prefix)
        except (EngineStopped, RequestFailed) as error:  # the engine died between two samples' ends
            return error_response(_engine_error(error))


async def _first_delta(deltas):
    """The request's first delta, or the error response if it was not admitted: said while a status
    can still be sent."""
    try:
        return await anext(deltas)
    except QueueFull as error:
        return error_response(RequestError(f"server is busy: {error}", None, status=503, type="server_busy",
                                           code="queue_full"))
    except (EngineStopped, RequestFailed) as error:
        return error_response(_engine_error(error))
    except ValueError as error:  # the engine refused it (it could never fit in the KV cache, or sample a token)
        return error_response(RequestError(str(error), None))


def _engine_error(error: Exception) -> RequestError:
    """A request the engine could not serve: 503 if it is not running, 500 if it failed on this one."""
    status = 500 if isinstance(error, RequestFailed) else 503
    return RequestError(str(error), None, status=status, type="server_error")


class _Answer:
    """One response's ids and shape, in both its forms: one JSON object, or a stream of chunks.

    A request with `n` samples answers with `n` choices; its deltas come interleaved, each naming
    its sample, and so do the stream's chunks. `choice(text, final, logprobs, offset)` shapes one
    choice's body for the route; `offset` is where the text starts in the choice's whole text
    (the completions route's `text_offset`).
    """

    def __init__(self, prefix: str, kind: str, model: str, include_usage: bool, choice):
        self.id = f"{prefix}-{uuid.uuid4().hex}"
        self.kind, self.model, self.include_usage, self.choice = kind, model, include_usage, choice
        self.created = int(time.time())
        self.note: dict = {}  # what the access log tells of it

    def _usage(self, finals) -> dict:
        usage = _usage(finals)
        self.note.update(usage, first_token_time=min((d.first_token_time for d in finals
                                                      if d.first_token_time is not None), default=None))
        return usage

    def _envelope(self, kind: str, choices: list, **extra) -> dict:
        return {"id": self.id, "object": kind, "created": self.created, "model": self.model, "choices": choices,
                **extra}

    async def collect(self, first, deltas, prefix: str) -> JSONResponse:
        texts, logprobs, last = defaultdict(lambda: [prefix]), defaultdict(list), {}
        async with contextlib.aclosing(deltas):
            async for delta in _chain(first, deltas):
                texts[delta.index].append(delta.text)
                if delta.logprobs is not None:
                    logprobs[delta.index] += delta.logprobs
                if delta.finish_reason is not None:
                    last[delta.index] = delta
        choices = [{"index": i, **self.choice("".join(texts[i]), True, logprobs.get(i, last[i].logprobs),
                                              len(prefix)), "finish_reason": last[i].finish_reason}
                   for i in sorted(last)]
        prompt = _prompt_logprobs(last[0].prompt_logprobs)
        extra = {}
        if prompt is not None:  # vLLM's places: on each completion choice, at the top of a chat answer
            if self.kind == "text_completion":
                choices = [{**choice, "prompt_logprobs": prompt} for choice in choices]
            else:
                extra["prompt_logprobs"] = prompt
        return JSONResponse(self._envelope(self.kind, choices, usage=self._usage(list(last.values())), **extra))

    async def events(self, first, deltas, prefix: str):
        """Server-sent events; leaving early (the client went away) closes `deltas`, which aborts the request."""
        chunk_kind = self.kind + ".chunk" if self.kind == "chat.completion" else self.kind
        extra = {"usage": None} if self.include_usage else {}
        offsets, last = {}, {}  # per sample: where its next text starts; its final delta
        async with contextlib.aclosing(deltas):
            try:
                async for delta in _chain(first, deltas):
                    for event in self._chunks(delta, prefix, chunk_kind, extra, offsets):
                        yield event
                    if delta.finish_reason is not None:
                        last[delta.index] = delta
            except (EngineStopped, RequestFailed) as error:  # too late for a status: an error event, as vLLM sends
                yield _event(_engine_error(error).body())
                yield "data: [DONE]\n\n"
                return
        usage = self._usage(list(last.values()))
        if self.include_usage:
            yield _event(self._envelope(chunk_kind, [], usage=usage))
        yield "data: [DONE]\n\n"

    def _chunks(self, delta, prefix: str, chunk_kind: str, extra: dict, offsets: dict) -> list[str]:
        """The events one delta makes: the role first if it starts a chat choice, then its text."""
        events, i, text = [], delta.index, delta.text
        if i not in offsets:
            if self.kind == "chat.completion":  # OpenAI's first chat chunk of a choice names the role
                events.append(_event(self._envelope(chunk_kind, [{
                    "index": i, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                    "finish_reason": None}])))
            offsets[i], text = 0, prefix + text
        if text or delta.logprobs or delta.finish_reason is not None:
            choice = {"index": i, **self.choice(text, False, delta.logprobs, offsets[i]),
                      "finish_reason": delta.finish_reason}
            prompt = _prompt_logprobs(delta.prompt_logprobs)
            if prompt is not None and self.kind == "text_completion":
                choice["prompt_logprobs"] = prompt
            elif prompt is not None:
                extra = {**extra, "prompt_logprobs": prompt}
            events.append(_event(self._envelope(chunk_kind, [choice], **extra)))
        offsets[i] += len(text)
        return events


async def _chain(first, rest):
    yield first
    async for item in rest:
        yield item


def _completion_choice(text: str, final: bool, logprobs: list | None, offset: int) -> dict:
    """OpenAI's legacy logprobs: the sampled tokens, their logprobs, each position's top tokens
    (as vLLM sends them: the sampled token and the `logprobs` best) and where each token starts."""
    if logprobs is None:
        return {"text": text, "logprobs": None}
    tokens, sampled, offsets = [], [], []
    for position in logprobs:
        token = next(iter(position.values()))  # the engine puts the sampled token first
        tokens.append(token.decoded_token)
        sampled.append(token.logprob)
        offsets.append(offset)
        offset += len(token.decoded_token)
    top = [{entry.decoded_token: entry.logprob for entry in position.values()} for position in logprobs]
    return {"text": text, "logprobs": {"tokens": tokens, "token_logprobs": sampled, "top_logprobs": top,
                                       "text_offset": offsets}}


def _chat_choice(num_top: int | None):
    """The chat route's choice shape; `num_top` is the request's top_logprobs (None: no logprobs)."""
    def choice(text: str, final: bool, logprobs: list | None, offset: int) -> dict:
        content = None if logprobs is None else [_chat_logprob(position, num_top) for position in logprobs]
        wrapped = None if content is None else {"content": content}
        if final:
            return {"message": {"role": "assistant", "content": text}, "logprobs": wrapped}
        return {"delta": {"content": text} if text else {}, "logprobs": wrapped}
    return choice


def _chat_logprob(position: dict, num_top: int) -> dict:
    entries = list(position.values())
    sampled = entries[0]  # the engine puts the sampled token first, then the top ones unless it is one
    top = entries[1:] if len(entries) > num_top else sorted(entries, key=lambda e: e.rank)
    return {**_token_logprob(sampled), "top_logprobs": [_token_logprob(e) for e in top]}


def _token_logprob(entry) -> dict:
    return {"token": entry.decoded_token, "logprob": entry.logprob, "bytes": list(entry.decoded_token.encode())}


def _prompt_logprobs(positions: list | None) -> list | None:
    """vLLM's prompt_logprobs: per prompt token, None for the first, else {token id: {logprob, rank, decoded_token}}."""
    if positions is None:
        return None
    return [None if position is None else {str(token): {"logprob": e.logprob, "rank": e.rank,
                                                        "decoded_token": e.decoded_token}
                                           for token, e in position.items()}
            for position in positions]


def _usage(finals) -> dict:
    """Every sample's tokens count: the prompt once, each of the n completions."""
    finals = list(finals)
    prompt = finals[0].num_prompt_tokens if finals else 0
    completion = sum(delta.num_output_tokens for delta in finals)
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}


def _event(data: dict) -> str:
    return f"data: {json.dumps(data, ensure_ascii=False)}\n\n"


async def _unless_disconnected(request: Request, answering):
    """Await `answering` (a whole answer, or a stream's first delta), but give up (aborting the request)
    if the client disconnects first: then a 499 response."""
    async def client_gone():
        while (await request.receive())["type"] != "http.disconnect":
            pass

    async with anyio.create_task_group() as group:
        result = []

        async def answer():
            result.append(await answering)
            group.cancel_scope.cancel()

        async def watch():
            await client_gone()
            group.cancel_scope.cancel()

        group.start_soon(answer)
        group.start_soon(watch)
    return result[0] if result else Response(status_code=499)
