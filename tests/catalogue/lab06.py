"""Lab 06: temperature, top-k, top-p and drawing the next token."""

import random

import torch

from catalogue import Right, Wrong
from labkit.sampling import filter_logits

NEG_INF = float("-inf")


def temperature_scatter(logits, temperature):
    if temperature == 0:
        return torch.zeros_like(logits).scatter_(-1, logits.argmax(-1, keepdim=True), 1.0)
    return (logits / temperature).softmax(-1)


def temperature_one_hot(logits, temperature):
    if temperature == 0:
        return torch.nn.functional.one_hot(logits.argmax(-1), logits.shape[-1]).to(logits.dtype)
    scaled = logits / temperature
    e = (scaled - scaled.amax(-1, keepdim=True)).exp()
    return e / e.sum(-1, keepdim=True)


def top_k_threshold(logits, k):
    kth = logits.topk(k, dim=-1).values[..., -1:]
    return logits.masked_fill(logits < kth, NEG_INF)


def top_k_sorted(logits, k):
    kth = logits.sort(-1, descending=True).values[..., k - 1:k]
    return torch.where(logits >= kth, logits, torch.full_like(logits, NEG_INF))


def top_p_scatter(logits, top_p):
    sorted_logits, order = logits.sort(-1, descending=True)
    probs = sorted_logits.softmax(-1)
    remove = probs.cumsum(-1) - probs >= top_p  # the mass *before* this token already reaches top_p
    return logits.masked_fill(remove.scatter(-1, order, remove), NEG_INF)


def top_p_rows(logits, top_p):
    out = torch.full_like(logits, NEG_INF)
    for row, probs in enumerate(logits.softmax(-1)):
        total = 0.0
        for token in probs.argsort(descending=True).tolist():
            out[row, token] = logits[row, token]
            total += float(probs[token])
            if total >= top_p:
                break
    return out


def sample_multinomial(logits, temperature, generator):
    if temperature == 0:
        return int(logits.argmax())
    return int(torch.multinomial((logits / temperature).softmax(-1), 1, generator=generator))


def sample_inverse_cdf(logits, temperature, generator):
    if temperature == 0:
        return logits.argmax().item()
    cdf = (logits / temperature).softmax(-1).cumsum(-1)
    u = torch.rand(1, generator=generator)
    return min(int(torch.searchsorted(cdf, u)), len(logits) - 1)


def sample_global_rng(logits, temperature, generator):
    if temperature == 0:
        return int(logits.argmax())
    return int(torch.multinomial((logits / temperature).softmax(-1), 1))


def sample_python_random(logits, temperature, generator):
    if temperature == 0:
        return int(logits.argmax())
    return random.choices(range(len(logits)), weights=(logits / temperature).softmax(-1).tolist())[0]


def in_place_top_k(logits, k):
    logits[logits < logits.topk(k, dim=-1).values[..., -1:]] = NEG_INF
    return logits


def in_place_temperature(logits, temperature):
    return logits.div_(temperature).softmax(-1)


def top_p_dropping_the_crossing_token(x, p):
    s, o = x.sort(-1, descending=True)
    over = s.softmax(-1).cumsum(-1) > p
    return x.masked_fill(over.scatter(-1, o, over) & (x < x.max(-1, keepdim=True).values), NEG_INF)


def in_place_sample(logits, temperature, generator):
    if temperature == 0:
        return int(logits.argmax())
    logits /= temperature
    return int(torch.multinomial(logits.softmax(-1), 1, generator=generator))


RIGHT = [
    Right("temperature_probs", "scatter a one-hot for T = 0", temperature_scatter),
    Right("temperature_probs", "F.one_hot and a hand-written stable softmax", temperature_one_hot),
    Right("top_k_filter", "topk threshold and masked_fill", top_k_threshold),
    Right("top_k_filter", "sort and torch.where", top_k_sorted),
    Right("top_p_filter", "sorted cumulative sum scattered back", top_p_scatter),
    Right("top_p_filter", "python loop per row", top_p_rows),
    Right("sample_next", "torch.multinomial with the generator", sample_multinomial),
    Right("sample_next", "inverse CDF with torch.rand(generator=)", sample_inverse_cdf),
]

