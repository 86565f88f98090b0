"""`labkit serve` driven as its clients drive it: the official `openai` client, and raw HTTP for what
a well-behaved client never sends (malformed JSON, unknown fields, huge bodies, disconnects).

Every server binds 127.0.0.1 on a free port in a thread of this process and is shut down by its
`with` block; the answers are compared token for token with the offline engine's on the same model.
"""

import asyncio
import contextlib
import json
import logging
import os
import random
import re
import socket
import subprocess
import sys
import time
from dataclasses import replace

import httpx
import openai
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from prometheus_client.parser import text_string_to_metric_families
from serve_support import MODEL_NAME, assert_engine_idle, server_threads, tiny_llm, wait_until

import labkit
from labkit.__main__ import main as labkit_main
from labkit.sampling import SamplingParams
from labkit.serve import protocol
from labkit.serve.access import Access
from labkit.serve.app import create_app
from labkit.serve.protocol import Limits
from labkit.serve.server import ServerThread

GREEDY = SamplingParams(temperature=0, max_tokens=8)
CHAT = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "What is a KV cache?"}]


def serve(llm, **kwargs) -> ServerThread:
    return ServerThread(create_app(llm, MODEL_NAME, **kwargs))


@contextlib.contextmanager
def no_leaked_threads():
    before = server_threads()
    yield
    assert server_threads() - before == set(), "a server left a thread running"


def client(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=60)


def metrics(server) -> dict[str, float]:
    """Every sample of /metrics by name and labels, e.g. 'labkit_requests_total{finished_reason="abort"}'."""
    text = httpx.get(server.url + "/metrics", trust_env=False).text
    samples = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            labels = ",".join(f'{k}="{v}"' for k, v in sorted(s.labels.items()))
            samples[s.name + (f"{{{labels}}}" if labels else "")] = s.value
    return samples


@pytest.mark.parametrize("async_scheduling", [False, True], ids=["synchronous", "async-scheduling"])
def test_openai_client_completions_chat_and_streams_match_the_offline_engine(async_scheduling):
    oracle = tiny_llm()
    prompt = "The capital of France is"
    expected = oracle.generate(prompt, GREEDY)[0]
    expected_chat = oracle.chat(CHAT, GREEDY)[0]
    llm = tiny_llm(async_scheduling=async_scheduling)
    in_flight = []  # for each overlapped launch: whether the step before was still in flight (never waited for)
    if async_scheduling:
        run = llm._overlap.run
        llm._overlap.run = lambda out: in_flight.append(llm._overlap.pending is not None) or run(out)
    with no_leaked_threads(), serve(llm) as server:
        c = client(server)
        assert [m.id for m in c.models.list().data] == [MODEL_NAME]

        out = c.completions.create(model=MODEL_NAME, prompt=prompt, max_tokens=8, temperature=0)
        assert out.choices[0].text == expected.text
        assert out.choices[0].finish_reason == ("length" if len(expected.token_ids) == 8 else "stop")
        assert (out.usage.prompt_tokens, out.usage.completion_tokens) == (len(expected.prompt_token_ids),
                                                                          len(expected.token_ids))
        echoed = c.completions.create(model=MODEL_NAME, prompt=prompt, max_tokens=8, temperature=0, echo=True)
        assert echoed.choices[0].text == prompt + expected.text

        chunks = list(c.completions.create(model=MODEL_NAME, prompt=prompt, max_tokens=8, temperature=0,
                                           stream=True))
        assert "".join(ch.choices[0].text for ch in chunks) == expected.text
        assert len(chunks) > 2 and chunks[-1].choices[0].finish_reason == out.choices[0].finish_reason

        chat = c.chat.completions.create(model=MODEL_NAME, messages=CHAT, max_tokens=8, temperature=0)
        assert chat.choices[0].message.role == "assistant"
        assert chat.choices[0].message.content == expected_chat.text
        assert chat.usage.completion_tokens == len(expected_chat.token_ids)

        stream = c.chat.completions.create(model=MODEL_NAME, messages=CHAT, max_tokens=8, temperature=0,
                                           stream=True, stream_options={"include_usage": True})
        chunks = list(stream)
        assert chunks[0].choices[0].delta.role == "assistant"
        assert "".join(ch.choices[0].delta.content or "" for ch in chunks if ch.choices) == expected_chat.text
        assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == len(expected_chat.token_ids)

        # vLLM's extra fields go through extra_body; a seed makes sampling reproducible.
        seeded = [c.completions.create(model=MODEL_NAME, prompt=prompt, max_tokens=8, temperature=1.0, seed=7,
                                       extra_body={"top_k": 50, "ignore_eos": True}).choices[0].text
                  for _ in range(2)]
        assert seeded[0] == seeded[1] == oracle.generate(prompt, SamplingParams(
            temperature=1.0, seed=7, top_k=50, ignore_eos=True, max_tokens=8))[0].text
        # A stop string cuts the text before it, streamed or not.
        stop = expected.text[3:5]
        for stream in (False, True):
            answer = c.completions.create(model=MODEL_NAME, prompt=prompt, max_tokens=8, temperature=0, stop=[stop],
                                          stream=stream)
            text = "".join(ch.choices[0].text for ch in answer) if stream else answer.choices[0].text
            assert text == expected.text[:expected.text.index(stop)]

        assert sum(in_flight) >= 20 if async_scheduling else not in_flight  # streams did not stall the overlap
        seen = metrics(server)
        assert seen["labkit_time_to_first_token_seconds_count"] == 9
        assert seen['labkit_requests_total{finished_reason="length"}'] >= 1
        assert seen["labkit_num_requests_running"] == 0 and seen["labkit_kv_cache_usage_ratio"] == 0
        assert seen["labkit_prefix_cache_hits_tokens_total"] > 0  # the same prompt, again and again
    assert_engine_idle(llm)


SAMPLED = SamplingParams(n=3, temperature=1.0, seed=11, max_tokens=8, logprobs=3)


def top_k(position: dict, k: int) -> dict[str, float]:
    """The k most likely tokens of one position of the engine's logprobs, text -> logprob."""
    best = sorted(position.values(), key=lambda entry: entry.rank)[:k]
    return {entry.decoded_token: entry.logprob for entry in best}


