"""Logit processors that decide which tokens are possible at all: allowed_token_ids, logit_bias, min_tokens.

They run on the raw logits before the penalties and before greedy's argmax (vLLM's order), so a
masked token cannot be picked even at temperature 0. All three become one additive tensor
`[batch, vocab]`: the biases, and -inf on every masked entry (a token outside allowed_token_ids,
or an EOS / stop token while fewer than min_tokens tokens were generated). Rows that use none of
them are zero, and a batch where no row uses one builds nothing.
"""

from collections.abc import Sequence

import torch

from labkit.sampling.params import SamplingParams

NEG_INF = float("-inf")


def min_tokens_banned(params: SamplingParams, num_output_tokens: int, eos_token_id: int | None) -> list[int]:
    """Tokens that may not be sampled yet: stop token ids and EOS (unless ignored) until min_tokens is reached."""
    if num_output_tokens >= params.min_tokens:
        return []
    eos = [] if eos_token_id is None or params.ignore_eos else [eos_token_id]
    return list(params.stop_token_ids) + eos


def logit_offsets(params: Sequence[SamplingParams], num_output_tokens: Sequence[int], eos_token_id: int | None,
                  vocab_size: int) -> torch.Tensor | None:
    """The additive tensor `[batch, vocab]` (float32, on the CPU) of the three processors, or None if no row
    needs one."""
    if not any(p.logit_bias or p.allowed_token_ids is not None or n < p.min_tokens
               for p, n in zip(params, num_output_tokens, strict=True)):
        return None  # asked first, in one pass: the common case, every step, for every running request
    banned = [min_tokens_banned(p, n, eos_token_id) for p, n in zip(params, num_output_tokens, strict=True)]
    if not any(p.logit_bias or p.allowed_token_ids is not None for p in params) and not any(banned):
        return None
    offsets = torch.zeros(len(params), vocab_size, dtype=torch.float32)
    for row, (p, ban) in enumerate(zip(params, banned, strict=True)):
        if p.allowed_token_ids is not None:
            allowed = torch.tensor(p.allowed_token_ids, dtype=torch.int64)
            offsets[row] = NEG_INF
            offsets[row, allowed] = 0.0
        if p.logit_bias:
            tokens = torch.tensor(list(p.logit_bias), dtype=torch.int64)
            offsets[row, tokens] += torch.tensor(list(p.logit_bias.values()), dtype=torch.float32)
        if ban:
            offsets[row, torch.tensor(ban, dtype=torch.int64)] = NEG_INF
    return offsets
