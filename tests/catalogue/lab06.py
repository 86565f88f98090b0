"""Lab 06: temperature, top-k, top-p and drawing the next token."""

import random

import torch
from transformers.generation.logits_process import TopKLogitsWarper, TopPLogitsWarper

from catalogue import Right, Wrong
from labkit.sampling import apply_penalties as labkit_penalties
from labkit.sampling import filter_logits

NEG_INF = float("-inf")


def temperature_where(logits, temperatures):
    """Vectorized: divide every row by its own T (1 where T = 0, to avoid 0/0), then pick per row."""
    greedy = (temperatures == 0)[:, None]
    probs = (logits / torch.where(greedy, 1.0, temperatures[:, None])).softmax(-1)
    one_hot = torch.zeros_like(logits).scatter_(-1, logits.argmax(-1, keepdim=True), 1.0)
    return torch.where(greedy, one_hot, probs)


def temperature_rows(logits, temperatures):
    """A loop over rows, with F.one_hot and a hand-written stable softmax."""
    rows = []
    for row, t in zip(logits, temperatures.tolist(), strict=True):
        if t == 0:
            rows.append(torch.nn.functional.one_hot(row.argmax(), row.shape[-1]).to(row.dtype))
        else:
            e = (row / t - (row / t).max()).exp()
            rows.append(e / e.sum())
    return torch.stack(rows)


def temperature_any_greedy(logits, temperatures):
    """One T = 0 request makes the whole batch greedy."""
    if (temperatures == 0).any():
        return temperature_where(logits, torch.zeros_like(temperatures))
    return (logits / temperatures[:, None]).softmax(-1)


def temperature_all_maxima(logits, temperatures):
    """T = 0 rows one-hot on every token equal to the maximum (a tie sums to 2)."""
    greedy = (temperatures == 0)[:, None]
    one_hot = (logits == logits.max(-1, keepdim=True).values).to(logits.dtype)
    return torch.where(greedy, one_hot, (logits / torch.where(greedy, 1.0, temperatures[:, None])).softmax(-1))


def temperature_split_ties(logits, temperatures):
    """T = 0 rows share the probability evenly between tied maxima."""
    greedy = (temperatures == 0)[:, None]
    at_max = (logits == logits.max(-1, keepdim=True).values).to(logits.dtype)
    probs = (logits / torch.where(greedy, 1.0, temperatures[:, None])).softmax(-1)
    return torch.where(greedy, at_max / at_max.sum(-1, keepdim=True), probs)


def in_place_temperature(logits, temperatures):
    return logits.div_(temperatures[:, None]).softmax(-1)


def temperature_ignores_greedy_rows(logits, temperatures):
    """Divides by T everywhere, then patches 0/0 to a uniform row instead of the argmax."""
    probs = (logits / temperatures[:, None]).softmax(-1)
    return torch.where(torch.isnan(probs), 1.0 / logits.shape[-1], probs)


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
    """A Python loop over the rows of a [batch, vocab] view (one row is a batch of one)."""
    rows = logits.reshape(-1, logits.shape[-1])
    out = torch.full_like(rows, NEG_INF)
    for row, probs in enumerate(rows.softmax(-1)):
        total = 0.0
        for token in probs.argsort(descending=True).tolist():
            out[row, token] = rows[row, token]
            total += float(probs[token])
            if total >= top_p:
                break
    return out.reshape(logits.shape)


def top_p_sorted_mask(logits, top_p, *, back=None, sorted_result=False):
    """Top-p whose sorted-order mask is not scattered back; `back` puts it somewhere, `sorted_result`
    returns the sorted logits themselves."""
    sorted_logits, order = logits.sort(-1, descending=True)
    probs = sorted_logits.softmax(-1)
    remove = probs.cumsum(-1) - probs >= top_p
    if sorted_result:
        return sorted_logits.masked_fill(remove, NEG_INF)
    return logits.masked_fill(back(remove, order) if back else remove, NEG_INF)


def top_p_batch_only(logits, top_p):
    """Written for [batch, vocab] only: dim=1 fails on a single row."""
    sorted_logits, order = logits.sort(1, descending=True)
    probs = sorted_logits.softmax(1)
    remove = probs.cumsum(1) - probs >= top_p
    return logits.masked_fill(remove.scatter(1, order, remove), NEG_INF)


