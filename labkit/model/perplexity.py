"""Perplexity: how surprised a model is by a text, exp of its mean next-token cross-entropy.

The logits at position t predict token t + 1, so a text of T tokens gives T - 1 predictions: the
first token is never scored, and the last position's logits have nothing to score.
"""

import torch

from labkit.model.decoder import DecoderModel


def perplexity_from_logits(logits: torch.Tensor, token_ids: torch.Tensor) -> float:
    """exp(mean -log p(token_ids[t + 1] | logits[t])) over t = 0 .. T - 2, in float64."""
    if logits.dim() != 2 or token_ids.dim() != 1 or logits.shape[0] != token_ids.shape[0]:
        raise ValueError(f"expected logits [T, vocab] and token_ids [T], got {tuple(logits.shape)} "
                         f"and {tuple(token_ids.shape)}")
    if token_ids.shape[0] < 2:
        raise ValueError("perplexity needs at least 2 tokens: the first one is never predicted")
    log_probs = torch.log_softmax(logits[:-1].double(), dim=-1)
    targets = token_ids[1:].to(device=logits.device, dtype=torch.long)
    nll = -log_probs.gather(1, targets[:, None]).mean()
    return float(torch.exp(nll))


@torch.inference_mode()
def perplexity(model: DecoderModel, token_ids: list[int] | torch.Tensor) -> float:
    """The model's perplexity on one text, in a single causal forward pass."""
    ids = torch.as_tensor(token_ids, dtype=torch.long, device=model.device)
    return perplexity_from_logits(model(ids), ids)
