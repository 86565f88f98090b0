"""Logit transforms: temperature, top-k, top-p and min-p, with transformers' exact semantics.

Each function takes logits `[batch, vocab]` and one parameter per row (a tensor `[batch]`), so the
sampler filters a batch of requests with different settings in a few tensor operations and no
Python loop over rows. A row whose parameter has its "off" value passes through unchanged.
Removed entries become -inf (their probability after softmax is exactly 0); inputs are never
modified in place.

The rules are those of transformers' logits warpers, including their corner cases:
- top-k keeps every token tied with the k-th largest logit (so ties can keep more than k);
- top-p removes a token when the probability mass of the tokens *below or equal to it in the
  ascending sort* is <= 1 - top_p, and always keeps the most likely token;
- min-p removes tokens whose probability is below min_p * (max probability), keeping the top one;
- they apply in the order temperature, top-k, top-p, min-p, each on the previous one's output
  (so top-p's probabilities are renormalized over what top-k kept).
"""

import torch

from labkit.sampling.params import SamplingParams

NEG_INF = float("-inf")


def apply_temperature(logits: torch.Tensor, temperature: torch.Tensor) -> torch.Tensor:
    """Divide each row by its temperature (> 0): < 1 sharpens the distribution, > 1 flattens it."""
    return logits / temperature.to(logits.dtype).unsqueeze(-1)


def apply_top_k(logits: torch.Tensor, top_k: torch.Tensor, max_top_k: int | None = None) -> torch.Tensor:
    """Keep the top_k largest logits of each row (and any tied with the k-th); top_k <= 0 keeps all.

    `max_top_k`: top_k's largest entry, if the caller knows it on the host (the sampler does): reading
    it from a tensor on a GPU waits for everything queued there."""
    vocab_size = logits.shape[-1]
    enabled = top_k > 0
    k = torch.where(enabled, top_k, 1).clamp(max=vocab_size).to(torch.long)
    # One topk for the largest k in the batch (cheaper than sorting the vocabulary), then each row's k-th.
    largest_k = int(k.max()) if max_top_k is None else min(max(max_top_k, 1), vocab_size)
    largest = logits.topk(largest_k, dim=-1).values
    kth_largest = largest.gather(-1, (k - 1).unsqueeze(-1))
    remove = (logits < kth_largest) & enabled.unsqueeze(-1)
    return logits.masked_fill(remove, NEG_INF)


def apply_top_p(logits: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """Keep each row's smallest set of most likely tokens whose probability reaches top_p; 1 keeps all."""
    sorted_logits, sorted_index = logits.sort(dim=-1, descending=False)
    cumulative = sorted_logits.softmax(dim=-1).cumsum(dim=-1)
    # The threshold is formed in float64 and then rounded once, as `cumsum <= 1 - top_p` does with
    # a Python float: rounding top_p first would move the boundary by an ulp.
    threshold = (1 - top_p.to(torch.float64)).to(cumulative.dtype).unsqueeze(-1)
    remove_sorted = cumulative <= threshold
    remove_sorted[..., -1] = False  # the most likely token always survives
    remove_sorted &= (top_p < 1).unsqueeze(-1)
    remove = remove_sorted.scatter(-1, sorted_index, remove_sorted)
    return logits.masked_fill(remove, NEG_INF)


def apply_min_p(logits: torch.Tensor, min_p: torch.Tensor) -> torch.Tensor:
    """Drop tokens less likely than min_p times the row's most likely token; 0 keeps all."""
    probs = logits.softmax(dim=-1)
    top_prob = probs.amax(dim=-1, keepdim=True)
    remove = probs < min_p.to(probs.dtype).unsqueeze(-1) * top_prob
    remove.scatter_(-1, probs.argmax(dim=-1, keepdim=True), False)  # keep at least one token
    return logits.masked_fill(remove, NEG_INF)


def keep_argmax(logits: torch.Tensor) -> torch.Tensor:
    """Temperature 0 (greedy): only the first most likely token of each row survives."""
    keep = torch.zeros_like(logits, dtype=torch.bool).scatter_(-1, logits.argmax(dim=-1, keepdim=True), True)
    return logits.masked_fill(~keep, NEG_INF)


def filter_logits(
    logits: torch.Tensor, temperature: float = 1.0, top_k: int = 0, top_p: float = 1.0, min_p: float = 0.0
) -> torch.Tensor:
    """The logits a sampler would draw from: temperature, then top-k, top-p and min-p, as transformers does.

    `logits` is `[vocab]` or `[batch, vocab]`; one setting applies to every row. Removed entries are
    -inf and the result is a new tensor. temperature 0 means greedy: only the argmax survives.
    top_k 0 or -1 disables top-k. Bad settings raise ValueError (see SamplingParams).
    """
    SamplingParams(temperature=temperature, top_k=top_k, top_p=top_p, min_p=min_p)  # validates
    if not isinstance(logits, torch.Tensor) or logits.dim() not in (1, 2) or not logits.is_floating_point():
        raise ValueError("logits must be a floating-point tensor of shape [vocab] or [batch, vocab]")
    rows = logits.unsqueeze(0) if logits.dim() == 1 else logits
    if temperature == 0:
        filtered = keep_argmax(rows)
    else:
        per_row = dict(device=rows.device, dtype=torch.float64)
        filtered = apply_temperature(rows, torch.full((len(rows),), temperature, **per_row))
        filtered = apply_top_k(filtered, torch.full((len(rows),), top_k, device=rows.device))
        filtered = apply_top_p(filtered, torch.full((len(rows),), top_p, **per_row))
        filtered = apply_min_p(filtered, torch.full((len(rows),), min_p, **per_row))
    return filtered.squeeze(0) if logits.dim() == 1 else filtered