def sample_multinomial(logits, temperature, generator):
    if temperature == 0:
        return int(logits.argmax())
    return int(torch.multinomial((logits / temperature).softmax(-1), 1, generator=generator))


def sample_greedy_when_cold(logits, temperature, generator):
    """Greedy below T = 0.25, as if a small temperature were as good as 0."""
    if temperature < 0.25:
        return int(logits.argmax())
    return int(torch.multinomial((logits / temperature).softmax(-1), 1, generator=generator))


def sample_clamped_temperature(logits, temperature, generator):
    """Temperatures above 1 clamped to 1."""
    return sample_multinomial(logits, min(temperature, 1.0), generator)


def temperature_overwriting_temperatures(logits, temperatures):
    """Right, but the greedy rows' T = 0 overwritten with 1 in the caller's tensor."""
    greedy = temperatures == 0
    temperatures[greedy] = 1.0
    probs = (logits / temperatures[:, None]).softmax(-1)
    one_hot = torch.zeros_like(logits).scatter_(-1, logits.argmax(-1, keepdim=True), 1.0)
    return torch.where(greedy[:, None], one_hot, probs)


def sample_manual_softmax(logits, temperature, generator):
    """The softmax written out (max subtracted, exp, normalised), then the same seeded multinomial draw."""
    if temperature == 0:
        return logits.argmax().item()
    scaled = logits / temperature
    weights = (scaled - scaled.max()).exp()
    return torch.multinomial(weights / weights.sum(), num_samples=1, generator=generator).item()


def sample_inverse_cdf(logits, temperature, generator):
    if temperature == 0:
        return logits.argmax().item()
    cdf = (logits / temperature).softmax(-1).cumsum(-1)
    u = torch.rand(1, generator=generator)
    return min(int(torch.searchsorted(cdf, u)), len(logits) - 1)


def sample_gumbel_max(logits, temperature, generator):
    """The reviewer's Gumbel-max draw: the right distribution, other tokens per seed than torch.multinomial."""
    if temperature == 0:
        return int(logits.argmax())
    u = torch.rand(logits.shape, generator=generator).clamp_min(1e-20)
    return int((logits / temperature - torch.log(-torch.log(u))).argmax())


def sample_tiny_temperature(logits, temperature, generator):
    t = max(temperature, 1e-5)
    return int(torch.multinomial((logits / t).softmax(-1), 1, generator=generator))


def top_p_exceeds(logits, top_p):
    """Removes a token only when the mass before it exceeds top_p: one token too many at the exact boundary."""
    sorted_logits, order = logits.sort(-1, descending=True)
    probs = sorted_logits.softmax(-1)
    remove = probs.cumsum(-1) - probs > top_p
    return logits.masked_fill(remove.scatter(-1, order, remove), NEG_INF)


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


def top_p_dropping_the_crossing_token(x, p):
    s, o = x.sort(-1, descending=True)
    over = s.softmax(-1).cumsum(-1) > p
    return x.masked_fill(over.scatter(-1, o, over) & (x < x.max(-1, keepdim=True).values), NEG_INF)


def in_place_sample(logits, temperature, generator):
    if temperature == 0:
        return int(logits.argmax())
    logits /= temperature
    return int(torch.multinomial(logits.softmax(-1), 1, generator=generator))


def penalties_loop(logits, prompt_ids, output_ids, repetition, presence, frequency, *, divide_negative=False,
                   every_occurrence=False, output_only=False, prompt_counts=False, presence_once=False,
                   add_presence=False, first_row=False, subtract_first=False, presence_per_occurrence=False,
                   whole_row=False):
    """Row by row, token by token; the switches make typical mistakes."""
    out = logits.clone()
    for b, (prompt, output) in enumerate(zip(prompt_ids, output_ids, strict=True)):
        r = 0 if first_row else b
        seen = output if output_only else prompt + output
        counted = prompt + output if prompt_counts else output
        if subtract_first:
            _subtract(out[b], counted, frequency[r], presence[r], presence_once, add_presence)
        if whole_row:
            seen = range(out.shape[1])
        for token in (seen if every_occurrence else set(seen)):
            if out[b, token] > 0 or divide_negative:
                out[b, token] /= repetition[r]
            else:
                out[b, token] *= repetition[r]
        if not subtract_first:
            _subtract(out[b], counted, frequency[r], presence[r], presence_once, add_presence)
        if presence_per_occurrence:  # the presence penalty once more for every repeat
            for token in set(counted):
                out[b, token] -= presence[r] * (counted.count(token) - 1)
    return out


