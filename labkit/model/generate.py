"""Greedy generation, with or without a contiguous KV cache (§10.1–10.2 of the book).

Without a cache every step reruns the whole sequence so far (O(n) tokens per step, O(n^2) in all);
with one, the prompt runs once (prefill) and every later step runs only the newest token (decode).
Both give the same tokens; Lab 05 measures the difference in time.
"""

import torch

from labkit.attention.dense import dense_attention
from labkit.attention.metadata import AttentionMetadata


def step_metadata(batch: int, new: int, cached: int, device) -> AttentionMetadata:
    """Metadata for `batch` equal sequences that each add `new` tokens after `cached` ones."""
    cu_q = torch.arange(batch + 1, device=device) * new
    cu_k = torch.arange(batch + 1, device=device) * (cached + new)
    return AttentionMetadata(cu_q, cu_k, new, cached + new)


def last_token_logits(model, ids: torch.Tensor, cached: int, backend) -> torch.Tensor:
    """Run ids [B, n] at positions cached..cached+n-1; logits [B, vocab] of each last token."""
    B, n = ids.shape
    positions = torch.arange(cached, cached + n, device=ids.device).repeat(B)
    meta = step_metadata(B, n, cached, ids.device)
    hidden = model.forward_hidden(ids.reshape(-1), positions, meta, backend)
    return model.compute_logits(hidden.view(B, n, -1)[:, -1])


@torch.no_grad()
def generate(model, prompt_ids, max_new_tokens: int, kv_cache=None,
             eos_token_id: int | None = None) -> torch.Tensor:
    """Greedy continuation of one prompt (1-D ids) or of equal-length prompts ([B, n] ids).

    kv_cache: None to recompute everything each step, or an empty KVCache / PreallocatedKVCache.
    Stops after max_new_tokens, or once every sequence has produced eos_token_id (a sequence that
    finished early is padded with it). Returns the new tokens, [n_new] or [B, n_new].
    """
    ids = torch.as_tensor(prompt_ids, dtype=torch.long, device=model.device)
    single = ids.dim() == 1
    if single:
        ids = ids[None]
    if ids.dim() != 2 or ids.shape[1] == 0:
        raise ValueError(f"prompt_ids must be a non-empty 1-D sequence or a [batch, n] tensor, "
                         f"got shape {tuple(ids.shape)}")
    if not isinstance(max_new_tokens, int) or max_new_tokens < 0:
        raise ValueError(f"max_new_tokens must be a non-negative integer, got {max_new_tokens!r}")
    if kv_cache is not None and kv_cache.seq_len != 0:
        raise ValueError(f"kv_cache must start empty, it already holds {kv_cache.seq_len} tokens")

    new_tokens, finished = [], torch.zeros(ids.shape[0], dtype=torch.bool, device=ids.device)
    for _ in range(max_new_tokens):
        if kv_cache is None:  # recompute the whole sequence so far
            logits = last_token_logits(model, ids, 0, dense_attention)
        elif not new_tokens:  # prefill: the prompt, once
            logits = last_token_logits(model, ids, 0, kv_cache)
        else:  # decode: only the newest token; the cache holds everything before it
            logits = last_token_logits(model, ids[:, -1:], ids.shape[1] - 1, kv_cache)
        token = logits.argmax(dim=-1)
        if eos_token_id is not None:
            token = torch.where(finished, eos_token_id, token)
            finished |= token == eos_token_id
        new_tokens.append(token)
        ids = torch.cat([ids, token[:, None]], dim=1)
        if eos_token_id is not None and bool(finished.all()):
            break
    out = torch.stack(new_tokens, dim=1) if new_tokens else ids.new_zeros(ids.shape[0], 0)
    return out[0] if single else out
