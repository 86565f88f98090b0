"""Lab 16 graders: the solutions pass, a stub is "not implemented", each typical mistake is named."""

import json
import math

import numpy as np
import pytest

from labkit_course.grading.core import get_exercise, run_exercise


def grade(name, fn):
    return run_exercise(get_exercise("16", name), {name: fn})


def stub(*args):
    raise NotImplementedError()


# --- the solutions, as a student would write them --------------------------------------------
def chat_request(messages, max_tokens, temperature, stream, top_k=None):
    body = {"model": "smollm2", "messages": messages, "max_tokens": max_tokens, "temperature": temperature,
            "stream": stream}
    if stream:
        body["stream_options"] = {"include_usage": True}
    if top_k is not None:
        body["top_k"] = top_k
    return body


def sse_text(body):
    text = []
    for line in body.splitlines():
        if not line.startswith("data:"):
            continue
        data = line[5:].strip()
        if data == "[DONE]":
            break
        for choice in json.loads(data)["choices"]:
            text.append(choice["delta"].get("content") or "")
    return "".join(text)


def ttft_tpot(sent, token_times):
    if not token_times:
        return None, None
    ttft = token_times[0] - sent
    if len(token_times) < 2:
        return ttft, None
    return ttft, (token_times[-1] - token_times[0]) / (len(token_times) - 1)


def percentile(values, q):
    s = sorted(values)
    rank = (len(s) - 1) * q / 100
    lo = math.floor(rank)
    hi = min(lo + 1, len(s) - 1)
    return s[lo] + (s[hi] - s[lo]) * (rank - lo)


def poisson_arrivals(rate, num_requests, rng):
    return np.cumsum(rng.exponential(1 / rate, num_requests))


def poisson_by_inversion(rate, num_requests, rng):  # a different, equally right recipe
    return np.cumsum(-np.log(1 - rng.random(num_requests)) / rate)


def saturation_rate(rows, factor=3.0):
    rows = sorted(rows)
    for rate, latency in rows:
        if latency > factor * rows[0][1]:
            return rate
    return None


SOLUTIONS = {chat_request, sse_text, ttft_tpot, percentile, poisson_arrivals, poisson_by_inversion, saturation_rate}


# --- wrong answers ---------------------------------------------------------------------------
def chat_extra_body(messages, max_tokens, temperature, stream, top_k=None):
    body = chat_request(messages, max_tokens, temperature, stream)
    if top_k is not None:
        body["extra_body"] = {"top_k": top_k}
    return body


def chat_no_usage(messages, max_tokens, temperature, stream, top_k=None):
    body = chat_request(messages, max_tokens, temperature, stream, top_k)
    body.pop("stream_options", None)
    return body


def chat_usage_always(messages, max_tokens, temperature, stream, top_k=None):
    return {**chat_request(messages, max_tokens, temperature, stream, top_k),
            "stream_options": {"include_usage": True}}


def chat_prompt_field(messages, max_tokens, temperature, stream, top_k=None):
    body = chat_request(messages, max_tokens, temperature, stream, top_k)
    body["prompt"] = body.pop("messages")
    return body


def chat_no_model(messages, max_tokens, temperature, stream, top_k=None):
    body = chat_request(messages, max_tokens, temperature, stream, top_k)
    del body["model"]
    return body


def sse_no_done(body):
    return "".join(choice["delta"].get("content") or "" for line in body.splitlines() if line.startswith("data:")
                   for choice in json.loads(line[5:])["choices"])


def sse_first_choice(body):
    text = ""
    for line in body.splitlines():
        if line.startswith("data: ") and line != "data: [DONE]":
            text += json.loads(line[6:])["choices"][0]["delta"].get("content", "")
    return text


def sse_needs_space(body):
    text = ""
    for line in body.splitlines():
        if line.startswith("data: ") and line != "data: [DONE]":
            for choice in json.loads(line[6:])["choices"]:
                text += choice["delta"].get("content") or ""
    return text


def sse_every_line(body):
    text = ""
    for line in body.splitlines():
        if line and line[5:].strip() != "[DONE]":
            for choice in json.loads(line[5:])["choices"]:
                text += choice["delta"].get("content") or ""
    return text


def tpot_over_n(sent, times):
    ttft, _ = ttft_tpot(sent, times)
    return ttft, (times[-1] - times[0]) / len(times) if len(times) > 1 else None


def tpot_from_sent(sent, times):
    ttft, _ = ttft_tpot(sent, times)
    return ttft, (times[-1] - sent) / len(times) if len(times) > 1 else None


