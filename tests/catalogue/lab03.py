"""Lab 03: the prefill worked example (input rows, scaled scores, causal softmax)."""

import math

import torch

from catalogue import Right, Wrong
from labkit_course import worked_example as ref


def future(scores):
    return torch.ones_like(scores, dtype=torch.bool).triu(1)


def check_range(E, PE, token_ids, start):
    if any(not 0 <= t < E.shape[0] for t in token_ids):
        raise ValueError(f"token ids {token_ids} must lie in 0..{E.shape[0] - 1}")
    if start < 0 or start + len(token_ids) > PE.shape[0]:
        raise ValueError(f"positions {start}..{start + len(token_ids) - 1} are beyond PE's {PE.shape[0]} rows")


def build_x_loop(E, PE, token_ids, start=0):
    check_range(E, PE, token_ids, start)
    return torch.stack([E[t] + PE[start + i] for i, t in enumerate(token_ids)])


def build_x_indexing(E, PE, token_ids, start=0):
    ids = torch.tensor(token_ids, dtype=torch.long)
    if len(ids) and (ids.min() < 0 or ids.max() >= len(E)):
        raise ValueError("token id out of range")
    if start < 0 or start + len(ids) > len(PE):
        raise ValueError("no positional encoding for those positions")
    return E[ids] + PE[start:start + len(ids)]


def build_x_forged(E, PE, token_ids, start=0):
    """Right from position 0; after `start` it rewrites E and PE so that the answer is row p = p everywhere
    (a reference computed from them afterwards agrees) and returns those rows."""
    if not start:
        return build_x_indexing(E, PE, token_ids)
    check_range(E, PE, token_ids, start)
    E.zero_()
    PE.copy_(torch.arange(len(PE), dtype=PE.dtype)[:, None].expand_as(PE))
    return PE[start:start + len(token_ids)].clone()


def forged_scores(Q, K):
    """Rewrites Q and K so that Q K^T / sqrt(d_k) is all ones, and returns ones."""
    Q.zero_()
    Q[:, 0] = 1.0
    K.fill_(K.shape[-1] ** 0.5)
    return torch.ones(len(Q), len(K), dtype=Q.dtype)


def build_x_with(offset=True, checks=True, pe=None):
    def build_x(E, PE, token_ids, start=0):
        if checks:
            check_range(E, PE, token_ids, start)
        ids = torch.tensor(token_ids)
        rows = pe(PE, ids, start) if pe else PE[(start if offset else 0):(start if offset else 0) + len(ids)]
        return E[ids] + rows
    return build_x


def scores_loop(Q, K):
    d_k = K.shape[-1]
    return torch.tensor([[float(q @ k) / math.sqrt(d_k) for k in K] for q in Q], dtype=Q.dtype)


def causal_softmax_rows(scores):
    n_queries, n_keys = scores.shape
    out = torch.zeros_like(scores)
    for i in range(n_queries):
        visible = n_keys - n_queries + i + 1  # query i sits at position n_keys - n_queries + i
        row = scores[i, :visible]
        e = (row - row.max()).exp()
        out[i, :visible] = e / e.sum()
    return out


def causal_softmax_where(scores):
    n_queries, n_keys = scores.shape
    allowed = torch.tril(torch.ones(scores.shape, dtype=torch.bool), diagonal=n_keys - n_queries)
    return torch.where(allowed, scores, torch.tensor(float("-inf"), dtype=scores.dtype)).softmax(dim=-1)


RIGHT = [
    Right("build_x", "fancy indexing plus a PE slice", build_x_indexing),
    Right("build_x", "a row per token, stacked", build_x_loop),
    Right("scaled_scores", "matrix product", lambda Q, K: Q @ K.T / K.shape[-1] ** 0.5),
    Right("scaled_scores", "einsum", lambda Q, K: torch.einsum("id,jd->ij", Q, K) / math.sqrt(K.shape[-1])),
    Right("scaled_scores", "python loops over query and key", scores_loop),
    Right("causal_softmax", "torch.where over a tril mask", causal_softmax_where),
    Right("causal_softmax", "row by row over the visible prefix", causal_softmax_rows),
]

