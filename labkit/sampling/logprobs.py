"""Log-probabilities a request can ask for: `logprobs` (per generated token) and `prompt_logprobs`.

Shaped as vLLM returns them: one dict per position, token id -> `Logprob(logprob, rank,
decoded_token)`, holding the token actually there (sampled, or the prompt's) and the `k` most
likely tokens. rank 1 is the most likely token; a token's rank counts the tokens at least as
likely as it (itself included), so ties share the worse rank.

They are vLLM's default "raw" logprobs: log_softmax of the model's fp32 logits *before* any
processing (no temperature, penalties, bias or filters), so they describe the model, not the
sampler, and they agree with `torch.log_softmax(model(...).logits.float(), -1)` from transformers.
"""

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class Logprob:
    logprob: float
    rank: int | None = None
    decoded_token: str | None = None


PositionLogprobs = dict[int, Logprob]


def compute_logprobs(logits: torch.Tensor, token_ids: Sequence[int], num_top: Sequence[int],
                     decode: Callable[[int], str]) -> list[PositionLogprobs]:
    """One dict per row of `logits` `[rows, vocab]`: `token_ids[row]` first, then the row's `num_top[row]` best.

    `decode(token_id)` gives a token's text (the engine passes its tokenizer's).
    """
    if logits.dim() != 2 or not len(token_ids) == len(num_top) == logits.shape[0]:
        raise ValueError(f"logits {tuple(logits.shape)} need one token id and one top count per row, "
                         f"got {len(token_ids)} and {len(num_top)}")
    logprobs = torch.log_softmax(logits.float(), dim=-1)
    chosen = torch.tensor(list(token_ids), dtype=torch.int64, device=logits.device)
    chosen_logprobs = logprobs.gather(-1, chosen.unsqueeze(-1))
    ranks = (logprobs >= chosen_logprobs).sum(-1).tolist()
    k = max(num_top, default=0)
    top_values, top_ids = logprobs.topk(k, dim=-1) if k else (logprobs[:, :0], chosen[:0].expand(len(chosen), 0))
    top_values, top_ids = top_values.tolist(), top_ids.tolist()
    chosen_logprobs = chosen_logprobs.squeeze(-1).tolist()
    result = []
    for row, token in enumerate(token_ids):
        position = {token: Logprob(chosen_logprobs[row], ranks[row], decode(token))}
        for rank, (top, value) in enumerate(zip(top_ids[row][:num_top[row]], top_values[row], strict=False), 1):
            position.setdefault(top, Logprob(value, rank, decode(top)))
        result.append(position)
    return result