def test_n_samples_and_logprobs_match_the_offline_engine():
    """n=3 seeded samples, each with its own text, finish reason and the engine's own logprobs, in
    both routes' shapes, streamed or not; usage counts all three completions."""
    prompt = "The capital of France is"
    oracle = tiny_llm()
    expected = oracle.generate(prompt, SAMPLED)[0].outputs
    expected_chat = oracle.chat(CHAT, replace(SAMPLED, logprobs=2))[0].outputs
    assert len({s.text for s in expected}) > 1  # the samples differ, so a mixed-up index would show
    llm = tiny_llm()
    with serve(llm) as server:
        c = client(server)
        ask = {"model": MODEL_NAME, "n": 3, "temperature": 1.0, "seed": 11, "max_tokens": 8}
        out = c.completions.create(prompt=prompt, logprobs=3, **ask)
        assert [ch.index for ch in out.choices] == [0, 1, 2]
        assert out.usage.completion_tokens == sum(len(s.token_ids) for s in expected)
        for choice, sample in zip(out.choices, expected, strict=True):
            assert choice.text == sample.text
            assert choice.finish_reason == ("length" if len(sample.token_ids) == 8 else "stop")
            lp = choice.logprobs
            assert lp.token_logprobs == [pos[t].logprob for pos, t in zip(sample.logprobs, sample.token_ids,
                                                                           strict=True)]
            assert lp.tokens == [pos[t].decoded_token for pos, t in zip(sample.logprobs, sample.token_ids,
                                                                         strict=True)]
            for top, pos, t in zip(lp.top_logprobs, sample.logprobs, sample.token_ids, strict=True):
                assert top == {pos[t].decoded_token: pos[t].logprob, **top_k(pos, 3)}
            assert lp.text_offset == [sum(map(len, lp.tokens[:j])) for j in range(len(lp.tokens))]

        texts, tokens, finishes = ["", "", ""], [[], [], []], {}
        for chunk in c.completions.create(prompt=prompt, logprobs=3, stream=True, **ask):
            (choice,) = chunk.choices
            texts[choice.index] += choice.text
            tokens[choice.index] += choice.logprobs.tokens
            if choice.finish_reason:
                finishes[choice.index] = choice.finish_reason
        assert texts == [s.text for s in expected] and sorted(finishes) == [0, 1, 2]
        assert tokens == [[pos[t].decoded_token for pos, t in zip(s.logprobs, s.token_ids, strict=True)]
                          for s in expected]

        chat = c.chat.completions.create(messages=CHAT, logprobs=True, top_logprobs=2, **ask)
        assert chat.usage.completion_tokens == sum(len(s.token_ids) for s in expected_chat)
        for choice, sample in zip(chat.choices, expected_chat, strict=True):
            assert choice.message.content == sample.text
            content = choice.logprobs.content
            assert [(e.token, e.logprob) for e in content] == [
                (pos[t].decoded_token, pos[t].logprob) for pos, t in zip(sample.logprobs, sample.token_ids,
                                                                         strict=True)]
            assert all(e.bytes == list(e.token.encode()) for e in content)
            assert [{top.token: top.logprob for top in e.top_logprobs} for e in content] == [
                top_k(pos, 2) for pos in sample.logprobs]

        texts, entries = ["", "", ""], [[], [], []]
        for chunk in c.chat.completions.create(messages=CHAT, logprobs=True, top_logprobs=2, stream=True, **ask):
            for choice in chunk.choices:
                texts[choice.index] += choice.delta.content or ""
                entries[choice.index] += [e.logprob for e in choice.logprobs.content] if choice.logprobs else []
        assert texts == [s.text for s in expected_chat]
        assert entries == [[pos[t].logprob for pos, t in zip(s.logprobs, s.token_ids, strict=True)]
                           for s in expected_chat]
        # Without logprobs there are none, and n still gives n choices.
        plain = c.chat.completions.create(messages=CHAT, **ask)
        assert [ch.message.content for ch in plain.choices] == [s.text for s in expected_chat]
        assert all(ch.logprobs is None for ch in plain.choices)
        off = c.chat.completions.create(messages=CHAT, logprobs=False, top_logprobs=0, **ask)  # the "off" values
        assert [ch.message.content for ch in off.choices] == [s.text for s in expected_chat]
    assert_engine_idle(llm)


def post(server, path, body: bytes, headers=None) -> httpx.Response:
    headers = {"content-type": "application/json", **(headers or {})}
    return httpx.post(server.url + path, content=body, headers=headers, trust_env=False, timeout=60)


def assert_error(response: httpx.Response, status: int, param, *words):
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["param"] == param
    for word in words:
        assert word in error["message"], error["message"]
    return error


@pytest.mark.parametrize(("body", "param", "words"), [
    ({"prompt": "Hi", "max_tokens": 4, "frobnicate": 1}, "frobnicate", ["Unrecognized", "frobnicate"]),
    ({"prompt": "Hi", "temperature": -1}, "temperature", ["temperature", ">= 0"]),
    ({"prompt": "Hi", "max_tokens": 0}, "max_tokens", ["max_tokens"]),
    ({"prompt": "Hi", "max_tokens": "5"}, "max_tokens", ["max_tokens"]),
    ({"prompt": "Hi", "top_p": 0}, "top_p", ["top_p"]),
    ({"prompt": "Hi", "top_k": "many"}, "top_k", ["top_k"]),
    ({"prompt": "Hi", "stop": [""]}, "stop", ["stop"]),
    ({"prompt": "Hi", "n": 0}, "n", ["n must be"]),
    ({"prompt": "Hi", "n": 17}, "n", ["n=17", "max_num_seqs"]),
    ({"prompt": "Hi", "n": 2, "best_of": 3}, "best_of", ["best_of"]),
    ({"prompt": "Hi", "logprobs": 21}, "logprobs", ["logprobs", "[0, 20]"]),
    ({"prompt": "Hi", "logprobs": True}, "logprobs", ["logprobs"]),
    ({"prompt": "Hi", "stream": "yes"}, "stream", ["stream"]),
    ({"prompt": ""}, "prompt", ["empty"]),
    ({"prompt": ["a", "b"]}, "prompt", ["one prompt"]),
    ({"prompt": [1, 2, 10**9]}, "prompt", ["token ids"]),
    ({"max_tokens": 4}, "prompt", ["prompt"]),
    ({"prompt": "Hi", "max_tokens": 5000}, "max_tokens", ["room"]),
    ({"prompt": "Hi " * 1100, "max_tokens": 4}, "prompt", ["tokens", "limit"]),
    ({"prompt": "Hi", "stop": ["x"] * 17}, "stop", ["17 entries", "at most 16"]),
    ({"prompt": "Hi", "stop": ["x" * 257]}, "stop", ["at most 256 characters", "257"]),
    ({"prompt": "Hi", "stop_token_ids": list(range(17))}, "stop_token_ids", ["at most 16"]),
    ({"prompt": "Hi", "logit_bias": {str(i): 1 for i in range(301)}}, "logit_bias", ["301 entries", "at most 300"]),
    ({"prompt": "Hi", "allowed_token_ids": list(range(5000))}, "allowed_token_ids", ["at most 4096"]),
    ({"prompt": "Hi", "logit_bias": {"7": 1e300}, "allowed_token_ids": [5]}, "logit_bias", ["[-100, 100]"]),
    ({"prompt": "Hi", "logit_bias": {"x": 1}}, "logit_bias", ["strings of digits"]),
    ({"prompt": "Hi", "min_tokens": 5, "max_tokens": 4}, "min_tokens", ["min_tokens", "max_tokens=4"]),
])
def test_bad_completion_requests_get_openai_errors_naming_the_field(tiny_server, body, param, words):
    server, _ = tiny_server
    error = assert_error(post(server, "/v1/completions", json.dumps(body).encode()), 400, param, *words)
    assert error["type"] == "invalid_request_error"


