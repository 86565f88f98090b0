"""Attention in plain torch: the readable references the kernels and the engine are checked against.

Shapes follow the flat-batch convention of `AttentionMetadata`: q [T, num_heads, head_dim],
k/v [T, num_kv_heads, head_dim], and with GQA each group of num_heads // num_kv_heads query heads
shares one KV head. "Causal with a context" means: a sequence with context length Lk and Lq new
tokens puts its queries at positions Lk - Lq .. Lk - 1, and query i sees keys 0 .. Lk - Lq + i.
The one-sequence references compute in float32 whatever the input dtype; the batched paths call
torch's SDPA, which accumulates in float32. Outputs have q's dtype.
"""

import math

import torch
import torch.nn.functional as F


def _group_size(num_heads: int, num_kv_heads: int) -> int:
    if num_heads % num_kv_heads:
        raise ValueError(f"num_heads ({num_heads}) must be a multiple of num_kv_heads ({num_kv_heads})")
    return num_heads // num_kv_heads


def naive_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool = True) -> torch.Tensor:
    """One sequence: softmax(q k^T / sqrt(D) + causal mask) v, with q [Lq,H,D], k/v [Lk,Hkv,D]."""
    lq, num_heads, d = q.shape
    lk = k.shape[0]
    group = _group_size(num_heads, k.shape[1])
    kf = k.float().repeat_interleave(group, dim=1)  # [Lk, H, D]
    vf = v.float().repeat_interleave(group, dim=1)
    scores = torch.einsum("qhd,khd->hqk", q.float(), kf) / math.sqrt(d)
    if causal:
        q_pos = torch.arange(lk - lq, lk).unsqueeze(1)
        scores = scores.masked_fill(torch.arange(lk) > q_pos, float("-inf"))
    return torch.einsum("hqk,khd->qhd", scores.softmax(-1), vf).to(q.dtype)


def online_softmax_attention(query: torch.Tensor, key_blocks: list[torch.Tensor],
                             value_blocks: list[torch.Tensor]) -> torch.Tensor:
    """One query token [H, D] against K/V given as blocks [block_size, H, D], one block at a time.

    Keeps per head a running max m, a running sum denom of exp(score - m) and a running weighted sum
    acc of values; when a block raises the max, denom and acc are rescaled by exp(m_old - m_new).
    The result equals softmax over all keys at once, but no block needs the others in memory.
    """
    d = query.shape[-1]
    q = query.float()
    m = torch.full(q.shape[:1], float("-inf"))
    denom = torch.zeros(q.shape[:1])
    acc = torch.zeros(q.shape)
    for kb, vb in zip(key_blocks, value_blocks, strict=True):
        s = torch.einsum("hd,bhd->hb", q, kb.float()) / math.sqrt(d)  # [H, block]
        m_new = torch.maximum(m, s.max(-1).values)
        p = torch.exp(s - m_new[:, None])
        alpha = torch.exp(m - m_new)
        denom = alpha * denom + p.sum(-1)
        acc = alpha[:, None] * acc + torch.einsum("hb,bhd->hd", p, vb.float())
        m = m_new
    return (acc / denom[:, None]).to(query.dtype)


def gather_kv(cache: torch.Tensor, block_tables: torch.Tensor, max_len: int | None = None) -> torch.Tensor:
    """Gather each sequence's tokens out of a block pool [N, block_size, H, D], in one indexing op.

    block_tables [B, M] (-1 = unused). Returns [B, max_len, H, D] (default M * block_size); rows past a
    sequence's length hold whatever the blocks hold and must be masked by the caller.
    """
    bs = cache.shape[1]
    num_blocks = block_tables.shape[1] if max_len is None else -(-max_len // bs)
    tables = block_tables[:, :num_blocks].clamp(min=0).long()
    # index_select on whole blocks (one row each) is a plain row copy, several times faster on a CPU
    # than the equivalent advanced indexing cache[tables].
    gathered = cache.flatten(1).index_select(0, tables.flatten())  # [B * num_blocks, bs * H * D]
    gathered = gathered.view(tables.shape[0], num_blocks * bs, *cache.shape[2:])
    return gathered if max_len is None else gathered[:, :max_len]


def _padded_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, q_lens: torch.Tensor,
                      k_lens: torch.Tensor) -> torch.Tensor:
    """Causal attention over a padded batch: q [B, Lq, H, D], k/v [B, Lk, Hkv, D] -> [B, Lq, H, D].

    Sequence b's Lq_b queries sit at the end of its Lk_b keys; a boolean mask says which keys each
    query sees. The query heads that share a KV head are folded into the query rows (the grouped-query
    trick decode kernels use), so torch's fused SDPA reads each KV head once, through strides, with no
    repeated or copied K/V. Padded rows come out as finite junk.
    """
    b, lq, num_heads, d = q.shape
    lk, num_kv_heads = k.shape[1], k.shape[2]
    group = _group_size(num_heads, num_kv_heads)
    q_rows = q.view(b, lq, num_kv_heads, group, d).permute(0, 2, 1, 3, 4).reshape(b, num_kv_heads, lq * group, d)
    q_pos = (k_lens - q_lens)[:, None] + torch.arange(lq, device=q.device)  # [B, Lq]
    k_pos = torch.arange(lk, device=q.device)
    visible = (k_pos[None, None, :] <= q_pos[:, :, None]) & (k_pos[None, None, :] < k_lens[:, None, None])
    visible = visible.repeat_interleave(group, dim=1)[:, None]  # [B, 1, Lq * group, Lk]
    out = F.scaled_dot_product_attention(q_rows, k.transpose(1, 2), v.transpose(1, 2), attn_mask=visible)
    return out.view(b, num_kv_heads, lq, group, d).permute(0, 2, 1, 3, 4).reshape(b, lq, num_heads, d)