def tpot_zero_for_one(sent, times):
    ttft, tpot = ttft_tpot(sent, times)
    return ttft, 0.0 if tpot is None and times else tpot


def nearest_rank(values, q):
    s = sorted(values)
    return s[max(0, math.ceil(q / 100 * len(s)) - 1)]


def unsorted_percentile(values, q):
    rank = (len(values) - 1) * q / 100
    lo = math.floor(rank)
    hi = min(lo + 1, len(values) - 1)
    return values[lo] + (values[hi] - values[lo]) * (rank - lo)


def percentile_by_n(values, q):
    s = sorted(values)
    rank = min(len(s) * q / 100, len(s) - 1)
    lo = math.floor(rank)
    hi = min(lo + 1, len(s) - 1)
    return s[lo] + (s[hi] - s[lo]) * (rank - lo)


def percentile_lower(values, q):
    s = sorted(values)
    return s[math.floor((len(s) - 1) * q / 100)]


def percentile_rounded_rank(values, q):
    s = sorted(values)
    return s[round((len(s) - 1) * q / 100)]


def percentile_swapped_weights(values, q):
    s = sorted(values)
    rank = (len(s) - 1) * q / 100
    lo = math.floor(rank)
    hi = min(lo + 1, len(s) - 1)
    return s[lo] * (rank - lo) + s[hi] * (1 - (rank - lo))


def sse_stripped(body):
    return "".join(piece.strip() for piece in _sse_pieces(body))


def _sse_pieces(body):
    for line in body.splitlines():
        if line.startswith("data:") and line[5:].strip() != "[DONE]":
            for choice in json.loads(line[5:])["choices"]:
                yield choice["delta"].get("content") or ""


def ttft_clock_time(sent, times):
    _, tpot = ttft_tpot(sent, times)
    return (times[0] if times else None), tpot


def saturation_last_rate_when_none(rows, factor=3.0):
    return saturation_rate(rows, factor) or max(rows)[0]


def saturation_latency(rows, factor=3.0):
    rows = sorted(rows)
    return next((lat for _, lat in rows if lat > factor * rows[0][1]), None)


def poisson_scale_is_rate(rate, n, rng):
    return np.cumsum(rng.exponential(rate, n))


def poisson_gaps_only(rate, n, rng):
    return rng.exponential(1 / rate, n)


def evenly_spaced(rate, n, rng):
    return np.arange(1, n + 1) / rate


def uniform_gaps(rate, n, rng):
    return np.cumsum(rng.uniform(0, 2 / rate, n))


def lognormal_gaps(rate, n, rng):  # mean 1 / rate and std = mean, like an exponential, but another shape
    return np.cumsum(rng.lognormal(np.log(1 / rate) - 0.5 * np.log(2), np.sqrt(np.log(2)), n))


def fresh_rng(rate, n, rng):
    return np.cumsum(np.random.default_rng().exponential(1 / rate, n))


def saturation_unsorted(rows, factor=3.0):
    return next((r for r, lat in rows if lat > factor * rows[0][1]), None)


def saturation_min_baseline(rows, factor=3.0):
    base = min(t for _, t in rows)
    return next((r for r, lat in sorted(rows) if lat > factor * base), None)


def saturation_factor_three(rows, factor=3.0):
    return saturation_rate(rows, 3.0)


def percentile_sorts_in_place(values, q):
    values.sort()
    return percentile(values, q)


def percentile_float32(values, q):
    return float(np.float32(percentile(values, q)))


def saturation_ge(rows, factor=3.0):
    rows = sorted(rows)
    return next((r for r, lat in rows if lat >= factor * rows[0][1]), None)


def saturation_last_good(rows, factor=3.0):
    rows = sorted(rows)
    return next((a[0] for a, b in zip(rows, rows[1:], strict=False) if b[1] > factor * rows[0][1]), None)


def saturation_previous_row(rows, factor=3.0):
    rows = sorted(rows)
    return next((b[0] for a, b in zip(rows, rows[1:], strict=False) if b[1] > factor * a[1]), None)