WRONG = [
    Wrong("temperature_probs", "multiplies by the temperature", lambda x, t: (x * t).softmax(-1),
          "multiplied the logits by the temperature"),
    Wrong("temperature_probs", "ignores the temperature", lambda x, t: x.softmax(-1), "the temperature has no effect"),
    Wrong("temperature_probs", "softmax over the batch axis", lambda x, t: (x / t).softmax(0),
          "each row must be a probability distribution"),
    Wrong("temperature_probs", "divides the probabilities, not the logits", lambda x, t: x.softmax(-1) / t,
          "the probabilities were divided by the temperature"),
    Wrong("temperature_probs", "returns scaled logits, no softmax", lambda x, t: x / t if t else x,
          "each row must be a probability distribution"),
    Wrong("temperature_probs", "T = 0 gives NaN", lambda x, t: (x / t).softmax(-1), "temperature 0 gives NaN"),
    Wrong("temperature_probs", "T = 0 raises", lambda x, t: (x / torch.tensor(t).item()).softmax(-1) if t else 1 / 0,
          "temperature 0 raised ZeroDivisionError"),
    Wrong("temperature_probs", "T = 0 spread uniformly", lambda x, t: (x / t).softmax(-1) if t else
          torch.full_like(x, 1 / x.shape[-1]), "probability 1 on the argmax"),
    Wrong("temperature_probs", "divides the input in place", in_place_temperature, "changed its input logits in place"),
    Wrong("temperature_probs", "calls labkit's filter_logits", lambda x, t: filter_logits(x, temperature=t).softmax(-1),
          "`filter_logits`", calls="labkit.sampling.filter_logits"),
    Wrong("top_k_filter", "removed logits set to 0",
          lambda x, k: x.masked_fill(x < x.topk(k, -1).values[..., -1:], 0.0),
          "set them to -inf"),
    Wrong("top_k_filter", "keeps k + 1", lambda x, k: top_k_threshold(x, k + 1) if k < x.shape[-1] else x,
          "off-by-one"),
    Wrong("top_k_filter", "keeps k - 1", lambda x, k: top_k_threshold(x, k - 1) if k > 1 else x.masked_fill(
        torch.ones_like(x, dtype=torch.bool), NEG_INF), "off-by-one"),
    Wrong("top_k_filter", "filters in place", in_place_top_k, "changed its input logits in place"),
    Wrong("top_k_filter", "returns only the top-k values", lambda x, k: x.topk(k, -1).values,
          "expected a tensor of shape"),
    Wrong("top_k_filter", "breaks ties by rank", lambda x, k: x.masked_fill(
        x.argsort(-1, descending=True).argsort(-1) >= k, NEG_INF), "keep every tied token"),
    Wrong("top_k_filter", "keeps the k smallest", lambda x, k: x.masked_fill(
        x > x.topk(k, -1, largest=False).values[..., -1:], NEG_INF), "kept the k smallest"),
    Wrong("top_k_filter", "calls labkit's filter_logits", lambda x, k: filter_logits(x, top_k=k),
          "`filter_logits`", calls="labkit.sampling.filter_logits"),
    Wrong("top_p_filter", "can remove every token", lambda x, p: x.masked_fill(x.softmax(-1) < 0, NEG_INF)
          if p > 0.9 else x.masked_fill(torch.ones_like(x, dtype=torch.bool), NEG_INF), "a row lost every token"),
    Wrong("top_p_filter", "drops the token that crosses top_p", top_p_dropping_the_crossing_token,
          "keep the token that crosses the threshold"),
    Wrong("top_p_filter", "cumulative sum without sorting", lambda x, p: x.masked_fill(
        x.softmax(-1).cumsum(-1) - x.softmax(-1) >= p, NEG_INF), "sort descending"),
    Wrong("top_p_filter", "returns log-probabilities", lambda x, p: top_p_scatter(x, p).log_softmax(-1),
          "returned unchanged"),
    Wrong("top_p_filter", "filters in place", lambda x, p: x.copy_(top_p_scatter(x, p)),
          "changed its input logits in place"),
    Wrong("top_p_filter", "calls labkit's filter_logits", lambda x, p: filter_logits(x, top_p=p),
          "`filter_logits`", calls="labkit.sampling.filter_logits"),
    Wrong("sample_next", "always the argmax", lambda x, t, g: int(x.argmax()), "every draw is the same token"),
    Wrong("sample_next", "T = 0 still samples", lambda x, t, g: int(torch.multinomial(x.softmax(-1), 1, generator=g)),
          "temperature 0 must always return the argmax"),
    Wrong("sample_next", "T = 0 divides by zero", lambda x, t, g: int(torch.multinomial(
        (x / t).softmax(-1), 1, generator=g)), "temperature 0 raised RuntimeError"),
    Wrong("sample_next", "samples from shifted logits", lambda x, t, g: int(x.argmax()) if t == 0 else int(
        torch.multinomial((x - x.min()) / t, 1, generator=g)), "sample from the probabilities, not the logits"),
    Wrong("sample_next", "ignores the temperature", lambda x, t, g: int(x.argmax()) if t == 0 else int(
        torch.multinomial(x.softmax(-1), 1, generator=g)), "divide the logits by the temperature"),
    Wrong("sample_next", "returns a tensor", lambda x, t, g: x.argmax() if t == 0 else torch.multinomial(
        x.softmax(-1), 1, generator=g), "Python int"),
    Wrong("sample_next", "ignores its generator (global torch RNG)", sample_global_rng, "the generator was ignored"),
    Wrong("sample_next", "ignores its generator (python random)", sample_python_random, "the generator was ignored"),
    Wrong("sample_next", "divides the logits in place", in_place_sample, "changed its input logits in place"),
    Wrong("sample_next", "calls labkit's filter_logits", lambda x, t, g: int(torch.multinomial(
        filter_logits(x, temperature=t).softmax(-1), 1, generator=g)), "`filter_logits`",
          calls="labkit.sampling.filter_logits"),
]
