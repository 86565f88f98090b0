"""Lab 06 graders: full marks for correct answers, and each typical mistake named."""

import pytest
import torch

from labkit.grading.core import get_exercise, run_exercise

NEG_INF = float("-inf")


def outcome(name, fn):
    return run_exercise(get_exercise("06", name), {name: fn})


# Correct answers, written the way a student would (not with labkit's helpers).
def temperature_probs(logits, temperature):
    if temperature == 0:
        return torch.zeros_like(logits).scatter_(-1, logits.argmax(-1, keepdim=True), 1.0)
    return (logits / temperature).softmax(-1)


def top_k_filter(logits, k):
    kth = logits.topk(k, dim=-1).values[..., -1:]
    return logits.masked_fill(logits < kth, NEG_INF)


def top_p_filter(logits, top_p):
    sorted_logits, order = logits.sort(-1, descending=True)
    cumulative = sorted_logits.softmax(-1).cumsum(-1)
    remove = cumulative - sorted_logits.softmax(-1) >= top_p  # mass *before* this token already reaches top_p
    return logits.masked_fill(remove.scatter(-1, order, remove), NEG_INF)


def sample_next(logits, temperature, generator):
    if temperature == 0:
        return int(logits.argmax())
    return int(torch.multinomial((logits / temperature).softmax(-1), 1, generator=generator))


def not_implemented(*args):
    raise NotImplementedError()


@pytest.mark.parametrize(("name", "fn"), [("temperature_probs", temperature_probs), ("top_k_filter", top_k_filter),
                                          ("top_p_filter", top_p_filter), ("sample_next", sample_next)])
def test_correct_answers_pass_and_missing_ones_fail(name, fn):
    assert outcome(name, fn).passed, outcome(name, fn).message
    assert "not implemented yet" in outcome(name, not_implemented).message
    assert not run_exercise(get_exercise("06", name), {}).passed


def in_place_top_k(logits, k):
    logits[logits < logits.topk(k, dim=-1).values[..., -1:]] = NEG_INF
    return logits


@pytest.mark.parametrize(
    ("name", "fn", "reason"),
    [
        ("temperature_probs", lambda x, t: (x * t).softmax(-1), "multiplied the logits by the temperature"),
        ("temperature_probs", lambda x, t: x.softmax(-1), "the temperature has no effect"),
        ("temperature_probs", lambda x, t: (x / t).softmax(0), "each row must be a probability distribution"),
        ("temperature_probs", lambda x, t: (x / t).softmax(-1), "temperature 0 gives NaN"),
        ("top_k_filter", lambda x, k: x.masked_fill(x < x.topk(k, -1).values[..., -1:], 0.0), "set them to -inf"),
        ("top_k_filter", lambda x, k: top_k_filter(x, k + 1) if k < x.shape[-1] else x, "off-by-one"),
        ("top_k_filter", in_place_top_k, "changed its input logits in place"),
        ("top_k_filter", lambda x, k: x.topk(k, -1).values, "expected a tensor of shape"),
        ("top_k_filter", lambda x, k: x.masked_fill(x.argsort(-1, descending=True).argsort(-1) >= k, NEG_INF),
         "keep every tied token"),
        ("top_p_filter", lambda x, p: x.masked_fill(x.softmax(-1) < 0, NEG_INF) if p > 0.9 else x.masked_fill(
            torch.ones_like(x, dtype=torch.bool), NEG_INF), "a row lost every token"),
        ("top_p_filter", lambda x, p: (lambda s, o: x.masked_fill(
            (s.softmax(-1).cumsum(-1) > p).scatter(-1, o, s.softmax(-1).cumsum(-1) > p)
            & (x < x.max(-1, keepdim=True).values), NEG_INF))(*x.sort(-1, descending=True)),
         "keep the token that crosses the threshold"),
        ("top_p_filter", lambda x, p: x.masked_fill(x.softmax(-1).cumsum(-1) - x.softmax(-1) >= p, NEG_INF)
         .masked_fill(torch.zeros_like(x, dtype=torch.bool), NEG_INF), "sort descending"),
        ("top_p_filter", lambda x, p: top_p_filter(x, p).softmax(-1).log(), "returned unchanged"),
        ("sample_next", lambda x, t, g: int(x.argmax()), "every draw is the same token"),
        ("sample_next", lambda x, t, g: int(torch.multinomial(x.softmax(-1), 1, generator=g)),
         "temperature 0 must always return the argmax"),
        ("sample_next", lambda x, t, g: int(x.argmax()) if t == 0 else int(
            torch.multinomial((x - x.min()) / t, 1, generator=g)), "sample from the probabilities, not the logits"),
        ("sample_next", lambda x, t, g: int(x.argmax()) if t == 0 else int(
            torch.multinomial(x.softmax(-1), 1, generator=g)), "divide the logits by the temperature"),
        ("sample_next", lambda x, t, g: x.argmax() if t == 0 else torch.multinomial(x.softmax(-1), 1, generator=g),
         "Python int"),
    ],
)
def test_typical_mistakes_are_named(name, fn, reason):
    result = outcome(name, fn)
    assert not result.passed
    assert reason in result.message, result.message