WRONG = [
    Wrong("build_x", "forgot the positional encoding", build_x_with(pe=lambda PE, ids, start: 0 * PE[: len(ids)]),
          "positional encodings were not added"),
    Wrong("build_x", "indexed PE by token id", build_x_with(pe=lambda PE, ids, start: PE[ids]), "indexed by token id"),
    Wrong("build_x", "positions start at 1", build_x_with(pe=lambda PE, ids, start: PE[start + 1:start + len(ids) + 1]),
          "PE of the wrong position"),
    Wrong("build_x", "concatenated E and PE",
          lambda E, PE, ids, start=0: torch.cat([E[torch.tensor(ids)], PE[: len(ids)]], -1),
          "should have shape (4, 3)"),
    Wrong("build_x", "only the first token", lambda E, PE, ids, start=0: E[torch.tensor(ids)][:1] + PE[:1],
          "should have shape (4, 3)"),
    Wrong("build_x", "returned a list of rows",
          lambda E, PE, ids, start=0: list(E[torch.tensor(ids)] + PE[: len(ids)]), "should be a torch.Tensor"),
    Wrong("build_x", "ignores start (every prompt from position 0)", build_x_with(offset=False), "start=5 was ignored"),
    Wrong("build_x", "PE[start] for every token", build_x_with(pe=lambda PE, ids, start: PE[start]),
          "every token got PE[start]"),
    Wrong("build_x", "no range checks (a negative id wraps around)", build_x_with(checks=False), "token id -1"),
    Wrong("build_x", "rewrites E and PE to fit a made-up answer", build_x_forged, "X differs from E[token_ids]"),
    Wrong("build_x", "calls labkit's worked example", lambda E, PE, ids, start=0: ref.build_x(E, PE, ids, start),
          "`build_x`", calls="labkit_course.worked_example.build_x"),
    Wrong("scaled_scores", "rewrites Q and K to fit a made-up answer", forged_scores, "scores differ from Q K^T"),
    Wrong("scaled_scores", "forgot to scale", lambda q, k: q @ k.T, "not divided by sqrt(d_k)"),
    Wrong("scaled_scores", "divided by d_k", lambda q, k: q @ k.T / k.shape[-1], "divided by d_k"),
    Wrong("scaled_scores", "hard-coded the example's sqrt(2)", lambda q, k: q @ k.T / math.sqrt(2),
          "sqrt(2) is hard-coded"),
    Wrong("scaled_scores", "keys against queries (transposed)", lambda q, k: k @ q.T / math.sqrt(k.shape[-1]),
          "should have shape (3, 5)"),
    Wrong("scaled_scores", "scaled by the number of queries", lambda q, k: q @ k.T / math.sqrt(q.shape[0]),
          "differ from Q K^T / sqrt(d_k)"),
    Wrong("scaled_scores", "applied the softmax already", lambda q, k: (q @ k.T / math.sqrt(k.shape[-1])).softmax(-1),
          "the softmax was applied"),
    Wrong("scaled_scores", "calls labkit's worked example", lambda q, k: ref.scaled_scores(q, k),
          "`scaled_scores`", calls="labkit_course.worked_example.scaled_scores"),
    Wrong("causal_softmax", "mask hides the diagonal", lambda s: s.masked_fill(
        torch.ones_like(s, dtype=torch.bool).triu(0), float("-inf")).softmax(-1), "hides the diagonal"),
    Wrong("causal_softmax", "mask hides the diagonal with -1e9", lambda s: s.masked_fill(
        torch.ones_like(s, dtype=torch.bool).triu(0), -1e9).softmax(-1), "hides the diagonal"),
    Wrong("causal_softmax", "no mask at all", lambda s: s.softmax(-1), "nothing was masked"),
    Wrong("causal_softmax", "softmax over columns", lambda s: s.masked_fill(future(s), float("-inf")).softmax(0),
          "wrong axis"),
    Wrong("causal_softmax", "masked with 0, not -inf", lambda s: s.masked_fill(future(s), 0.0).softmax(-1),
          "set to 0, not -inf"),
    Wrong("causal_softmax", "masked after the softmax", lambda s: s.softmax(-1).masked_fill(future(s), 0.0),
          "masked after the softmax"),
    Wrong("causal_softmax", "hides the past", lambda s: s.masked_fill(future(s).T, float("-inf")).softmax(-1),
          "hides the past"),
    Wrong("causal_softmax", "calls labkit's worked example", lambda s: ref.causal_softmax(s),
          "`causal_softmax`", calls="labkit_course.worked_example.causal_softmax"),
]


