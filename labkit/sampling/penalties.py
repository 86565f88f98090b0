"""Penalties that discourage repeating tokens, applied to raw logits before temperature and filters.

- repetition_penalty (Keskar et al. 2019, as transformers and vLLM apply it): for every token that
  occurs in the prompt or the output so far, a positive logit is divided by the penalty and a
  negative one multiplied by it, so a penalty > 1 always makes the token less likely.
- presence_penalty and frequency_penalty (OpenAI's definition, as vLLM applies it): over the
  *generated* tokens only, subtract presence_penalty once if the token occurred and
  frequency_penalty times the number of times it occurred.

Histories arrive as padded id tensors `[batch, length]` with -1 as padding, so a whole batch of
requests with different penalties is handled by a scatter and a few element-wise operations.
"""

import torch

PAD_ID = -1


def token_counts(token_ids: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """How often each vocabulary entry occurs in each row of `token_ids` (padded with -1): `[batch, vocab]`."""
    if token_ids.numel() and (token_ids.max() >= vocab_size or token_ids.min() < PAD_ID):
        raise ValueError(f"token ids must be in [0, {vocab_size}) (or -1 for padding)")
    counts = torch.zeros(token_ids.shape[0], vocab_size + 1, dtype=torch.int64, device=token_ids.device)
    counts.scatter_add_(1, token_ids + 1, torch.ones_like(token_ids))  # column 0 collects the padding
    return counts[:, 1:]


def apply_penalties(
    logits: torch.Tensor,
    prompt_token_ids: torch.Tensor,
    output_token_ids: torch.Tensor,
    repetition_penalty: torch.Tensor,
    presence_penalty: torch.Tensor,
    frequency_penalty: torch.Tensor,
) -> torch.Tensor:
    """Penalized copy of `logits` `[batch, vocab]`; each penalty is a tensor `[batch]` (1, 0, 0 = off)."""
    vocab_size = logits.shape[-1]
    output_counts = token_counts(output_token_ids, vocab_size)
    seen = (token_counts(prompt_token_ids, vocab_size) + output_counts) > 0
    repetition = repetition_penalty.to(logits.dtype).unsqueeze(-1)
    penalized = torch.where(logits > 0, logits / repetition, logits * repetition)
    logits = torch.where(seen, penalized, logits)
    logits = logits - frequency_penalty.to(logits.dtype).unsqueeze(-1) * output_counts.to(logits.dtype)
    return logits - presence_penalty.to(logits.dtype).unsqueeze(-1) * (output_counts > 0).to(logits.dtype)
