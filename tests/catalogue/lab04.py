"""Lab 04: decoding one token with a KV cache."""

import torch
import torch.nn.functional as F

from catalogue import Right, Wrong
from labkit import worked_example as ref


def attend(keys, values, q, scale=True, mask=False):
    scores = q @ keys.T / (keys.shape[-1] ** 0.5 if scale else 1.0)
    if mask:
        scores = scores.masked_fill(torch.ones_like(scores, dtype=torch.bool).triu(1), float("-inf"))
    return scores.softmax(-1) @ values


def appended(cache_k, cache_v, k_new, v_new):
    return torch.cat([cache_k, k_new]), torch.cat([cache_v, v_new])


def append_then_attend(cache_k, cache_v, q, k_new, v_new):
    keys, values = appended(cache_k, cache_v, k_new, v_new)
    return keys, values, attend(keys, values, q)


def append_then_sdpa(cache_k, cache_v, q, k_new, v_new):
    keys, values = torch.vstack([cache_k, k_new]), torch.vstack([cache_v, v_new])
    return keys, values, F.scaled_dot_product_attention(q[None], keys[None], values[None])[0]


def append_then_manual_softmax(cache_k, cache_v, q, k_new, v_new):
    keys, values = appended(cache_k, cache_v, k_new, v_new)
    scores = (q * keys).sum(-1) / keys.shape[1] ** 0.5
    weights = (scores - scores.max()).exp()
    return keys, values, (weights / weights.sum())[None] @ values


RIGHT = [
    Right("embed_token", "row plus PE row, unsqueezed", lambda E, PE, t, p: (E[t] + PE[p]).unsqueeze(0)),
    Right("embed_token", "slices keep the row dimension", lambda E, PE, t, p: E[t:t + 1] + PE[p:p + 1]),
    Right("embed_token", "computed in float32", lambda E, PE, t, p: (E[t] + PE[p]).float()[None]),
    Right("append_and_attend", "cat then matmul softmax", append_then_attend),
    Right("append_and_attend", "vstack then SDPA", append_then_sdpa),
    Right("append_and_attend", "manual stable softmax over the row", append_then_manual_softmax),
]

WRONG = [
    Wrong("embed_token", "forgot the positional encoding", lambda E, PE, t, p: E[t][None],
          "positional encoding was not added"),
    Wrong("embed_token", "PE one position early", lambda E, PE, t, p: (E[t] + PE[p - 1])[None], "off by one"),
    Wrong("embed_token", "PE one position late", lambda E, PE, t, p: (E[t] + PE[p + 1])[None], "off by one"),
    Wrong("embed_token", "every decoded token at position 0", lambda E, PE, t, p: (E[t] + PE[0])[None],
          "PE[0] was used"),
    Wrong("embed_token", "indexed PE by token id", lambda E, PE, t, p: (E[t] + PE[t])[None], "indexed by token id"),
    Wrong("embed_token", "returned a flat vector", lambda E, PE, t, p: E[t] + PE[p], "not a flat vector"),
    Wrong("embed_token", "rebuilt every row up to the position", lambda E, PE, t, p: E[[t] * (p + 1)] + PE[: p + 1],
          "should have shape (1, 3)"),
    Wrong("embed_token", "calls labkit's worked example", lambda E, PE, t, p: ref.build_x(E, PE, [t], start=p),
          "`build_x`", calls="labkit.worked_example.build_x"),
    Wrong("append_and_attend", "replaced the cache with the new row",
          lambda ck, cv, q, k, v: (k, v, attend(k, v, q)), "replaced instead of appended"),
    Wrong("append_and_attend", "appended along the feature axis",
          lambda ck, cv, q, k, v: (torch.cat([ck, k.expand_as(ck)], 1), torch.cat([cv, v.expand_as(cv)], 1), q),
          "along the feature axis"),
    Wrong("append_and_attend", "new row in front",
          lambda ck, cv, q, k, v: (torch.cat([k, ck]), torch.cat([v, cv]), attend(torch.cat([k, ck]),
                                                                                  torch.cat([v, cv]), q)),
          "went in front"),
    Wrong("append_and_attend", "attended before appending",
          lambda ck, cv, q, k, v: (*appended(ck, cv, k, v), attend(ck, cv, q)), "old cache only"),
    Wrong("append_and_attend", "forgot the sqrt(d_k) scale",
          lambda ck, cv, q, k, v: (*appended(ck, cv, k, v), attend(*appended(ck, cv, k, v), q, scale=False)),
          "not divided by sqrt(d_k)"),
    Wrong("append_and_attend", "kept the prefill causal mask",
          lambda ck, cv, q, k, v: (*appended(ck, cv, k, v), attend(*appended(ck, cv, k, v), q, mask=True)),
          "prefill-style causal mask"),
    Wrong("append_and_attend", "returned only the cache", lambda ck, cv, q, k, v: appended(ck, cv, k, v),
          "return three things"),
    Wrong("append_and_attend", "returned the attention weights, not the output",
          lambda ck, cv, q, k, v: (*appended(ck, cv, k, v), (q @ appended(ck, cv, k, v)[0].T / 3 ** 0.5).softmax(-1)),
          "should have shape (1, 3)"),
    Wrong("append_and_attend", "calls labkit's worked example",
          lambda ck, cv, q, k, v: (*appended(ck, cv, k, v), ref.attend(q, *appended(ck, cv, k, v))[2]),
          "`attend`",
          calls="labkit.worked_example.attend"),
]