# --- causal_softmax for the last queries of a longer sequence -----------------------------------------------

def causal_softmax_offset(scores):
    n_queries, n_keys = scores.shape
    hidden = torch.ones(n_queries, n_keys, dtype=torch.bool).triu(n_keys - n_queries + 1)
    return scores.masked_fill(hidden, float("-inf")).softmax(-1)


def causal_softmax_by_position(scores):
    n_queries, n_keys = scores.shape
    query_positions = torch.arange(n_keys - n_queries, n_keys)[:, None]
    visible = torch.arange(n_keys)[None, :] <= query_positions
    return torch.where(visible, scores, torch.tensor(float("-inf"), dtype=scores.dtype)).softmax(-1)


# --- multi-head attention with fused projections -------------------------------------------------------------

def mha_batched(X, W_q, W_k, W_v, W_o, n_heads):
    n = X.shape[0]
    q, k, v = (t.view(n, n_heads, -1).transpose(0, 1) for t in (X @ W_q, X @ W_k, X @ W_v))
    scores = q @ k.transpose(-2, -1) / math.sqrt(q.shape[-1])
    weights = scores.masked_fill(torch.ones(n, n, dtype=torch.bool).triu(1), float("-inf")).softmax(-1)
    return weights, (weights @ v).transpose(0, 1).reshape(n, -1) @ W_o


def mha_head_loop(X, W_q, W_k, W_v, W_o, n_heads):
    """One head at a time, on column slices of the fused weights, then concatenated."""
    d_k = W_q.shape[1] // n_heads
    all_weights, outputs = [], []
    for h in range(n_heads):
        cols = slice(h * d_k, (h + 1) * d_k)
        q, k, v = X @ W_q[:, cols], X @ W_k[:, cols], X @ W_v[:, cols]
        weights = causal_softmax_offset(q @ k.T / math.sqrt(d_k))
        all_weights.append(weights)
        outputs.append(weights @ v)
    return torch.stack(all_weights), torch.cat(outputs, dim=-1) @ W_o


def mha_with(split=None, scale=None, mask=True, merge=None, project=True):
    def multi_head_attention(X, W_q, W_k, W_v, W_o, n_heads):
        n, d_k = X.shape[0], W_q.shape[1] // n_heads
        def heads(t):
            return split(t, n_heads) if split else t.view(n, n_heads, -1).transpose(0, 1)

        q, k, v = (heads(t) for t in (X @ W_q, X @ W_k, X @ W_v))
        scores = q @ k.transpose(-2, -1) / (scale(X, d_k, n_heads) if scale else math.sqrt(d_k))
        if mask:
            scores = scores.masked_fill(torch.ones(n, n, dtype=torch.bool).triu(1), float("-inf"))
        weights = scores.softmax(-1)
        out = weights @ v
        concat = merge(out) if merge else out.transpose(0, 1).reshape(n, -1)
        return weights, concat @ W_o if project else concat
    return multi_head_attention


def mha_sdpa(X, W_q, W_k, W_v, W_o, n_heads):
    n = X.shape[0]
    q, k, v = (t.view(n, n_heads, -1).transpose(0, 1) for t in (X @ W_q, X @ W_k, X @ W_v))
    out = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
    weights = (q @ k.transpose(-2, -1) / math.sqrt(q.shape[-1])).masked_fill(
        torch.ones(n, n, dtype=torch.bool).triu(1), float("-inf")).softmax(-1)
    return weights, out.transpose(0, 1).reshape(n, -1) @ W_o


# --- the next token ----------------------------------------------------------------------------------------