def _subtract(row, counted, frequency, presence, presence_once, add_presence):
    for token in set(counted):
        row[token] -= frequency * (1 if presence_once else counted.count(token))
        row[token] += presence if add_presence else -presence


def penalties_in_place(logits, *args):
    return logits.copy_(penalties_loop(logits, *args))


def penalties_scatter(logits, prompt_ids, output_ids, repetition, presence, frequency):
    """Vectorized: per-row token counts by scatter_add, then torch.where on the sign."""
    batch, vocab = logits.shape
    seen = torch.zeros(batch, vocab, dtype=torch.bool)
    counts = torch.zeros(batch, vocab)
    for b in range(batch):
        seen[b, prompt_ids[b] + output_ids[b]] = True
        counts[b].scatter_add_(0, torch.tensor(output_ids[b], dtype=torch.long), torch.ones(len(output_ids[b])))
    rep = torch.tensor(repetition)[:, None]
    out = torch.where(seen, torch.where(logits > 0, logits / rep, logits * rep), logits)
    return out - torch.tensor(frequency)[:, None] * counts - torch.tensor(presence)[:, None] * (counts > 0)


def penalties_padded_with_zero(logits, prompt_ids, output_ids, repetition, presence, frequency):
    """Batched by padding every history to one width with token 0, which then counts as seen."""
    def pad(rows):
        return [r + [0] * (max(map(len, rows)) - len(r)) for r in rows]
    return penalties_scatter(logits, pad(prompt_ids), pad(output_ids), repetition, presence, frequency)


def top_k_first_rows_threshold(logits, k):
    values = logits.topk(k, -1).values
    return logits.masked_fill(logits < (values[0, -1] if logits.dim() == 2 else values[-1]), NEG_INF)


RIGHT = [
    Right("temperature_probs", "vectorized: torch.where per row", temperature_where),
    Right("temperature_probs", "loop over rows, F.one_hot and a hand-written softmax", temperature_rows),
    Right("apply_penalties", "loops over rows and distinct tokens", penalties_loop),
    Right("apply_penalties", "vectorized: scatter_add counts and torch.where", penalties_scatter),
    Right("top_k_filter", "topk threshold and masked_fill", top_k_threshold),
    Right("top_k_filter", "sort and torch.where", top_k_sorted),
    Right("top_p_filter", "sorted cumulative sum scattered back", top_p_scatter),
    Right("top_p_filter", "python loop per row", top_p_rows),
    Right("sample_next", "torch.multinomial with the generator", sample_multinomial),
    Right("sample_next", "the softmax written out, then torch.multinomial", sample_manual_softmax),
]