@pytest.mark.parametrize(("body", "param", "words"), [
    ({"messages": []}, "messages", ["messages"]),
    ({"messages": "hi"}, "messages", ["messages"]),
    ({"messages": [{"role": "robot", "content": "hi"}]}, "messages[0].role", ["robot"]),
    ({"messages": [{"role": "user", "content": 3}]}, "messages[0].content", ["string"]),
    ({"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]},
     "messages[0].content[0]", ["text parts"]),
    ({"messages": CHAT, "tools": [{"type": "function"}]}, "tools", ["tool"]),
    ({"messages": CHAT, "prompt": "x"}, "prompt", ["Unrecognized"]),
    ({"messages": CHAT, "max_tokens": 3, "max_completion_tokens": 3}, "max_completion_tokens", ["not both"]),
    ({"messages": CHAT, "stream_options": {"include_usage": True}}, "stream_options", ["stream"]),
    ({"messages": CHAT, "n": -1}, "n", ["n must be"]),
    ({"messages": CHAT, "n": 100}, "n", ["n=100", "max_num_seqs"]),
    ({"messages": CHAT, "top_logprobs": 2}, "top_logprobs", ["needs logprobs"]),
    ({"messages": CHAT, "logprobs": True, "top_logprobs": 21}, "top_logprobs", ["top_logprobs", "[0, 20]"]),
    ({"messages": CHAT, "logprobs": True, "top_logprobs": -1}, "top_logprobs", ["top_logprobs"]),
    ({"messages": CHAT, "logprobs": 3}, "logprobs", ["true or false"]),
])
def test_bad_chat_requests_get_openai_errors_naming_the_field(tiny_server, body, param, words):
    server, _ = tiny_server
    assert_error(post(server, "/v1/chat/completions", json.dumps(body).encode()), 400, param, *words)


def test_malformed_bodies_wrong_models_and_the_openai_clients_view_of_errors(tiny_server):
    server, llm = tiny_server
    assert_error(post(server, "/v1/completions", b'{"prompt": "Hi", '), 400, None, "not valid JSON")
    assert_error(post(server, "/v1/completions", b"\xff\xfe"), 400, None, "not valid JSON")
    assert_error(post(server, "/v1/completions", b'["Hi"]'), 400, None, "JSON object")
    error = assert_error(post(server, "/v1/completions", b'{"model": "gpt-4", "prompt": "Hi"}'), 404, "model")
    assert error["code"] == "model_not_found"
    assert_error(post(server, "/v1/embeddings", b"{}"), 404, None, "/v1/embeddings", "Not Found")
    assert_error(httpx.get(server.url + "/v1/completions", trust_env=False), 405, None, "GET")
    # Content parts of type text are read; "developer" is OpenAI's newer name for "system".
    parts = {"messages": [{"role": "developer", "content": "Be brief."},
                          {"role": "user", "content": [{"type": "text", "text": "What is a KV cache?"}]}],
             "max_tokens": 3, "temperature": 0}
    plain = {"messages": CHAT, "max_tokens": 3, "temperature": 0}
    answers = [post(server, "/v1/chat/completions", json.dumps(b).encode()).json() for b in (parts, plain)]
    assert answers[0]["choices"][0]["message"] == answers[1]["choices"][0]["message"]
    # Fields OpenAI accepts that change nothing (user) are accepted; their "off" values too.
    ok = post(server, "/v1/completions", json.dumps({"prompt": "Hi", "max_tokens": 2, "user": "me", "n": 1,
                                                    "logprobs": None, "best_of": 1}).encode())
    assert ok.status_code == 200 and ok.json()["choices"][0]["finish_reason"] in ("length", "stop")
    with pytest.raises(openai.BadRequestError, match="Unrecognized request argument supplied: colour"):
        client(server).completions.create(model=MODEL_NAME, prompt="Hi", extra_body={"colour": "red"})
    with pytest.raises(openai.NotFoundError):
        client(server).chat.completions.create(model="gpt-4", messages=CHAT)
    assert_engine_idle(llm)


def test_huge_bodies_and_prompts_are_refused_before_they_are_read(tiny_server):
    server, llm = tiny_server
    limit = Limits().max_body_bytes
    # A Content-Length over the limit is refused from the headers alone: the body is never sent.
    host, port = server.url.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port)), timeout=10) as sock:
        sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: %s\r\nContent-Type: application/json\r\n"
                     b"Content-Length: %d\r\n\r\n" % (host.encode(), 50 * limit))
        reply = b""
        while b"}}" not in reply and (piece := sock.recv(65536)):
            reply += piece
        reply = reply.decode()
    assert reply.startswith("HTTP/1.1 413") and "request_too_large" in reply
    # A chunked body (no Content-Length) is cut off once it passes the limit.
    def chunks():
        yield b'{"prompt": "'
        for _ in range(40):
            yield b"x" * (limit // 8)
        yield b'"}'
    response = httpx.post(server.url + "/v1/completions", content=chunks(), trust_env=False, timeout=60)
    assert_error(response, 413, None, "larger than", str(limit))
    # A prompt within the body limit but whose size alone proves it too long is refused untokenized.
    response = post(server, "/v1/completions", json.dumps({"prompt": "x" * (limit - 100)}).encode())
    error = assert_error(response, 400, "prompt", "prompt is longer than")  # no token count: never tokenized
    assert error["code"] == "context_length_exceeded"
    assert httpx.get(server.url + "/health", trust_env=False).json() == {"status": "ok"}
    assert_engine_idle(llm)


def read_events(sock: socket.socket, count: int) -> bytes:
    data = b""
    while data.count(b"data: ") < count:
        piece = sock.recv(4096)
        assert piece, "the server closed the stream early"
        data += piece
    return data


def request_bytes(server, path: str, body: dict) -> bytes:
    payload = json.dumps(body).encode()
    return (f"POST {path} HTTP/1.1\r\nHost: {server.url[7:]}\r\nContent-Type: application/json\r\n"
            f"Content-Length: {len(payload)}\r\n\r\n").encode() + payload


@pytest.mark.parametrize("n", [1, 3])
@pytest.mark.parametrize("stream", [True, False])
def test_a_client_that_disconnects_has_its_request_aborted_and_its_blocks_freed(tiny_server, stream, n):
    server, llm = tiny_server
    before = metrics(server).get('labkit_requests_total{finished_reason="abort"}', 0)
    body = {"prompt": "Tell me a long story", "max_tokens": 900, "ignore_eos": True, "stream": stream, "n": n,
            "logprobs": 2 if n > 1 else None}  # every sample's blocks, shared (copy-on-write) or not
    host, port = server.url[7:].split(":")
    with socket.create_connection((host, int(port)), timeout=10) as sock:
        sock.sendall(request_bytes(server, "/v1/completions", body))
        if stream:
            read_events(sock, 3)  # it is generating
        else:
            wait_until(lambda: llm.block_manager.num_used_blocks > 0, what="the request to start")
    # The socket is closed: the next steps abort the request and free its blocks long before 900 tokens.
    assert_engine_idle(llm)
    assert metrics(server)['labkit_requests_total{finished_reason="abort"}'] == before + 1
    assert post(server, "/v1/completions", b'{"prompt": "Hi", "max_tokens": 2}').status_code == 200


def test_a_full_queue_gets_503_with_a_reason_and_static_batching_waits_for_the_batch_to_drain():
    llm = tiny_llm(max_num_seqs=1)
    with no_leaked_threads(), serve(llm, batching="static", limits=Limits(max_waiting=1)) as server:
        host, port = server.url[7:].split(":")
        long = {"prompt": "Hi", "max_tokens": 1000, "ignore_eos": True, "stream": True}
        with socket.create_connection((host, int(port)), timeout=10) as first, \
                socket.create_connection((host, int(port)), timeout=10) as second:
            first.sendall(request_bytes(server, "/v1/completions", long))
            read_events(first, 2)  # running: the batch of one is full
            second.sendall(request_bytes(server, "/v1/completions", long))
            wait_until(lambda: server.app.state.engine.num_waiting == 1, what="the second request to queue")
            busy = post(server, "/v1/completions", b'{"prompt": "Hi", "max_tokens": 2}')
            error = assert_error(busy, 503, None, "busy", "waiting")
            assert error["code"] == "queue_full" and busy.headers["retry-after"] == "1"
            # Static batching: the waiting request stays queued while the running batch generates.
            assert llm.scheduler.waiting == [] and len(llm.scheduler.running) == 1
        assert_engine_idle(llm)


@pytest.mark.parametrize("batching", ["continuous", "static"])
def test_static_batching_starts_nothing_new_until_the_batch_has_finished(batching):
    """Two slots. A long request is running when a short one arrives, and another short one just after.
    Continuous batching starts both while the long one runs; static waits until its batch has drained."""
    llm = tiny_llm(max_num_seqs=2)
    with no_leaked_threads(), serve(llm, batching=batching) as server:
        async def run():
            async with httpx.AsyncClient(base_url=server.url, trust_env=False, timeout=60) as http:
                running = asyncio.Event()

                async def send(max_tokens, after=None, delay=0.0):
                    if after is not None:
                        await after.wait()
                    await asyncio.sleep(delay)
                    body = {"prompt": "Hi", "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True,
                            "stream": True}
                    async with http.stream("POST", "/v1/completions", json=body) as response:
                        async for line in response.aiter_lines():
                            if line.startswith("data: {"):
                                running.set()
                await asyncio.gather(send(400), send(4, running), send(4, running, 0.1))
        asyncio.run(run())
    # The engine's own clock: two streams' lines reach the client in no fixed order across connections.
    [long] = [m for m in llm.metrics.finished if m.num_output_tokens == 400]
    shorts = [m for m in llm.metrics.finished if m.num_output_tokens == 4]
    assert [m.first_scheduled_time > long.finish_time for m in shorts] == [batching == "static"] * 2, (
        long, shorts)
    assert_engine_idle(llm)


def test_two_hundred_concurrent_requests_with_random_disconnects_leave_no_block_held():
    """A bounded storm: 200 requests, 32 at a time, a quarter of them abandoned at a random moment,
    on a cache small enough that requests get preempted. Afterwards every block is free and the
    server still answers."""
    llm = tiny_llm(num_kvcache_blocks=24, max_num_seqs=16, max_model_len=256)
    rng = random.Random(0)
    plan = [(rng.randint(4, 40), rng.random() < 0.25, rng.uniform(0.0, 0.3), rng.random() < 0.5) for _ in range(200)]
    with no_leaked_threads(), serve(llm) as server:
        async def one(http, gate, max_tokens, leave, after, stream):
            async with gate:
                body = {"prompt": f"Request with {max_tokens} tokens", "max_tokens": max_tokens,
                        "temperature": 0, "ignore_eos": True, "stream": stream}
                request = http.post("/v1/completions", json=body)
                if leave:  # the client goes away mid-request: its connection closes
                    try:
                        await asyncio.wait_for(request, after)
                    except asyncio.TimeoutError:
                        return "left"
                    return "done"
                response = await request
                assert response.status_code == 200, response.text
                if stream:
                    events = [json.loads(line[6:]) for line in response.text.splitlines()
                              if line.startswith("data: {")]
                    assert events[-1]["choices"][0]["finish_reason"] == "length"
                else:
                    assert response.json()["usage"]["completion_tokens"] == max_tokens
                return "done"

        async def storm():
            gate = asyncio.Semaphore(32)
            async with httpx.AsyncClient(base_url=server.url, trust_env=False, timeout=120,
                                         limits=httpx.Limits(max_connections=64)) as http:
                return await asyncio.wait_for(asyncio.gather(*(one(http, gate, *p) for p in plan)), 240)

        outcomes = asyncio.run(storm())
        assert outcomes.count("left") > 10
        assert_engine_idle(llm)
        seen = metrics(server)
        assert seen["labkit_num_preemptions_total"] > 0  # the small cache was under pressure
        # A client that left was aborted, unless it left before its request reached the engine or after
        # the request had finished; every client that stayed got its whole answer.
        aborted, finished = seen['labkit_requests_total{finished_reason="abort"}'], \
            seen['labkit_requests_total{finished_reason="length"}']
        assert 0 < aborted <= outcomes.count("left") and outcomes.count("done") <= finished <= 200 - aborted
        assert seen["labkit_kv_cache_usage_ratio"] == 0 and seen["labkit_num_requests_waiting"] == 0
        out = client(server).completions.create(model=MODEL_NAME, prompt="Still there?", max_tokens=3)
        assert out.usage.completion_tokens >= 1
    assert_engine_idle(llm)


def test_shutdown_releases_threads_and_the_port_and_ends_open_streams():
    llm = tiny_llm()
    with no_leaked_threads(), serve(llm) as server:
        host, port = server.url[7:].split(":")
        sock = socket.create_connection((host, int(port)), timeout=10)
        sock.sendall(request_bytes(server, "/v1/completions", {"prompt": "Hi", "max_tokens": 1000,
                                                               "ignore_eos": True, "stream": True}))
        read_events(sock, 2)
    sock.close()
    assert not llm.has_unfinished_requests() and llm.block_manager.num_used_blocks == 0
    with pytest.raises(ConnectionRefusedError):
        socket.create_connection((host, int(port)), timeout=5)


@pytest.fixture(scope="module")
def tiny_server():
    llm = tiny_llm()
    with no_leaked_threads(), serve(llm) as server:
        yield server, llm


def test_a_server_process_exits_when_the_process_that_started_it_dies():
    """`ServerProcess` passes --exit-with-parent: a crashed notebook kernel leaves no server behind."""
    child = ("import os, time; from labkit.serve.server import _exit_with_parent; "
             "_exit_with_parent(os.getppid()); print(os.getpid(), flush=True); time.sleep(120)")
    parent = subprocess.Popen([sys.executable, "-c", f"import subprocess, sys, time; "
                               f"subprocess.Popen([sys.executable, '-c', {child!r}]); time.sleep(120)"],
                              stdout=subprocess.PIPE, text=True)
    try:
        orphan = int(parent.stdout.readline())
        parent.kill()
        parent.wait()
        wait_until(lambda: not _alive(orphan), timeout=30, what="the orphaned server to exit")
    finally:
        parent.kill()
        parent.stdout.close()


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    with contextlib.suppress(FileNotFoundError):  # a zombie has exited: only its exit status is left
        with open(f"/proc/{pid}/stat") as stat:
            return stat.read().split(")")[-1].split()[0] != "Z"
    return True


def test_the_labkit_command_names_its_subcommands(capsys):
    with pytest.raises(SystemExit) as exit_:
        labkit_main(["frobnicate"])
    assert exit_.value.code == 2 and "labkit serve" in capsys.readouterr().err
    with pytest.raises(SystemExit) as exit_:
        labkit_main(["serve", "--help"])
    assert exit_.value.code == 0 and "--batching {continuous,static}" in capsys.readouterr().out


# --- failing loudly -----------------------------------------------------------------------------------

def fail_seeds(llm):
    """Make sampling raise (inside the engine's per-request isolation) for a request seeded 666 at once,
    and for one seeded 667 from its fourth token on."""
    sample = llm.runner.sample

    def failing(logits, seqs, eos):
        if any(s.params.seed == 666 or (s.params.seed == 667 and s.num_output_tokens >= 3) for s in seqs):
            raise RuntimeError(f"injected failure for seed {seqs[0].params.seed}")
        return sample(logits, seqs, eos)
    llm.runner.sample = failing


def test_a_request_that_fails_in_the_engine_gets_a_500_in_openai_shape_counted_as_an_error(tiny_server):
    server, llm = tiny_server
    greedy = {"model": MODEL_NAME, "prompt": "The capital of France is", "max_tokens": 8, "temperature": 0}
    before = client(server).completions.create(**greedy).choices[0].text
    fail_seeds(llm)
    try:
        errors = metrics(server).get('labkit_requests_total{finished_reason="error"}', 0)
        c = client(server)
        with pytest.raises(openai.InternalServerError) as raised:
            c.completions.create(model=MODEL_NAME, prompt="Hi", max_tokens=4, seed=666)
        assert "injected failure for seed 666" in raised.value.message
        response = post(server, "/v1/chat/completions", json.dumps({"messages": CHAT, "seed": 666, "n": 2}).encode())
        assert assert_error(response, 500, None, "injected failure")["type"] == "server_error"
        # Streamed, the status is already sent when the engine fails: the stream ends with an error event.
        with pytest.raises(openai.APIError, match="injected failure"):
            list(c.completions.create(model=MODEL_NAME, prompt="Hi", max_tokens=8, seed=667, stream=True,
                                      extra_body={"ignore_eos": True}))
        raw = post(server, "/v1/completions", json.dumps({"prompt": "Hi", "seed": 667, "stream": True,
                                                          "ignore_eos": True}).encode())
        events = [line[6:] for line in raw.text.splitlines() if line.startswith("data: ")]
        assert raw.status_code == 200 and len(events) > 3 and events[-1] == "[DONE]"
        error = json.loads(events[-2])["error"]
        assert error["message"].endswith("injected failure for seed 667") and error["type"] == "server_error"
        assert metrics(server)['labkit_requests_total{finished_reason="error"}'] == errors + 4
        assert c.completions.create(**greedy).choices[0].text == before  # the others are served as before
    finally:
        del llm.runner.sample
    assert_engine_idle(llm)


def break_engine_after(llm, steps: int):
    """Make `step()` raise outside the per-request isolation once `steps` steps have run."""
    step, count = llm.step, [0]

    def failing():
        count[0] += 1
        if count[0] > steps:
            raise RuntimeError("injected engine failure")
        return step()
    llm.step = failing


def test_an_engine_thread_that_dies_ends_every_stream_with_an_error_turns_health_red_and_stops_the_server():
    llm = tiny_llm()
    with no_leaked_threads(), serve(llm, limits=Limits(death_drain_s=3.0)) as server:
        c = client(server)
        assert httpx.get(server.url + "/health", trust_env=False).status_code == 200
        break_engine_after(llm, 5)

        def broken_abort(request_id):  # an engine that failed may fail to abort too: the clients still hear
            raise RuntimeError("abort fails as well")
        llm.abort = broken_abort
        stream = c.completions.create(model=MODEL_NAME, prompt="Hi", max_tokens=500, stream=True,
                                      extra_body={"ignore_eos": True})
        with pytest.raises(openai.APIError, match="engine failed"):
            list(stream)
        health = httpx.get(server.url + "/health", trust_env=False)
        assert health.status_code == 503 and "engine" in health.json()["status"]
        assert_error(post(server, "/v1/completions", b'{"prompt": "Hi"}'), 503, None, "not running")
        server.thread.join(timeout=30)  # after the drain the server stops by itself
        assert server.engine_died and not server.thread.is_alive()


def test_labkit_serve_exits_with_a_non_zero_status_when_its_engine_dies(tmp_path):
    script = tmp_path / "serve_dying.py"
    script.write_text(
        f"import sys; sys.path.insert(0, {os.path.dirname(__file__)!r})\n"
        "from serve_support import MODEL_NAME, tiny_llm\n"
        "from labkit.serve.app import create_app\n"
        "from labkit.serve.protocol import Limits\n"
        "from labkit.serve.server import bind, run\n"
        "llm = tiny_llm()\n"
        "def broken(): raise RuntimeError('injected engine failure')\n"
        "llm.step = broken\n"
        "sys.exit(run(create_app(llm, MODEL_NAME, limits=Limits(death_drain_s=0.5)), bind()))\n")
    child = subprocess.Popen([sys.executable, str(script)], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        url = child.stdout.readline().split("listening on ")[1].strip()
        response = httpx.post(url + "/v1/completions", json={"prompt": "Hi", "max_tokens": 4}, trust_env=False,
                              timeout=30)
        assert response.status_code == 503 and "injected engine failure" in response.json()["error"]["message"]
        assert child.wait(timeout=30) == 1
        assert "injected engine failure" in child.stderr.read()  # the traceback is logged
    finally:
        child.kill()
        child.wait()
        child.stdout.close()
        child.stderr.close()


# --- every input answered in OpenAI's error JSON ---------------------------------------------------------

HOSTILE_BODIES = {
    "lone surrogate in a prompt": b'{"prompt": "abc\\ud800def", "max_tokens": 2}',
    "lone surrogate in chat content": b'{"messages": [{"role": "user", "content": "abc\\udfffdef"}]}',
    "lone surrogate in a content part": b'{"messages": [{"role": "user", "content": '
                                        b'[{"type": "text", "text": "\\ud83d"}]}]}',
    "nesting 100k levels deep": b'{"prompt": ' + b"[" * 100_000 + b"]" * 100_000 + b"}",
    "a 4,301-digit max_tokens": b'{"prompt": "Hi", "max_tokens": 1' + b"0" * 4300 + b"}",
}


@pytest.mark.parametrize("case", sorted(HOSTILE_BODIES))
@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
def test_hostile_json_gets_an_openai_error_not_a_plain_500(tiny_server, case, path):
    server, _ = tiny_server
    error = assert_error(post(server, path, HOSTILE_BODIES[case]), 400, None)
    assert error["type"] == "invalid_request_error"
    # (The official client cannot send any of these: its own json.dumps refuses them.)
    assert httpx.get(server.url + "/health", trust_env=False).status_code == 200


# Lone surrogates, often (st.text leaves them out whatever its alphabet holds).
TEXT = st.lists(st.characters(categories=["Cs"]) | st.characters(), max_size=12).map("".join)
JSON_VALUES = st.recursive(
    st.none() | st.booleans() | st.integers() | st.integers(min_value=-(10**30), max_value=10**30)
    | st.floats() | TEXT,
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(TEXT, inner, max_size=4), max_leaves=12)
FIELDS = sorted(set(protocol.SAMPLING_FIELDS) | protocol.COMPLETION_FIELDS | protocol.CHAT_FIELDS
                | set(protocol.UNSUPPORTED) | protocol.IGNORED)
# Three times in four a field's value is one the server takes, else any JSON at all, so requests get
# past their fields and reach tokenization and the engine.
VALID = {"max_tokens": st.integers(1, 4), "max_completion_tokens": st.integers(1, 4), "temperature": st.floats(0, 2),
         "top_p": st.floats(0.01, 1), "top_k": st.integers(-1, 60), "min_p": st.floats(0, 1), "seed": st.integers(),
         "stop": st.lists(TEXT, max_size=3), "stop_token_ids": st.lists(st.integers(0, 49_151), max_size=3),
         "n": st.integers(1, 3), "logprobs": st.integers(0, 3) | st.booleans(), "top_logprobs": st.integers(0, 3),
         "prompt_logprobs": st.integers(0, 2), "min_tokens": st.integers(0, 2), "ignore_eos": st.booleans(),
         "stream": st.booleans(), "echo": st.booleans(), "stream_options": st.just({"include_usage": True}),
         "logit_bias": st.dictionaries(st.integers(0, 49_151).map(str), st.floats(-100, 100), max_size=3),
         "allowed_token_ids": st.lists(st.integers(0, 49_151), min_size=1, max_size=3), "user": TEXT,
         "model": st.just(MODEL_NAME)}


def mostly_valid(name: str):
    return st.integers(0, 3).flatmap(lambda k: VALID.get(name, JSON_VALUES) if k else JSON_VALUES)


BODIES = st.lists(st.sampled_from(FIELDS), max_size=4, unique=True).flatmap(
    lambda names: st.fixed_dictionaries({name: mostly_valid(name) for name in names}))
MESSAGES = st.lists(st.fixed_dictionaries({"role": st.sampled_from(protocol.CHAT_ROLES) | JSON_VALUES,
                                           "content": TEXT | JSON_VALUES}), max_size=3) | JSON_VALUES


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(body=BODIES, prompt=TEXT | TEXT | st.lists(st.integers(-5, 50_000), max_size=5) | JSON_VALUES, messages=MESSAGES,
       chat=st.booleans())
def test_fuzzed_requests_are_answered_or_refused_in_openai_shape_never_a_server_error(tiny_server, body, prompt,
                                                                                      messages, chat):
    """Any body over the request schemas' fields (each value any JSON, surrogates and NaN included)
    gets a 200 or a 4xx in OpenAI's error shape: never a 500, and the engine is left idle."""
    server, llm = tiny_server
    body = {**body, ("messages" if chat else "prompt"): messages if chat else prompt}
    body.setdefault("max_tokens", 3)  # a valid request stays quick
    data = json.dumps(body, allow_nan=True).encode()  # surrogates go out as \ud800 escapes
    response = post(server, "/v1/chat/completions" if chat else "/v1/completions", data)
    if response.status_code == 200:
        if response.headers["content-type"].startswith("text/event-stream"):
            assert response.text.rstrip().endswith("data: [DONE]") and '"error"' not in response.text
        else:
            assert response.json()["choices"]
    else:
        assert 400 <= response.status_code < 500, response.text
        assert set(response.json()["error"]) == {"message", "type", "param", "code"}
    assert_engine_idle(llm)


# --- bounded by construction ----------------------------------------------------------------------------------

def test_a_request_the_engine_could_never_sample_is_refused_with_a_400(tiny_server):
    server, llm = tiny_server
    body = {"prompt": "Hi", "allowed_token_ids": [llm.eos_token_id], "min_tokens": 2, "max_tokens": 4}
    assert_error(post(server, "/v1/completions", json.dumps(body).encode()), 400, None, "min_tokens=2 masks")
    with pytest.raises(openai.BadRequestError, match="no token could be sampled"):
        client(server).completions.create(model=MODEL_NAME, prompt="Hi", max_tokens=4,
                                          extra_body={"allowed_token_ids": [llm.eos_token_id], "min_tokens": 2})
    with pytest.raises(openai.BadRequestError, match="at most 16"):
        client(server).completions.create(model=MODEL_NAME, prompt="Hi", max_tokens=4, stop=["a"] * 100)
    assert_engine_idle(llm)


def test_a_kv_cache_smaller_than_max_model_len_is_the_context_the_server_serves():
    """With a fixed num_kvcache_blocks below max_model_len, a request without max_tokens is filled to
    what the cache holds (not refused for a context no sequence could reach), and /v1/models says so."""
    llm = tiny_llm(num_kvcache_blocks=4, max_model_len=1024)  # 4 blocks x 16 = 64 tokens
    with no_leaked_threads(), serve(llm) as server:
        models = httpx.get(server.url + "/v1/models", trust_env=False).json()
        assert models["data"][0]["max_model_len"] == 64
        answer = client(server).completions.create(model=MODEL_NAME, prompt="The capital of France is",
                                                   extra_body={"ignore_eos": True})
        assert answer.choices[0].finish_reason == "length"
        assert answer.usage.prompt_tokens + answer.usage.completion_tokens == 64
        with pytest.raises(openai.BadRequestError, match="context of 64"):
            client(server).completions.create(model=MODEL_NAME, prompt="Hi", max_tokens=100)
        assert_engine_idle(llm)


def test_streams_whose_clients_left_while_queued_are_aborted_before_their_prefill():
    """One seat, taken by a long request: five streams queue behind it and their clients hang up. They
    leave the queue at once, while the long request still runs, so none of them is ever prefilled."""
    llm = tiny_llm(max_num_seqs=1)
    with no_leaked_threads(), serve(llm) as server:
        engine = server.app.state.engine
        host, port = server.url[7:].split(":")
        long = {"prompt": "Hi", "max_tokens": 1000, "ignore_eos": True, "stream": True}
        with socket.create_connection((host, int(port)), timeout=10) as first:
            first.sendall(request_bytes(server, "/v1/completions", long))
            read_events(first, 2)
            (running,) = llm.scheduler.running
            queued = [socket.create_connection((host, int(port)), timeout=10) for _ in range(5)]
            for i, sock in enumerate(queued):
                sock.sendall(request_bytes(server, "/v1/completions", {**long, "prompt": f"Queued {i}"}))
            wait_until(lambda: engine.num_waiting == 5, what="five requests to queue")
            for sock in queued:
                sock.close()
            wait_until(lambda: engine.num_waiting == 0, timeout=10, what="the queued requests to be aborted")
            assert llm.scheduler.running == [running] and not running.is_finished  # the long one still runs
        assert_engine_idle(llm)
        assert metrics(server)['labkit_requests_total{finished_reason="abort"}'] == 6


def closed_within(sock: socket.socket, seconds: float) -> bool:
    """Whether the server closes `sock` within `seconds` (reading whatever it sends meanwhile)."""
    sock.settimeout(seconds)
    try:
        while sock.recv(4096):
            pass
    except TimeoutError:
        return False
    except ConnectionResetError:
        pass
    return True


def test_slow_and_silent_connections_are_closed_and_the_connection_count_is_bounded():
    """Bounded loops on 127.0.0.1 with one-second limits: connections that send half their headers, half
    their body, or nothing, and a keep-alive connection left idle, are all closed; past the connection
    limit a request gets 503; and the server still answers afterwards."""
    llm = tiny_llm()
    limits = Limits(read_timeout_s=1.0, keep_alive_s=1.0, max_connections=8)
    with no_leaked_threads(), serve(llm, limits=limits) as server:
        host, port = server.url[7:].split(":")
        request = request_bytes(server, "/v1/completions", {"prompt": "Hi", "max_tokens": 2})
        head, body = request.split(b"\r\n\r\n")
        partial = {"silent": b"", "partial headers": head[:30], "partial body": head + b"\r\n\r\n" + body[:5]}
        for kind, start in partial.items():
            socks = [socket.create_connection((host, int(port)), timeout=5) for _ in range(3)]
            for sock in socks:
                sock.sendall(start)
            assert all(closed_within(sock, 5) for sock in socks), f"{kind} connections were left open"
            for sock in socks:
                sock.close()
        # A request trickled in a byte at a time is cut off at the deadline too.
        with socket.create_connection((host, int(port)), timeout=5) as sock:
            deadline, cut = time.monotonic() + 5, False
            for byte in request:
                try:
                    sock.sendall(bytes([byte]))
                except OSError:
                    cut = True
                    break
                time.sleep(0.02)
                if time.monotonic() > deadline:
                    break
            assert cut or closed_within(sock, 3)
        # An idle keep-alive connection is closed after keep_alive_s.
        with socket.create_connection((host, int(port)), timeout=5) as sock:
            sock.sendall(request)
            assert sock.recv(65536).startswith(b"HTTP/1.1 200")
            assert closed_within(sock, 5)
        # Past max_connections a request gets 503 (uvicorn's limit_concurrency).
        idle = [socket.create_connection((host, int(port)), timeout=5) for _ in range(8)]
        try:
            with socket.create_connection((host, int(port)), timeout=5) as sock:
                sock.sendall(request)
                assert sock.recv(65536).startswith(b"HTTP/1.1 503")
        finally:
            for sock in idle:
                sock.close()
        assert client(server).completions.create(model=MODEL_NAME, prompt="Hi", max_tokens=2).choices
    assert_engine_idle(llm)


# --- access control -------------------------------------------------------------------------------------------

def raw(server, method: str, path: str, body: bytes = b"", **headers) -> httpx.Response:
    return httpx.request(method, server.url + path, content=body or None, headers=headers, trust_env=False,
                         timeout=60)


def test_an_api_key_guards_the_api_and_metrics_but_not_health():
    llm = tiny_llm()
    with no_leaked_threads(), serve(llm, access=Access(api_key="s3cret-key")) as server:
        with pytest.raises(openai.AuthenticationError, match="Incorrect API key"):
            client(server).completions.create(model=MODEL_NAME, prompt="Hi", max_tokens=2)
        keyed = openai.OpenAI(base_url=server.url + "/v1", api_key="s3cret-key", max_retries=0, timeout=60)
        assert keyed.completions.create(model=MODEL_NAME, prompt="Hi", max_tokens=2).choices
        assert [m.id for m in keyed.models.list().data] == [MODEL_NAME]
        for method, path in [("GET", "/metrics"), ("GET", "/v1/models"), ("POST", "/tokenize"),
                             ("POST", "/detokenize"), ("POST", "/v1/chat/completions")]:
            for given in ({}, {"Authorization": "Bearer s3cret-kex"}, {"Authorization": "s3cret-key"}):
                error = assert_error(raw(server, method, path, b'{"prompt": "Hi"}', **given), 401, None, "API key")
                assert error["code"] == "invalid_api_key"
        assert raw(server, "GET", "/metrics", Authorization="Bearer s3cret-key").status_code == 200
        assert raw(server, "GET", "/health").status_code == 200 and raw(server, "GET", "/version").status_code == 200
        # No request that was refused reached the engine.
        assert llm.metrics.num_finished == 1
    assert_engine_idle(llm)


def test_foreign_hosts_and_origins_are_refused_unless_allowed_and_cors_is_off_by_default(tiny_server):
    """A page on another origin may send a simple text/plain POST (no preflight): it is refused before it
    runs. A DNS-rebound page names its own domain in Host: refused too."""
    server, llm = tiny_server
    port = server.url.rsplit(":", 1)[1]
    body = b'{"prompt": "Hi", "max_tokens": 2}'
    steps = llm.metrics.num_steps
    error = assert_error(raw(server, "POST", "/v1/completions", body, **{"Content-Type": "text/plain",
                                                                         "Origin": "http://evil.example"}),
                         403, None, "http://evil.example", "--allowed-origins")
    assert error["code"] == "origin_not_allowed"
    error = assert_error(raw(server, "POST", "/v1/completions", body, Host=f"rebound.example:{port}"), 400, None,
                         "rebound.example", "DNS rebinding")
    assert error["code"] == "host_not_allowed" and llm.metrics.num_steps == steps  # neither ran
    for host in (f"localhost:{port}", f"127.0.0.1:{port}", "localhost"):
        assert raw(server, "POST", "/v1/completions", body, Host=host).status_code == 200
    same = raw(server, "POST", "/v1/completions", body, Origin=server.url)  # a page the server itself served
    assert same.status_code == 200 and "access-control-allow-origin" not in same.headers
    preflight = raw(server, "OPTIONS", "/v1/completions", **{"Origin": "http://app.example",
                                                             "Access-Control-Request-Method": "POST"})
    assert "access-control-allow-origin" not in preflight.headers


def test_allowed_origins_and_hosts_open_cors_and_other_names():
    llm = tiny_llm()
    access = Access(allowed_hosts=("inference.lab",), allowed_origins=("http://app.example",))
    with no_leaked_threads(), serve(llm, access=access) as server:
        preflight = raw(server, "OPTIONS", "/v1/completions", **{
            "Origin": "http://app.example", "Access-Control-Request-Method": "POST",
            "Access-Control-Request-Headers": "authorization, content-type"})
        assert preflight.status_code == 200
        assert preflight.headers["access-control-allow-origin"] == "http://app.example"
        answer = raw(server, "POST", "/v1/completions", b'{"prompt": "Hi", "max_tokens": 2}',
                     **{"Origin": "http://app.example", "Content-Type": "application/json"})
        assert answer.status_code == 200 and answer.headers["access-control-allow-origin"] == "http://app.example"
        assert raw(server, "POST", "/v1/completions", b'{"prompt": "Hi"}', Origin="http://evil.example"
                   ).status_code == 403
        assert raw(server, "GET", "/health", Host="inference.lab:80").status_code == 200
        assert raw(server, "GET", "/health", Host="other.lab").status_code == 400
    assert_engine_idle(llm)


def test_listening_beyond_loopback_without_a_key_warns(capsys, monkeypatch):
    monkeypatch.delenv("LABKIT_API_KEY", raising=False)
    for argv, warned in ([["--host", "0.0.0.0"], True], [["--host", "0.0.0.0", "--api-key", "k"], False],
                         [["--host", "127.0.0.1"], False], [["--host", "::1"], False]):
        with pytest.raises(Exception):  # noqa: B017, PT011 - the model does not exist: it stops right after the check
            labkit_main(["serve", "--model", "/nonexistent/model.gguf", *argv])
        assert ("WARNING: listening on 0.0.0.0" in capsys.readouterr().err) == warned, argv


# --- vLLM's request fields and endpoints ------------------------------------------------------------------------

def test_vllm_sampling_fields_match_the_offline_engine(tiny_server):
    server, llm = tiny_server
    oracle = tiny_llm()
    prompt, c = "The capital of France is", client(server)
    free = oracle.generate(prompt, GREEDY)[0].token_ids
    cases = [
        ({"min_tokens": 8, "max_tokens": 8}, SamplingParams(temperature=0, max_tokens=8, min_tokens=8)),
        ({"allowed_token_ids": free[:2] + [oracle.eos_token_id]},
         SamplingParams(temperature=0, max_tokens=8, allowed_token_ids=free[:2] + [oracle.eos_token_id])),
        ({"stop_token_ids": [free[2]]}, SamplingParams(temperature=0, max_tokens=8, stop_token_ids=[free[2]])),
        ({"logit_bias": {str(free[0]): -100, "42": 7.5}},
         SamplingParams(temperature=0, max_tokens=8, logit_bias={free[0]: -100, 42: 7.5})),
    ]
    for extra, params in cases:
        expected = oracle.generate(prompt, params)[0]
        bias = extra.pop("logit_bias", None)
        out = c.completions.create(model=MODEL_NAME, prompt=prompt, temperature=0, max_tokens=8, logit_bias=bias,
                                   extra_body=extra)
        assert out.choices[0].text == expected.text and out.usage.completion_tokens == len(expected.token_ids)
    # prompt_logprobs: vLLM's shape, per prompt token after the first, {token id: {logprob, rank, decoded_token}}.
    expected = oracle.generate(prompt, SamplingParams(temperature=0, max_tokens=2, prompt_logprobs=2))[0]
    out = c.completions.create(model=MODEL_NAME, prompt=prompt, temperature=0, max_tokens=2,
                               extra_body={"prompt_logprobs": 2})
    got = out.choices[0].prompt_logprobs
    assert got[0] is None and len(got) == len(expected.prompt_token_ids)
    for position, want in zip(got[1:], expected.prompt_logprobs[1:], strict=True):
        assert position == {str(t): {"logprob": e.logprob, "rank": e.rank, "decoded_token": e.decoded_token}
                            for t, e in want.items()}
    chat = c.chat.completions.create(model=MODEL_NAME, messages=CHAT, max_tokens=2, extra_body={"prompt_logprobs": 0})
    assert chat.prompt_logprobs[0] is None and len(chat.prompt_logprobs) == chat.usage.prompt_tokens
    # Usage in a stream (stream_options.include_usage): a last chunk with no choices.
    chunks = list(c.completions.create(model=MODEL_NAME, prompt=prompt, temperature=0, max_tokens=8, stream=True,
                                       stream_options={"include_usage": True}))
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 8
    assert all(chunk.usage is None for chunk in chunks[:-1])
    assert_engine_idle(llm)


def test_tokenize_detokenize_and_version_as_vllm_serves_them(tiny_server):
    server, llm = tiny_server
    prompt = "The capital of France is"
    ids = llm.tokenizer.encode(prompt)
    answer = post(server, "/tokenize", json.dumps({"model": MODEL_NAME, "prompt": prompt}).encode()).json()
    assert answer == {"count": len(ids), "max_model_len": 1024, "tokens": ids, "token_strs": None}
    strs = post(server, "/tokenize", json.dumps({"prompt": prompt, "return_token_strs": True}).encode()).json()
    assert strs["token_strs"] == [llm.tokenizer.id_to_token(i) for i in ids]
    chat = post(server, "/tokenize", json.dumps({"messages": CHAT}).encode()).json()
    usage = client(server).chat.completions.create(model=MODEL_NAME, messages=CHAT, max_tokens=1).usage
    assert chat["count"] == usage.prompt_tokens  # the chat route's own rendering
    assert post(server, "/detokenize", json.dumps({"tokens": ids}).encode()).json() == {"prompt": prompt}
    assert_error(post(server, "/detokenize", b'{"tokens": [-1]}'), 400, "tokens", "token ids")
    assert_error(post(server, "/tokenize", b'{"prompt": "a", "messages": []}'), 400, "prompt", "one of them")
    assert_error(post(server, "/tokenize", b'{"prompt": "a", "max_tokens": 3}'), 400, "max_tokens", "Unrecognized")
    assert_error(post(server, "/tokenize", b'{"prompt": "a\\udc00"}'), 400, None, "surrogate")
    assert httpx.get(server.url + "/version", trust_env=False).json() == {"version": labkit.__version__}


def test_every_request_gets_one_access_log_line(tiny_server, caplog):
    server, _ = tiny_server
    caplog.set_level(logging.INFO, logger="labkit.serve.access")
    c = client(server)
    out = c.completions.create(model=MODEL_NAME, prompt="Hi", max_tokens=3, temperature=0, extra_body={
        "ignore_eos": True})
    list(c.completions.create(model=MODEL_NAME, prompt="Hi", max_tokens=4, stream=True,
                              extra_body={"ignore_eos": True}))
    post(server, "/v1/completions", b'{"prompt": ""}')
    lines = []

    def logged(pattern: str) -> bool:
        lines[:] = [r.getMessage() for r in caplog.records if r.name == "labkit.serve.access"]
        return any(re.search(pattern, line) for line in lines)
    # (Matched by content: a request an earlier test left behind may log its line meanwhile.)
    for pattern in (rf"POST /v1/completions 200 id={out.id} prompt_tokens={out.usage.prompt_tokens} "
                    r"completion_tokens=3 ttft=\d+\.\d+s total=\d+\.\d+s$",
                    r"POST /v1/completions 200 id=cmpl-\w+ prompt_tokens=\d+ completion_tokens=4 ttft=\d+\.\d+s "
                    r"total=\d+\.\d+s$",
                    r"POST /v1/completions 400 id=- prompt_tokens=- completion_tokens=- ttft=- total=\d+\.\d+s$"):
        wait_until(lambda pattern=pattern: logged(pattern), timeout=10, what=f"a log line like {pattern!r} in {lines}")


def test_bytes_that_are_no_http_request_and_oversized_headers_get_openai_errors(tiny_server):
    server, llm = tiny_server
    host, port = server.url[7:].split(":")
    huge = b"GET /health HTTP/1.1\r\nHost: " + host.encode() + b"\r\nX-Pad: " + b"a" * (20 * 1024) + b"\r\n\r\n"
    for sent in (b"NOT HTTP AT ALL\r\n\r\n", huge):
        with socket.create_connection((host, int(port)), timeout=10) as sock:
            sock.sendall(sent[:-4])  # h11 measures headers while they are incomplete
            time.sleep(0.2)
            with contextlib.suppress(OSError):  # it may have answered and closed already
                sock.sendall(sent[-4:])
            reply = b""
            while piece := sock.recv(65536):
                reply += piece
        head, body = reply.split(b"\r\n\r\n", 1)
        assert head.startswith(b"HTTP/1.1 400") and b"application/json" in head
        assert json.loads(body)["error"]["code"] == "invalid_http"
    assert httpx.get(server.url + "/health", trust_env=False).status_code == 200