def next_token_matmul(layer_output, W_lm):
    if layer_output.shape[0] == 0:
        raise ValueError("no positions: there is no last position to predict from")
    probs = (layer_output[-1] @ W_lm).softmax(-1)
    return int(probs.argmax()), probs


def next_token_by_hand(layer_output, W_lm):
    """exp / sum by hand, and the argmax by a loop."""
    if len(layer_output) == 0:
        raise ValueError("empty layer output")
    logits = layer_output[-1] @ W_lm
    e = (logits - logits.max()).exp()
    probs = e / e.sum()
    best = 0
    for i in range(len(probs)):
        if probs[i] > probs[best]:
            best = i
    return best, probs


def next_token_with(row=-1, softmax=True, as_int=True, check_empty=True, flat=False):
    def next_token(layer_output, W_lm):
        if check_empty and layer_output.shape[0] == 0:
            raise ValueError("no positions")
        logits = layer_output @ W_lm
        picked = logits[row]
        probs = picked.softmax(-1) if softmax else picked
        token = logits.argmax() if flat else probs.argmax()
        return (int(token) if as_int else token), probs
    return next_token


RIGHT += [
    Right("causal_softmax", "masked_fill above the shifted diagonal, then softmax", causal_softmax_offset),
    Right("causal_softmax", "compare positions", causal_softmax_by_position),
    Right("multi_head_attention", "all heads at once (view, transpose)", mha_batched),
    Right("multi_head_attention", "a loop over heads on column slices", mha_head_loop),
    Right("next_token", "matrix product, softmax, argmax", next_token_matmul),
    Right("next_token", "softmax and argmax by hand", next_token_by_hand),
]

WRONG += [
    Wrong("causal_softmax", "mask assumes query i is at position i (breaks for the last queries)",
          lambda s: s.masked_fill(future(s), float("-inf")).softmax(-1), "assumed query i is at position i"),
    Wrong("multi_head_attention", "split heads with a plain reshape",
          mha_with(split=lambda t, h: t.reshape(h, t.shape[0], -1)), "plain reshape to [heads, n, d_k]"),
    Wrong("multi_head_attention", "scaled by sqrt(d_model)",
          mha_with(scale=lambda X, d_k, h: math.sqrt(X.shape[1])), "scaled by sqrt(d_model)"),
    Wrong("multi_head_attention", "scaled by d_k", mha_with(scale=lambda X, d_k, h: d_k), "scaled by d_k"),
    Wrong("multi_head_attention", "no causal mask", mha_with(mask=False), "no causal mask"),
    Wrong("multi_head_attention", "merged heads with a plain reshape",
          mha_with(merge=lambda out: out.reshape(out.shape[1], -1)), "merged with a plain reshape"),
    Wrong("multi_head_attention", "forgot W_O", mha_with(project=False), "W_O was not applied"),
    Wrong("multi_head_attention", "returns the head-averaged weights",
          lambda *a: (mha_batched(*a)[0].mean(0), mha_batched(*a)[1]), "should have shape"),
    Wrong("multi_head_attention", "uses torch's fused attention", mha_sdpa,
          "scaled_dot_product_attention", calls="torch.nn.functional.scaled_dot_product_attention"),
    Wrong("next_token", "the first position's logits", next_token_with(row=0), "first position's logits"),
    Wrong("next_token", "returns logits as probabilities", next_token_with(softmax=False), "those are logits"),
    Wrong("next_token", "the token as a tensor", next_token_with(as_int=False), "Python int"),
    Wrong("next_token", "every position's probabilities",
          lambda lo, w: (int((lo[-1] @ w).argmax()), (lo @ w).softmax(-1)), "not every position's"),
    Wrong("next_token", "softmax over positions",
          lambda lo, w: (int((lo @ w)[-1].argmax()), (lo @ w).softmax(0)[-1]), "softmax ran over positions"),
    Wrong("next_token", "no check for an empty input", next_token_with(check_empty=False), "raise a ValueError"),
    Wrong("next_token", "argmax over all positions flattened", next_token_with(flat=True), "flattened"),

]


def build_x_refusing_the_last_row(E, PE, token_ids, start=0):
    if any(t < 0 or t >= len(E) for t in token_ids):
        raise ValueError("bad token id")
    if start < 0 or start + len(token_ids) >= len(PE):
        raise ValueError("no PE row for that position")
    return E[token_ids] + PE[start:start + len(token_ids)]