WRONG = [
    Wrong("temperature_probs", "T = 0: one-hot on every tied maximum", temperature_all_maxima,
          "put probability 1 on every tied token"),
    Wrong("temperature_probs", "T = 0: tied maxima share the probability", temperature_split_ties,
          "the first of them"),
    Wrong("temperature_probs", "T clamped to 1e-3", lambda x, t: (x / t.clamp_min(1e-3)[:, None]).softmax(-1),
          "a tiny temperature (a clamp)"),
    Wrong("temperature_probs", "T clamped to 1e-6", lambda x, t: (x / t.clamp_min(1e-6)[:, None]).softmax(-1),
          "the first of them"),
    Wrong("top_p_filter", "removes only when the mass before exceeds top_p", top_p_exceeds, "reaches it, not only"),
    Wrong("sample_next", "a Gumbel-max draw", sample_gumbel_max, "other tokens than torch.multinomial"),
    Wrong("sample_next", "an inverse-CDF draw of its own", sample_inverse_cdf, "other tokens than torch.multinomial"),
    Wrong("sample_next", "T = 0 as a tiny temperature", sample_tiny_temperature, "not a draw at a tiny temperature"),
    Wrong("apply_penalties", "presence once per occurrence",
          lambda *a: penalties_loop(*a, presence_per_occurrence=True),
          "presence_penalty was subtracted once per occurrence"),
    Wrong("apply_penalties", "repetition over the whole row", lambda *a: penalties_loop(*a, whole_row=True),
          "applied to the whole row"),
    Wrong("temperature_probs", "divides the columns (temperatures[None, :])",
          lambda x, t: (x / t[None, :]).softmax(-1), "divided the columns"),
    Wrong("temperature_probs", "the first row's temperature for all",
          lambda x, t: temperature_where(x, t[:1].expand_as(t)),
          "first row's temperature"),
    Wrong("temperature_probs", "multiplies by the temperature", lambda x, t: temperature_where(x * t[:, None] ** 2, t),
          "multiplied the logits by the temperature"),
    Wrong("temperature_probs", "ignores the temperature", lambda x, t: x.softmax(-1), "the temperature has no effect"),
    Wrong("temperature_probs", "divides the probabilities, not the logits", lambda x, t: x.softmax(-1) / t[:, None],
          "the probabilities were divided by the temperature"),
    Wrong("temperature_probs", "T = 0 gives NaN", lambda x, t: (x / t[:, None]).softmax(-1), "gives NaN"),
    Wrong("temperature_probs", "T = 0 rows spread uniformly", temperature_ignores_greedy_rows,
          "the T = 0 rows are not"),
    Wrong("temperature_probs", "one T = 0 request makes the batch greedy", temperature_any_greedy,
          "every row became greedy"),
    Wrong("temperature_probs", "a scalar temperature only", lambda x, t: (x / float(t)).softmax(-1),
          "one value per row"),
    Wrong("temperature_probs", "divides the input in place", in_place_temperature,
          "changed its input logits in place"),
    Wrong("temperature_probs", "calls labkit's filter_logits",
          lambda x, t: filter_logits(x, temperature=float(t[0])).softmax(-1),
          "`filter_logits`", calls="labkit.sampling.filter_logits"),
    Wrong("apply_penalties", "divides negative logits too", lambda *a: penalties_loop(*a, divide_negative=True),
          "makes the token MORE likely"),
    Wrong("apply_penalties", "repetition once per occurrence", lambda *a: penalties_loop(*a, every_occurrence=True),
          "once per occurrence"),
    Wrong("apply_penalties", "repetition over the output only", lambda *a: penalties_loop(*a, output_only=True),
          "prompt's tokens escaped"),
    Wrong("apply_penalties", "presence/frequency count the prompt", lambda *a: penalties_loop(*a, prompt_counts=True),
          "count only generated"),
    Wrong("apply_penalties", "frequency once per token", lambda *a: penalties_loop(*a, presence_once=True),
          "once per occurrence (times the count)"),
    Wrong("apply_penalties", "adds the presence penalty", lambda *a: penalties_loop(*a, add_presence=True),
          "presence_penalty was added"),
    Wrong("apply_penalties", "first row's penalties everywhere", lambda *a: penalties_loop(*a, first_row=True),
          "first row's penalties"),
    Wrong("apply_penalties", "frequency and presence before repetition", lambda *a: penalties_loop(
        *a, subtract_first=True), "applied in the wrong order"),
    Wrong("apply_penalties", "penalizes in place", penalties_in_place, "changed its input logits in place"),
    Wrong("apply_penalties", "calls labkit's apply_penalties", lambda logits, p, o, r, pr, f: labkit_penalties(
        logits, *(torch.tensor([x + [-1] * (9 - len(x)) for x in rows]) for rows in (p, o)),
        *(torch.tensor(v) for v in (r, pr, f))), "`apply_penalties`", calls="labkit.sampling.apply_penalties"),
    Wrong("top_k_filter", "removed logits set to 0",
          lambda x, k: x.masked_fill(x < x.topk(k, -1).values[..., -1:], 0.0),
          "set them to -inf"),
    Wrong("top_k_filter", "keeps k + 1", lambda x, k: top_k_threshold(x, k + 1) if k < x.shape[-1] else x,
          "off-by-one"),
    Wrong("top_k_filter", "keeps k - 1", lambda x, k: top_k_threshold(x, k - 1) if k > 1 else x.masked_fill(
        torch.ones_like(x, dtype=torch.bool), NEG_INF), "off-by-one"),
    Wrong("top_k_filter", "filters in place", in_place_top_k, "changed its input logits in place"),
    Wrong("top_k_filter", "returns float64", lambda x, k: top_k_threshold(x, k).double(), "keep the logits' dtype"),
    Wrong("temperature_probs", "computes in float32", lambda x, t: temperature_where(x.float(), t.float()),
          "keep the logits' dtype"),
    Wrong("temperature_probs", "writes into the caller's temperatures", temperature_overwriting_temperatures,
          "changed the temperatures it was given"),
    Wrong("sample_next", "greedy below T = 0.25", sample_greedy_when_cold, "only T = 0 is greedy"),
    Wrong("sample_next", "clamps T to 1", sample_clamped_temperature, "don't clamp the temperature"),
    Wrong("top_k_filter", "calls transformers' TopKLogitsWarper", lambda x, k: TopKLogitsWarper(top_k=k)(None, x),
          "TopKLogitsWarper.__call__` is what this exercise asks",
          calls="transformers.generation.logits_process.TopKLogitsWarper.__call__"),
    Wrong("top_p_filter", "calls transformers' TopPLogitsWarper", lambda x, p: TopPLogitsWarper(top_p=p)(
        None, x.reshape(-1, x.shape[-1])).reshape(x.shape), "TopPLogitsWarper.__call__` is what",
          calls="transformers.generation.logits_process.TopPLogitsWarper.__call__"),
    Wrong("temperature_probs", "returns float64", lambda x, t: temperature_where(x.double(), t.double()),
          "keep the logits' dtype"),
    Wrong("top_k_filter", "returns only the top-k values", lambda x, k: x.topk(k, -1).values,
          "expected a tensor of shape"),
    Wrong("top_k_filter", "breaks ties by rank", lambda x, k: x.masked_fill(
        x.argsort(-1, descending=True).argsort(-1) >= k, NEG_INF), "keep every tied token"),
    Wrong("top_k_filter", "keeps the k smallest", lambda x, k: x.masked_fill(
        x > x.topk(k, -1, largest=False).values[..., -1:], NEG_INF), "kept the k smallest"),
    Wrong("top_k_filter", "works on [batch, vocab] only (dim=1, [:, -1:])", lambda x, k: x.masked_fill(
        x < x.topk(k, dim=1).values[:, -1:], NEG_INF), "one row [vocab]"),
    Wrong("top_k_filter", "one threshold for the whole batch (values[-1])", lambda x, k: x.masked_fill(
        x < x.topk(k).values[-1], NEG_INF), "each row has its own"),
    Wrong("top_k_filter", "one threshold for the whole batch (the first row's)", top_k_first_rows_threshold,
          "cut at the first row's k-th largest"),
    Wrong("apply_penalties", "histories padded with token 0", penalties_padded_with_zero, "padded with token 0"),
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
    Wrong("top_p_filter", "returns the sorted logits (no scatter back)", lambda x, p: top_p_sorted_mask(
        x, p, sorted_result=True), "remove.scatter(-1, order, remove)"),
    Wrong("top_p_filter", "applies the sorted-order mask to the unsorted logits", top_p_sorted_mask,
          "left in sorted order"),
    Wrong("top_p_filter", "gathers the mask with the order instead of scattering", lambda x, p: top_p_sorted_mask(
        x, p, back=lambda remove, order: remove.gather(-1, order)), "remove.scatter(-1, order, remove)"),
    Wrong("top_p_filter", "returns sorted-order probabilities", lambda x, p: (lambda s: s.softmax(-1).masked_fill(
        s.softmax(-1).cumsum(-1) - s.softmax(-1) >= p, 0.0))(x.sort(-1, descending=True).values),
          "left in sorted order"),
    Wrong("top_p_filter", "works on [batch, vocab] only (dim=1)", top_p_batch_only, "one row [vocab]"),
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
