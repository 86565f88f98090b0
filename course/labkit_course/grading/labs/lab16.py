"""Lab 16: serving. An OpenAI request body, an SSE stream read back into text, TTFT/TPOT from
timestamps, percentiles, Poisson arrivals, and the rate at which a server saturates."""

import json
import math

import numpy as np

from labkit.sampling import SamplingParams
from labkit.serve.protocol import RequestError, parse_chat
from labkit_course.grading import ExerciseFailed, exercise, require
from labkit_course.grading.core import case_seed, seeded_random

MODEL = "smollm2"


@exercise("16", "chat_request")
def chat_request(ns):
    fn = require(ns, "chat_request")
    rng = seeded_random(16)
    cases = [([{"role": "user", "content": "Hi"}], 8, 0.0, False, None),
             ([{"role": "user", "content": "Hi"}], 8, 0.7, True, None),
             ([{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Why?"}], 32, 1.0, True, 40),
             ([{"role": "user", "content": "A"}], 1, 0.2, False, 5)]
    cases += [([{"role": "user", "content": f"question {i}"}], rng.randint(1, 64), round(rng.uniform(0, 2), 2),
               rng.random() < 0.5, rng.choice([None, rng.randint(1, 100)])) for i in range(20)]
    for messages, max_tokens, temperature, stream, top_k in cases:
        args = (f"chat_request({messages!r}, max_tokens={max_tokens}, temperature={temperature}, stream={stream}, "
                f"top_k={top_k})")
        body = fn([dict(m) for m in messages], max_tokens, temperature, stream, top_k)
        if not isinstance(body, dict):
            raise ExerciseFailed(f"{args} must return the JSON body as a dict, got {type(body).__name__}")
        try:
            json.dumps(body)
        except (TypeError, ValueError):
            raise ExerciseFailed(f"{args}: the body must be plain JSON (dicts, lists, strings, numbers)") from None
        if top_k is None and "top_k" in body:
            raise ExerciseFailed(f"{args}: leave top_k out of the body when it is None (an OpenAI server that does "
                                 "not know the field rejects it, even as null)")
        if "extra_body" in body:
            raise ExerciseFailed(f"{args}: extra_body is the openai client's argument; on the wire its fields "
                                 "(top_k) are top-level fields of the body")
        try:
            parsed = parse_chat(body, MODEL)
        except RequestError as error:
            raise ExerciseFailed(f"{args}: the server refuses this body: {error.message}") from None
        want = SamplingParams(temperature=temperature, max_tokens=max_tokens, top_k=top_k or 0)
        if body.get("model") != MODEL:
            raise ExerciseFailed(f"{args}: name the served model: \"model\": {MODEL!r}")
        if parsed.params != want:
            raise ExerciseFailed(f"{args}: the server reads {parsed.params}, expected {want}")
        if parsed.messages != messages:
            raise ExerciseFailed(f"{args}: the messages must go in unchanged as \"messages\"")
        if parsed.stream != stream:
            raise ExerciseFailed(f"{args}: \"stream\" must be {str(stream).lower()}")
        if parsed.include_usage != stream:
            raise ExerciseFailed(f"{args}: a streamed request asks for its token counts with "
                                 "\"stream_options\": {\"include_usage\": true}")
    return "the server reads the body you built as the request you meant"


def _chunk(delta: dict | None, finish=None, usage=None) -> dict:
    choices = [] if delta is None else [{"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish}]
    chunk = {"id": "chatcmpl-1", "object": "chat.completion.chunk", "created": 0, "model": MODEL, "choices": choices}
    if usage is not None:
        chunk["usage"] = usage
    return chunk


def make_stream(pieces: list[str], *, comments=False, no_space=False, crlf=False, usage=True) -> str:
    """A chat completion's SSE body as labkit serve (or OpenAI) sends it; options vary the legal spellings."""
    events = [_chunk({"role": "assistant", "content": ""})]
    events += [_chunk({"content": p}) for p in pieces]
    events.append(_chunk({}, finish="stop"))
    if usage:
        events.append(_chunk(None, usage={"prompt_tokens": 3, "completion_tokens": len(pieces),
                                          "total_tokens": 3 + len(pieces)}))
    lines = []
    for i, event in enumerate(events):
        if comments and i % 2:
            lines += [": keep-alive", ""]
        lines += [("data:" if no_space else "data: ") + json.dumps(event), ""]
    lines += ["data: [DONE]", ""]
    newline = "\r\n" if crlf else "\n"
    return newline.join(lines) + newline


@exercise("16", "sse_text", forbidden=("openai.Stream",))
def sse_text(ns):
    fn = require(ns, "sse_text")
    rng = seeded_random(1616)
    words = ["The", " cache", " holds", " keys", " and", " values", ".", " 🙂", " data:", " [DONE]", "\n", " é"]
    cases = [([" Hello", " world"], {}), ([], {}), (["a"], {"usage": False})]
    cases += [([rng.choice(words) for _ in range(rng.randint(0, 12))], {}) for _ in range(10)]
    cases += [([" Hello", ",", " there"], {"comments": True}), ([" Hi", "!"], {"no_space": True}),
              ([" line", "\n", "two"], {"crlf": True})]
    for pieces, options in cases:
        body = make_stream(pieces, **options)
        want = "".join(pieces)
        what = {"comments": "comment lines (': keep-alive')", "no_space": "'data:' without a space after the colon",
                "crlf": "CRLF line endings"}
        shown = " with " + ", ".join(what[k] for k in options if k in what) if any(k in what for k in options) else ""
        try:
            got = fn(body)
        except json.JSONDecodeError as error:
            raise ExerciseFailed(f"a stream{shown} made json.loads fail ({error}); 'data: [DONE]' ends the stream "
                                 "and is not JSON, and comment lines (': ...') carry no data") from None
        except (KeyError, IndexError, TypeError, AttributeError) as error:
            raise ExerciseFailed(f"a stream{shown} raised {type(error).__name__}: {error}. Not every chunk carries "
                                 "text: the first names the role, the last has an empty delta and a finish_reason, "
                                 "and a usage chunk has no choices at all") from None
        if got != want and got == "".join(p.strip() for p in pieces):
            raise ExerciseFailed(f"a stream{shown}: keep each delta's content exactly as sent; the spaces at the "
                                 "start of a piece are the spaces between words (strip the 'data:' line, not the "
                                 "text)")
        if got != want:
            raise ExerciseFailed(f"for the stream{shown}\n{body}\nexpected {want!r}, got {got!r}")
    return "joins the deltas' content and skips role, finish, usage, comment and [DONE] events"


@exercise("16", "ttft_tpot")
def ttft_tpot(ns):
    fn = require(ns, "ttft_tpot")
    rng = seeded_random(160)
    cases = [(10.0, [10.5, 10.6, 10.7, 10.8]), (0.0, [2.0]), (1.0, [1.25, 1.5]), (3.0, [])]
    for _ in range(30):
        sent = rng.uniform(0, 100)
        times = sorted(sent + rng.uniform(0.01, 5) for _ in range(rng.randint(1, 30)))
        cases.append((sent, times))
    for sent, times in cases:
        want = _ttft_tpot(sent, times)
        got = fn(sent, list(times))
        if not isinstance(got, tuple) or len(got) != 2:
            raise ExerciseFailed(f"return a pair (ttft, tpot), got {got!r}")
        if _close(got, want):
            continue
        where = f"sent={sent:.3f}, token_times={[round(t, 3) for t in times]}"
        n = len(times)
        if n and _close(got[0], times[0]) and not _close(want[0], times[0]):
            raise ExerciseFailed(f"{where}: TTFT is a wait, measured from the moment the request was sent: "
                                 "token_times[0] - sent, not the first token's clock time")
        if n >= 2 and _close(got[1], (times[-1] - times[0]) / n):
            raise ExerciseFailed(f"{where}: n tokens have n - 1 gaps between them; TPOT divides by n - 1")
        if n >= 2 and _close(got[1], (times[-1] - sent) / n):
            raise ExerciseFailed(f"{where}: TPOT is the pace after the first token; the wait for the first "
                                 "one (TTFT) is not part of it")
        if n == 1 and got[1] is not None:
            raise ExerciseFailed(f"{where}: one token has no gap after it: its TPOT is None, not {got[1]!r}")
        if n == 0 and got != (None, None):
            raise ExerciseFailed(f"{where}: a request with no tokens has neither a TTFT nor a TPOT: (None, None)")
        raise ExerciseFailed(f"{where}: expected {want}, got {got}")
    return "TTFT is the wait for the first token, TPOT the mean gap after it"


def _ttft_tpot(sent: float, times: list[float]):
    if not times:
        return None, None
    return times[0] - sent, (times[-1] - times[0]) / (len(times) - 1) if len(times) > 1 else None


def _close(a, b) -> bool:
    if isinstance(a, tuple) and isinstance(b, tuple):
        return len(a) == len(b) and all(_close(x, y) for x, y in zip(a, b, strict=True))
    if a is None or b is None:
        return a is b
    return isinstance(a, (int, float)) and math.isclose(a, b, rel_tol=1e-9, abs_tol=1e-12)


@exercise("16", "percentile", forbidden=("numpy.percentile", "numpy.quantile", "numpy.nanpercentile",
                                         "numpy.nanquantile", "statistics.quantiles",
                                         "labkit.serve.loadgen.percentiles", "torch.quantile", "torch.Tensor.quantile",
                                         "torch.nanquantile"))
def percentile(ns):
    fn = require(ns, "percentile")
    rng = seeded_random(99)
    cases = [([1.0, 2.0, 3.0, 4.0], 50), ([3.0, 1.0, 2.0], 50), ([5.0], 99), ([1.0, 2.0], 90), ([10.0, 0.0], 0),
             ([1.0, 2.0, 3.0], 100)]
    cases += [([rng.expovariate(1.0) for _ in range(rng.randint(1, 60))], rng.choice([50, 90, 99, 25, 75]))
              for _ in range(60)]
    results = []
    for values, q in cases:
        given = list(values)
        results.append((values, q, float(np.percentile(values, q)), fn(given, q)))
        if given != values:
            raise ExerciseFailed(f"percentile({[round(v, 3) for v in values]}, {q}) reordered the caller's list "
                                 "(values.sort() sorts in place): sort a copy, sorted(values)")
    wrong = [(values, q, want, got) for values, q, want, got in results if not _same_number(got, want)]
    if not wrong:
        return "linear interpolation between order statistics, as numpy's percentile does by default"
    values, q, want, got = wrong[0]
    where = f"percentile({[round(v, 3) for v in values]}, {q}): expected {want:.6g}, got {got!r}"
    for mistake, why in PERCENTILE_MISTAKES:  # the mistake that explains every wrong answer
        if all(_same_number(got, mistake(list(values), q)) for values, q, _, got in wrong):
            raise ExerciseFailed(f"{where}: {why}")
    if all(isinstance(got, int | float) and math.isclose(got, want, rel_tol=1e-6) for _, _, want, got in wrong):
        raise ExerciseFailed(f"{where}: right to float32's precision only; compute with Python floats (float64)")
    raise ExerciseFailed(f"{where}: sort the values, take rank (n - 1) * q / 100, and interpolate linearly between "
                         "the values at its floor and ceiling")


def _same_number(got, want: float) -> bool:
    return isinstance(got, int | float) and not isinstance(got, bool) and math.isclose(
        got, want, rel_tol=1e-9, abs_tol=1e-12)


def _linear(values, q, *, rank_of=lambda n, q: (n - 1) * q / 100, swapped=False, pick=None):
    """Linear interpolation between order statistics of `values` as given; the keywords re-create mistakes."""
    rank = min(max(rank_of(len(values), q), 0), len(values) - 1)
    lo = math.floor(rank)
    if pick is not None:
        return values[pick(rank)]
    hi = min(lo + 1, len(values) - 1)
    weight = 1 - (rank - lo) if swapped else rank - lo
    return values[lo] + (values[hi] - values[lo]) * weight


PERCENTILE_MISTAKES = [
    (lambda v, q: sorted(v)[min(len(v) - 1, math.ceil(q / 100 * len(v)) - 1 if q else 0)],
     "that is the nearest-rank value; interpolate linearly between the two order statistics around rank "
     "(n - 1) * q / 100"),
    (lambda v, q: _linear(v, q), "sort the values first: percentiles are about ranks"),
    (lambda v, q: _linear(sorted(v), q, rank_of=lambda n, q: n * q / 100),
     "the rank is (n - 1) * q / 100, not n * q / 100: ranks run from 0 (the smallest) to n - 1 (the largest)"),
    (lambda v, q: _linear(sorted(v), q, pick=math.floor),
     "you took the order statistic below the rank; interpolate between it and the one above, weighted by the "
     "rank's fractional part"),
    (lambda v, q: _linear(sorted(v), q, pick=round),
     "you rounded the rank to the nearest order statistic; interpolate between the two around it, weighted by "
     "the rank's fractional part"),
    (lambda v, q: _linear(sorted(v), q, swapped=True),
     "the weights are swapped: the upper value's weight is the rank's fractional part, rank - floor(rank)"),
]


@exercise("16", "poisson_arrivals", forbidden=("labkit.serve.loadgen.poisson_arrivals",))
def poisson_arrivals(ns):
    fn = require(ns, "poisson_arrivals")
    for rate, seed in ((4.0, 0), (0.5, 1), (20.0, 2)):
        n = 20000
        times = fn(rate, n, np.random.default_rng(case_seed(seed)))
        times = np.asarray(times, dtype=float)
        where = f"poisson_arrivals(rate={rate}, num_requests={n})"
        if times.shape != (n,):
            raise ExerciseFailed(f"{where} must return {n} arrival times, got shape {times.shape}")
        gaps = np.diff(np.concatenate([[0.0], times]))
        if times[0] == 0:
            raise ExerciseFailed(f"{where}: the first request arrived at 0; it arrives one exponential gap after the "
                                 "start (the running sum of the gaps, with no 0 prepended)")
        if (gaps < 0).any():
            raise ExerciseFailed(f"{where}: arrival times must not decrease; they are the running sum of the gaps "
                                 "between arrivals (np.cumsum)")
        mean, std = gaps.mean(), gaps.std()
        if not math.isclose(mean, 1 / rate, rel_tol=0.05):
            hint = " (that is the rate, not 1 / rate: numpy's exponential takes the mean gap, its scale)" \
                if math.isclose(mean, rate, rel_tol=0.05) else ""
            raise ExerciseFailed(f"{where}: the mean gap between arrivals must be 1 / rate = {1 / rate:.4g} s, "
                                 f"got {mean:.4g} s{hint}")
        if not math.isclose(std, mean, rel_tol=0.08):
            raise ExerciseFailed(f"{where}: the gaps have mean {mean:.4g} s but standard deviation {std:.4g} s; "
                                 "a Poisson process's gaps are exponential, whose standard deviation equals its mean")
        # Exponential, not just any distribution with std == mean: P(gap > mean) = 1/e.
        if not math.isclose((gaps > 1 / rate).mean(), math.exp(-1), abs_tol=0.02):
            raise ExerciseFailed(f"{where}: the gaps are not exponential: {(gaps > 1 / rate).mean():.3f} of them "
                                 f"exceed the mean, where an exponential has 1/e = {math.exp(-1):.3f}")
    again = [np.asarray(fn(2.0, 50, np.random.default_rng(case_seed(7))), dtype=float) for _ in range(2)]
    if not np.array_equal(*again):
        raise ExerciseFailed("the same generator seed must give the same schedule: draw from the rng you are given")
    return "exponential gaps with mean 1 / rate, summed into arrival times"


def reference_saturation_rate(rows, factor: float = 3.0):
    rows = sorted(rows)
    base = rows[0][1]
    return next((rate for rate, latency in rows if latency > factor * base), None)


SATURATION_MISTAKES = [
    (lambda rows, f: next((r for r, lat in rows if lat > f * rows[0][1]), None),
     "the table is not sorted by rate: sort it first; the baseline is the lowest rate's latency"),
    (lambda rows, f: next((r for r, lat in sorted(rows) if lat >= f * sorted(rows)[0][1]), None),
     "a latency exactly factor times the baseline has not exceeded it yet: use >"),
    (lambda rows, f: next((a[0] for a, b in zip(sorted(rows), sorted(rows)[1:], strict=False)
                           if b[1] > f * sorted(rows)[0][1]), None),
     "that is the last rate before the knee; return the first rate whose latency exceeds the bound"),
    (lambda rows, f: next((b[0] for a, b in zip(sorted(rows), sorted(rows)[1:], strict=False)
                           if b[1] > f * a[1]), None),
     "compare every rate with the lowest rate's latency, not with the previous row's"),
    (lambda rows, f: next((r for r, lat in sorted(rows) if lat > f * min(lat for _, lat in rows)), None),
     "the baseline is the lowest rate's latency, not the smallest latency in the table (a noisy run can be "
     "fastest at a higher rate)"),
]


@exercise("16", "saturation_rate")
def saturation_rate(ns):
    fn = require(ns, "saturation_rate")
    rng = seeded_random(1600)
    cases = [([(1, 0.1), (2, 0.12), (4, 0.2), (8, 0.9), (16, 5.0)], 3.0),
             ([(8, 0.9), (1, 0.1), (16, 5.0), (2, 0.12), (4, 0.2)], 3.0),
             ([(1, 0.1), (2, 0.2), (3, 0.3)], 3.0),  # never more than 3x: not saturated in this range
             ([(1, 0.25), (2, 0.75), (3, 0.8)], 3.0),  # exactly 3x is not yet more than 3x
             ([(0.5, 0.2), (1, 0.25), (2, 0.7), (4, 3.0)], 2.0),
             ([(1, 0.1), (2, 0.15), (3, 0.25), (4, 0.35), (5, 0.5)], 3.0),
             # the lowest rate is not the fastest
             ([(1, 0.2), (2, 0.1), (4, 0.19), (8, 0.3), (16, 0.35), (32, 2.0)], 2.0),
             ([(1, 0.1), (2, 0.22), (4, 0.25), (8, 2.0)], 2.0),  # factor 2 and factor 3 disagree
             ([(1, 0.1), (2, 0.32), (4, 0.38), (8, 0.45), (16, 2.0)], 4.0)]  # so do factor 4 and factor 3
    for _ in range(40):
        rates = sorted(rng.sample(range(1, 40), rng.randint(2, 7)))
        knee = rng.choice(rates + [100])
        rows = [(float(r), 0.1 * (1 + rng.random() * 0.3) * (1 if r < knee else 5 + r)) for r in rates]
        rng.shuffle(rows)
        cases.append((rows, rng.choice([2.0, 3.0, 4.0])))
    for rows, factor in cases:
        want = reference_saturation_rate(rows, factor)
        got = fn(list(rows), factor)
        if got == want:
            continue
        where = f"saturation_rate({rows}, factor={factor})"
        if want is None:
            raise ExerciseFailed(f"{where}: no rate's latency exceeds {factor} x the lowest rate's, so the server "
                                 f"did not saturate in this range: return None, not {got!r}")
        if isinstance(got, int | float) and got in {lat for _, lat in rows} and got not in {r for r, _ in rows}:
            raise ExerciseFailed(f"{where}: return the saturating rate (requests per second), not its latency")
        for mistake, message in SATURATION_MISTAKES:
            if got == mistake(list(rows), factor) != want:
                raise ExerciseFailed(f"{where}: expected {want}, got {got}: {message}")
        if any(got == reference_saturation_rate(rows, other) for other in (2.0, 3.0, 4.0, 5.0) if other != factor):
            raise ExerciseFailed(f"{where}: expected {want}, got {got}, the answer for another factor: compare "
                                 "with factor x the baseline, the factor you are given")
        raise ExerciseFailed(f"{where}: expected {want}, got {got}")
    return "the first rate whose latency exceeds factor x the unloaded latency"


# ----------------------------------------------------------------------------------- knowledge check
QUIZ_TOKEN_TIMES = (2.0, [2.8, 2.9, 3.1, 3.2, 3.4])  # question 1: sent at 2.0 s, five tokens
QUIZ_TTFTS = [0.2, 0.3, 0.25, 1.9, 0.4]  # question 2: five requests' TTFTs, seconds


@exercise("16", "knowledge_check")
def knowledge_check(ns):
    from labkit_course.grading.quiz import Choice, Number, grade_answers

    return grade_answers(ns, {
        1: Number(1000 * _ttft_tpot(*QUIZ_TOKEN_TIMES)[1], "'Measuring latency: TTFT and TPOT'", rel_tol=1e-6),
        2: Number(float(np.percentile(QUIZ_TTFTS, 90)), "'Exercise 4: percentiles'", rel_tol=1e-6),
        3: Choice("a", "'One engine, many clients'"),
        4: Choice("b", "'Disconnects cost nothing'"),
        5: Choice("c", "'Continuous vs static batching under load'"),
        6: Choice("b", "'Exercise 4: percentiles' and 'Exercise 5: users arrive at random'"),
    })