def _flat_to_padded_index(cu_seqlens: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """For a flat batch: each token's sequence index and position within its sequence."""
    lens = cu_seqlens.diff()
    seq_index = torch.repeat_interleave(torch.arange(lens.numel(), device=lens.device), lens)
    pos = torch.arange(int(cu_seqlens[-1]), device=lens.device) - cu_seqlens[seq_index]
    return seq_index, pos


def varlen_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_seqlens: torch.Tensor,
                     max_seqlen: int) -> torch.Tensor:
    """Causal attention of a flat batch of whole sequences (no cache): q [T,H,D], k/v [T,Hkv,D]."""
    seq_index, pos = _flat_to_padded_index(cu_seqlens)
    lens, b = cu_seqlens.diff(), cu_seqlens.numel() - 1
    pad = lambda x: x.new_zeros(b, max_seqlen, *x.shape[1:]).index_put_((seq_index, pos), x)  # noqa: E731
    out = _padded_attention(pad(q), pad(k), pad(v), lens, lens)
    return out[seq_index, pos].to(q.dtype)


def paged_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_tables: torch.Tensor,
                    cu_seqlens_q: torch.Tensor, cu_seqlens_k: torch.Tensor, max_seqlen_q: int,
                    max_seqlen_k: int) -> torch.Tensor:
    """Varlen causal attention over paged KV: prefill, prefill over a cached prefix, chunked prefill
    and decode (Lq = 1) in one batch. q [T, H, D]; caches [N, block_size, Hkv, D], already holding
    the new tokens' K/V; block_tables [B, M]. Vectorized: one gather, one padded attention; a batch
    mixing decodes with longer queries runs as two such groups, so decode rows are not padded to
    the longest prompt."""
    q_lens, k_lens = cu_seqlens_q.diff(), cu_seqlens_k.diff()
    is_decode = q_lens == 1
    if bool(is_decode.any()) and not bool(is_decode.all()):
        seq_index, _ = _flat_to_padded_index(cu_seqlens_q)
        out = torch.empty_like(q)
        for group in (is_decode, ~is_decode):
            tokens = group[seq_index]
            cu_q = torch.nn.functional.pad(q_lens[group].cumsum(0), (1, 0))
            cu_k = torch.nn.functional.pad(k_lens[group].cumsum(0), (1, 0))
            out[tokens] = paged_attention(q[tokens], k_cache, v_cache, block_tables[group], cu_q, cu_k,
                                          int(q_lens[group].max()), int(k_lens[group].max()))
        return out
    seq_index, pos = _flat_to_padded_index(cu_seqlens_q)
    q_pad = q.new_zeros(q_lens.numel(), max_seqlen_q, *q.shape[1:]).index_put_((seq_index, pos), q)
    k_pad = gather_kv(k_cache, block_tables, max_seqlen_k)
    v_pad = gather_kv(v_cache, block_tables, max_seqlen_k)
    out = _padded_attention(q_pad, k_pad, v_pad, q_lens, k_lens)
    return out[seq_index, pos].to(q.dtype)


def paged_decode_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                           block_tables: torch.Tensor, context_lens: torch.Tensor) -> torch.Tensor:
    """One new token per sequence, q [B, H, D], attending to its whole context by gather."""
    b = q.shape[0]
    k_pad = gather_kv(k_cache, block_tables, int(context_lens.max()))
    v_pad = gather_kv(v_cache, block_tables, int(context_lens.max()))
    ones = torch.ones(b, dtype=context_lens.dtype, device=q.device)
    return _padded_attention(q[:, None], k_pad, v_pad, ones, context_lens)[:, 0].to(q.dtype)