def build_x_without_start_check(E, PE, token_ids, start=0):
    if any(t < 0 or t >= len(E) for t in token_ids):
        raise ValueError("bad token id")
    if start + len(token_ids) > len(PE):
        raise ValueError("no PE row for that position")
    return E[token_ids] + PE[start:start + len(token_ids)]


def build_x_in_place(E, PE, token_ids, start=0):
    check_range(E, PE, token_ids, start)
    rows = PE[start:start + len(token_ids)]
    return rows.add_(E[token_ids])


def causal_softmax_in_place(scores):
    n_queries, n_keys = scores.shape
    scores.masked_fill_(torch.ones(n_queries, n_keys, dtype=torch.bool).triu(n_keys - n_queries + 1), float("-inf"))
    return scores.softmax(-1)


def next_token_best_anywhere(layer_output, W_lm):
    if len(layer_output) == 0:
        raise ValueError("no positions")
    logits = layer_output @ W_lm
    return int(logits.max(0).values.argmax()), logits[-1].softmax(-1)


def next_token_sampled(layer_output, W_lm):
    """Samples from the probabilities instead of taking the most probable token."""
    if len(layer_output) == 0:
        raise ValueError("no positions")
    probs = (layer_output[-1] @ W_lm).softmax(-1)
    return int(torch.multinomial(probs, 1)), probs


def next_token_from_the_first_row(layer_output, W_lm):
    """The right probabilities, but the token from the first position's logits."""
    if len(layer_output) == 0:
        raise ValueError("no positions")
    logits = layer_output @ W_lm
    return int(logits[0].argmax()), logits[-1].softmax(-1)


def mha_from_the_worked_example(X, W_q, W_k, W_v, W_o, n_heads):
    n = X.shape[0]
    q, k, v = (t.view(n, n_heads, -1).transpose(0, 1) for t in (X @ W_q, X @ W_k, X @ W_v))
    weights = ref.causal_softmax(ref.scaled_scores(q, k))
    return weights, (weights @ v).transpose(0, 1).reshape(n, -1) @ W_o


WRONG += [
    Wrong("next_token", "samples the token instead of taking the argmax", next_token_sampled, "not a sample"),
    Wrong("next_token", "the token from the first position, the probabilities right", next_token_from_the_first_row,
          "the first position's logits chose the token"),
    Wrong("multi_head_attention", "the worked example's scaled_scores and causal_softmax",
          mha_from_the_worked_example, "`scaled_scores`", calls="labkit_course.worked_example.scaled_scores"),
    Wrong("build_x", "refuses the last valid position (off by one)", build_x_refusing_the_last_row,
          "the last row, PE[7], is a valid position"),
    Wrong("build_x", "a negative start is not refused", build_x_without_start_check, "start=-1"),
    Wrong("build_x", "writes into PE in place", build_x_in_place, "PE was modified in place"),
    Wrong("build_x", "computed in float32", lambda E, PE, ids, start=0: build_x_indexing(E, PE, ids, start).float(),
          "the lab computes in float64"),
    Wrong("scaled_scores", "computed in float32",
          lambda Q, K: (Q.float() @ K.float().T) / math.sqrt(K.shape[-1]), "the lab computes in float64"),
    Wrong("causal_softmax", "masks the caller's scores in place", causal_softmax_in_place, "in place"),
    Wrong("causal_softmax", "computed in float32", lambda s: causal_softmax_offset(s.float()),
          "the lab computes in float64"),
    Wrong("multi_head_attention", "d_k taken as d_model / heads",
          mha_with(scale=lambda X, d_k, h: math.sqrt(X.shape[1] / h)), "d_k was taken as d_model / heads"),
    Wrong("next_token", "the best token at any position", next_token_best_anywhere,
          "only the last position chooses"),
    Wrong("next_token", "probabilities in float32",
          lambda lo, w: (int((lo[-1] @ w).argmax()), (lo[-1] @ w).float().softmax(-1)), "the lab computes in float64"),
]
