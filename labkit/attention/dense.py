"""The default attention backend: causal attention over a varlen flat batch, with no KV cache.

Every call sees whole sequences (a prefill with nothing cached), so each sequence attends only to
its own new tokens. torch's scaled_dot_product_attention does the arithmetic; this module only cuts
the flat batch into sequences and expands grouped KV heads.
"""

import torch
import torch.nn.functional as F

from labkit.attention.metadata import AttentionMetadata


def causal_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """Attention of the last Tq of Tk positions, each query seeing keys up to its own position.

    q: [..., Hq, Tq, D]; k, v: [..., Hkv, Tk, D] with Tq <= Tk and Hq a multiple of Hkv (grouped-query
    attention: each KV head serves Hq/Hkv query heads). Queries are aligned to the *end* of the keys,
    so a decode step (Tq = 1) sees everything and a prefill (Tq = Tk) is the usual lower triangle.
    """
    Tq, Tk = q.shape[-2], k.shape[-2]
    if Tq > Tk:
        raise ValueError(f"more queries ({Tq}) than keys ({Tk}): the keys must include the new tokens")
    group = q.shape[-3] // k.shape[-3]
    if group > 1:
        k, v = k.repeat_interleave(group, dim=-3), v.repeat_interleave(group, dim=-3)
    if Tq == Tk:
        return F.scaled_dot_product_attention(q, k, v, is_causal=True)
    if Tq == 1:
        return F.scaled_dot_product_attention(q, k, v)
    # Query i sits at position Tk - Tq + i and may see keys 0..Tk - Tq + i.
    allowed = torch.ones(Tq, Tk, dtype=torch.bool, device=q.device).tril(diagonal=Tk - Tq)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=allowed)


def dense_attention(layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                    meta: AttentionMetadata) -> torch.Tensor:
    """AttentionBackend with no cache: each sequence of the flat batch attends causally to itself."""
    if not torch.equal(meta.cu_seqlens_q, meta.cu_seqlens_k):
        raise ValueError(
            "dense_attention keeps no KV cache, so every sequence must be given whole "
            "(cu_seqlens_q must equal cu_seqlens_k); use a KV-cache backend for decode steps"
        )
    if int(meta.cu_seqlens_q[-1]) != q.shape[0]:
        raise ValueError(f"metadata covers {int(meta.cu_seqlens_q[-1])} tokens but q has {q.shape[0]}")
    bounds = meta.cu_seqlens_q.tolist()
    out = torch.empty_like(q)
    for start, end in zip(bounds[:-1], bounds[1:], strict=True):
        # [T, H, D] -> [H, T, D] for SDPA, and back.
        out[start:end] = causal_attention(
            q[start:end].transpose(0, 1), k[start:end].transpose(0, 1), v[start:end].transpose(0, 1)
        ).transpose(0, 1)
    return out
