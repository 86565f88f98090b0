"""Lab 03: the prefill worked example (input rows, scaled scores, causal softmax)."""

import math

import torch

from catalogue import Right, Wrong
from labkit import worked_example as ref


def future(scores):
    return torch.ones_like(scores, dtype=torch.bool).triu(1)


def build_x_loop(E, PE, token_ids):
    return torch.stack([E[t] + PE[i] for i, t in enumerate(token_ids)])


def scores_loop(Q, K):
    d_k = K.shape[-1]
    return torch.tensor([[float(q @ k) / math.sqrt(d_k) for k in K] for q in Q], dtype=Q.dtype)


def causal_softmax_rows(scores):
    out = torch.zeros_like(scores)
    for i in range(scores.shape[0]):
        row = scores[i, : i + 1]
        e = (row - row.max()).exp()
        out[i, : i + 1] = e / e.sum()
    return out


def causal_softmax_where(scores):
    allowed = torch.tril(torch.ones(scores.shape, dtype=torch.bool))
    return torch.where(allowed, scores, torch.tensor(float("-inf"), dtype=scores.dtype)).softmax(dim=-1)


RIGHT = [
    Right("build_x", "fancy indexing plus a PE slice", lambda E, PE, ids: E[torch.tensor(ids)] + PE[: len(ids)]),
    Right("build_x", "a row per token, stacked", build_x_loop),
    Right("build_x", "computed in float32", lambda E, PE, ids: E.float()[ids] + PE.float()[: len(ids)]),
    Right("scaled_scores", "matrix product", lambda Q, K: Q @ K.T / K.shape[-1] ** 0.5),
    Right("scaled_scores", "einsum", lambda Q, K: torch.einsum("id,jd->ij", Q, K) / math.sqrt(K.shape[-1])),
    Right("scaled_scores", "python loops over query and key", scores_loop),
    Right("causal_softmax", "masked_fill with -inf then softmax",
          lambda s: s.masked_fill(future(s), float("-inf")).softmax(-1)),
    Right("causal_softmax", "torch.where over a tril mask", causal_softmax_where),
    Right("causal_softmax", "row by row over the visible prefix", causal_softmax_rows),
]

WRONG = [
    Wrong("build_x", "forgot the positional encoding", lambda E, PE, ids: E[torch.tensor(ids)],
          "positional encodings were not added"),
    Wrong("build_x", "indexed PE by token id", lambda E, PE, ids: E[torch.tensor(ids)] + PE[torch.tensor(ids)],
          "indexed by token id"),
    Wrong("build_x", "positions start at 1", lambda E, PE, ids: E[torch.tensor(ids)] + PE[1:len(ids) + 1],
          "PE of the wrong position"),
    Wrong("build_x", "multiplied E and PE", lambda E, PE, ids: E[torch.tensor(ids)] * PE[: len(ids)], "multiplied"),
    Wrong("build_x", "concatenated E and PE", lambda E, PE, ids: torch.cat([E[torch.tensor(ids)], PE[: len(ids)]], -1),
          "should have shape (4, 3)"),
    Wrong("build_x", "only the first token", lambda E, PE, ids: E[torch.tensor(ids)][:1] + PE[:1],
          "should have shape (4, 3)"),
    Wrong("build_x", "hard-coded four tokens", lambda E, PE, ids: E[torch.tensor(ids)][:4] + PE[:4],
          "should have shape (6, 3)"),
    Wrong("build_x", "returned a list of rows", lambda E, PE, ids: list(E[torch.tensor(ids)] + PE[: len(ids)]),
          "should be a torch.Tensor"),
    Wrong("build_x", "calls labkit's worked example", lambda E, PE, ids: ref.build_x(E, PE, ids),
          "`build_x`", calls="labkit.worked_example.build_x"),
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
          "`scaled_scores`", calls="labkit.worked_example.scaled_scores"),
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
          "`causal_softmax`", calls="labkit.worked_example.causal_softmax"),
]