@pytest.mark.parametrize("name, fn, message", [
    ("chat_request", chat_request, "the request you meant"),
    ("chat_request", stub, "not implemented yet"),
    ("chat_request", chat_extra_body, "extra_body is the openai client's argument"),
    ("chat_request", chat_no_usage, "include_usage"),
    ("chat_request", chat_usage_always, "stream_options is only allowed when stream is true"),
    ("chat_request", chat_prompt_field, "Unrecognized request argument supplied: prompt"),
    ("chat_request", chat_no_model, "name the served model"),
    ("chat_request", lambda *a: json.dumps(chat_request(*a)), "as a dict"),
    ("sse_text", sse_text, "skips role, finish, usage"),
    ("sse_text", stub, "not implemented yet"),
    ("sse_text", sse_no_done, "[DONE]"),
    ("sse_text", sse_first_choice, "a usage chunk has no choices"),
    ("sse_text", sse_needs_space, "without a space"),
    ("sse_text", sse_every_line, "comment lines"),
    ("sse_text", sse_stripped, "keep each delta's content exactly as sent"),
    ("ttft_tpot", ttft_tpot, "the mean gap after it"),
    ("ttft_tpot", stub, "not implemented yet"),
    ("ttft_tpot", tpot_over_n, "divides by n - 1"),
    ("ttft_tpot", tpot_from_sent, "is not part of it"),
    ("ttft_tpot", tpot_zero_for_one, "its TPOT is None"),
    ("ttft_tpot", ttft_clock_time, "measured from the moment the request was sent"),
    ("ttft_tpot", lambda s, t: [t[0] - s, None] if t else (None, None), "return a pair"),
    ("percentile", percentile, "as numpy's percentile does"),
    ("percentile", stub, "not implemented yet"),
    ("percentile", nearest_rank, "nearest-rank"),
    ("percentile", unsorted_percentile, "sort the values first"),
    ("percentile", percentile_by_n, "not n * q / 100"),
    ("percentile", percentile_lower, "you took the order statistic below the rank"),
    ("percentile", percentile_rounded_rank, "you rounded the rank"),
    ("percentile", percentile_swapped_weights, "the weights are swapped"),
    ("percentile", percentile_sorts_in_place, "reordered the caller's list"),
    ("percentile", percentile_float32, "float32's precision"),
    ("percentile", lambda v, q: float(__import__("torch").quantile(__import__("torch").tensor(v, dtype=__import__(
        "torch").float64), q / 100)), "`torch.quantile` is what this exercise asks you to write"),
    ("poisson_arrivals", poisson_arrivals, "exponential gaps"),
    ("poisson_arrivals", poisson_by_inversion, "exponential gaps"),
    ("poisson_arrivals", stub, "not implemented yet"),
    ("poisson_arrivals", poisson_scale_is_rate, "its scale"),
    ("poisson_arrivals", poisson_gaps_only, "running sum of the gaps"),
    ("poisson_arrivals", evenly_spaced, "standard deviation equals its mean"),
    ("poisson_arrivals", uniform_gaps, "standard deviation equals its mean"),
    ("poisson_arrivals", lognormal_gaps, "not exponential"),
    ("poisson_arrivals", fresh_rng, "same generator seed"),
    ("poisson_arrivals", lambda rate, n, rng: np.concatenate([[0.0], np.cumsum(rng.exponential(1 / rate, n - 1))]),
     "the first request arrived at 0"),
    ("chat_request", lambda *a: {**chat_request(*a), "top_k": a[4]}, "leave top_k out of the body when it is None"),
    ("saturation_rate", saturation_rate, "unloaded latency"),
    ("saturation_rate", stub, "not implemented yet"),
    ("saturation_rate", saturation_unsorted, "not sorted by rate"),
    ("saturation_rate", saturation_ge, "use >"),
    ("saturation_rate", saturation_last_good, "last rate before the knee"),
    ("saturation_rate", saturation_previous_row, "not with the previous row's"),
    ("saturation_rate", saturation_last_rate_when_none, "return None"),
    ("saturation_rate", saturation_latency, "not its latency"),
    ("saturation_rate", saturation_min_baseline, "not the smallest latency in the table"),
    ("saturation_rate", saturation_factor_three, "the factor you are given"),
])
def test_lab16_graders(name, fn, message):
    outcome = grade(name, fn)
    assert message in outcome.message, outcome.message
    assert outcome.passed == (fn in SOLUTIONS)


@pytest.mark.parametrize("fn", sorted(SOLUTIONS, key=lambda fn: fn.__name__), ids=lambda fn: fn.__name__)
def test_lab16_graded_inputs_come_from_the_secret(fn, secret_inputs):
    outcome = grade("poisson_arrivals" if fn is poisson_by_inversion else fn.__name__, fn)
    assert outcome.passed and secret_inputs, outcome.message
