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


def gqa_group_size(num_heads: int, num_kv_heads: int) -> int:
    if num_heads % num_kv_heads:
        raise ValueError(f"num_heads ({num_heads}) must be a multiple of num_kv_heads ({num_kv_heads})")
    return num_heads // num_kv_heads


def naive_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool = True) -> torch.Tensor:
    """One sequence: softmax(q k^T / sqrt(D) + causal mask) v, with q [Lq,H,D], k/v [Lk,Hkv,D]."""
    lq, num_heads, d = q.shape
    lk = k.shape[0]
    group = gqa_group_size(num_heads, k.shape[1])
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
    gathered = _gather_blocks(cache, tables.flatten(), tables.shape[0])
    return gathered if max_len is None else gathered[:, :max_len]


def _gather_blocks(cache: torch.Tensor, block_ids: torch.Tensor, num_seqs: int,
                   out: torch.Tensor | None = None) -> torch.Tensor:
    """cache [N, bs, H, D] and num_seqs * M block ids -> [num_seqs, M * bs, H, D], into `out` if given.

    index_select of whole blocks (one row each) is a plain row copy, several times faster on a CPU
    than the equivalent advanced indexing cache[tables]."""
    rows = torch.index_select(cache.flatten(1), 0, block_ids, out=out)
    return rows.view(num_seqs, -1, *cache.shape[2:])


def _flat_to_padded_index(cu_seqlens: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """For a flat batch: each token's sequence index and position within its sequence."""
    lens = cu_seqlens.diff()
    seq_index = torch.repeat_interleave(torch.arange(lens.numel(), device=lens.device), lens)
    pos = torch.arange(int(cu_seqlens[-1]), device=lens.device) - cu_seqlens[seq_index]
    return seq_index, pos


def rows_as_decode_rows(cu_seqlens_q: torch.Tensor, cu_seqlens_k: torch.Tensor,
                        block_tables: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Every query row of a flat batch as a decode row: (its sequence's block table [T, M], the length
    of its causal prefix [T]). Query j of a sequence with Lq new tokens and Lk keys sits at position
    Lk - Lq + j and sees Lk - Lq + j + 1 keys, all in the pool once the step's K/V are stored."""
    seq_index, pos = _flat_to_padded_index(cu_seqlens_q)
    return block_tables[seq_index], (cu_seqlens_k.diff() - cu_seqlens_q.diff())[seq_index] + pos + 1


class _PaddedGroup:
    """Sequences attended together as one padded [B, Lq] x [B, Lk] batch."""

    def __init__(self, tokens, q_lens, k_lens, block_tables, block_size: int, group: int):
        self.tokens = tokens  # rows of the flat batch in this group; None: all of them, in order
        self.num_seqs, self.max_q, self.max_k = q_lens.numel(), int(q_lens.max()), int(k_lens.max())
        cu_q = F.pad(q_lens.cumsum(0), (1, 0))
        # Equal query lengths (every decode step) need no padding: a view of q is the padded batch.
        self.needs_padding = self.num_seqs * self.max_q != int(cu_q[-1])
        self.seq_index, self.pos = _flat_to_padded_index(cu_q)
        self.block_ids = None
        self.gathered_k = self.gathered_v = None  # workspace the layers gather into, one after another
        if block_tables is not None:
            num_blocks = -(-self.max_k // block_size)
            self.block_ids = block_tables[:, :num_blocks].clamp(min=0).long().flatten()
        # Query i of a sequence with Lq queries and Lk keys sits at position Lk - Lq + i and sees keys
        # up to there; keys past Lk are padding. Rows are repeated per query head of a KV head (below).
        device = q_lens.device
        q_pos = (k_lens - q_lens)[:, None] + torch.arange(self.max_q, device=device)
        k_pos = torch.arange(self.max_k, device=device)
        visible = (k_pos <= q_pos[:, :, None]) & (k_pos < k_lens[:, None, None])
        self.visible = visible.repeat_interleave(group, dim=1)[:, None]  # [B, 1, Lq * group, Lk]

    def pad(self, x: torch.Tensor) -> torch.Tensor:
        """Flat rows [T, ...] of this group -> [B, max_q, ...]."""
        if not self.needs_padding:
            return x.view(self.num_seqs, self.max_q, *x.shape[1:])
        return x.new_zeros(self.num_seqs, self.max_q, *x.shape[1:]).index_put_((self.seq_index, self.pos), x)

    def unpad(self, x: torch.Tensor) -> torch.Tensor:
        return x.flatten(0, 1) if not self.needs_padding else x[self.seq_index, self.pos]

    def attend(self, q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor) -> torch.Tensor:
        """q: this group's flat rows; keys/values: block pools (paged) or its flat new tokens' K/V."""
        if self.block_ids is None:
            k, v = self.pad(keys), self.pad(values)
        else:
            if self.gathered_k is None:
                # Allocated once per step, not per layer: a fresh multi-MB buffer per layer costs the
                # page faults of memory the allocator hands back to the OS and maps again each time.
                self.gathered_k = keys.new_empty(self.block_ids.numel(), keys[0].numel())
                self.gathered_v = values.new_empty(self.block_ids.numel(), values[0].numel())
            k = _gather_blocks(keys, self.block_ids, self.num_seqs, self.gathered_k)[:, :self.max_k]
            v = _gather_blocks(values, self.block_ids, self.num_seqs, self.gathered_v)[:, :self.max_k]
        return self.unpad(_padded_attention(self.pad(q), k, v, self.visible))


def _padding_dominates(q_lens: torch.Tensor, k_lens: torch.Tensor) -> bool:
    """Whether a padded batch would score over twice the (query, key) pairs causal attention needs.
    The padded SDPA scores every pair of its [sequences, longest query, longest context] box; decode
    rows score only each query's causal prefix, at about half the rate (measured on one CPU core:
    one 2048-token prompt, where the box is twice the work, ran 10% faster padded; 64 prompts of
    16-96 tokens, a box 5x the work, 3x faster as rows)."""
    needed = int((q_lens * (k_lens - q_lens) + q_lens * (q_lens + 1) // 2).sum())
    return q_lens.numel() * int(q_lens.max()) * int(k_lens.max()) > 2 * needed


class PagedAttentionPlan:
    """Everything a step's attention needs besides q, k, v and the caches, computed once per step.

    Every layer of a step attends with the same lengths and block tables: which padded row each
    token lands in, which blocks to gather, which keys each query sees. Working those out takes a
    dozen small tensor ops; doing it once for all layers instead of in each is FlashInfer's plan/run
    split. Decode rows (one query each) and longer queries run as two groups when a batch mixes
    them, so a decode is never padded to the longest prompt. `block_tables=None` means nothing is
    cached: keys and values are the new tokens' own.
    """

    def __init__(self, cu_seqlens_q: torch.Tensor, cu_seqlens_k: torch.Tensor, block_tables: torch.Tensor | None,
                 block_size: int, group: int, always_read_cache: bool = False, decode_group=None,
                 every_row_as_decode: bool = False):
        q_lens, k_lens = cu_seqlens_q.diff(), cu_seqlens_k.diff()
        only_new_tokens = torch.equal(q_lens, k_lens)
        if block_tables is None and not only_new_tokens:
            raise ValueError("block_tables is None but cu_seqlens_k differs from cu_seqlens_q: "
                             "a step over cached tokens needs block tables")
        is_decode = q_lens == 1
        if every_row_as_decode and decode_group is not None and block_tables is not None and \
                not bool(is_decode.all()) and _padding_dominates(q_lens, k_lens):
            # Query j of a sequence is a decode row over the keys up to its own position, read from the
            # pool through its sequence's block table (the step's new K/V are already stored there):
            # causal attention with no padding and no mask. (A decode-only step is that already, below.)
            self.reads_cache = True
            self.groups = [decode_group(*rows_as_decode_rows(cu_seqlens_q, cu_seqlens_k, block_tables), block_size,
                                        None)]
            return
        # A batch with no cached prefix can attend over the new tokens' own K/V: no gather needed.
        self.reads_cache = block_tables is not None and (always_read_cache or not only_new_tokens)
        # `decode_group(block_tables, context_lens, block_size, tokens)`, if given, serves the decode rows
        # that read the cache instead of a padded gather (the C kernel's `cpu_decode.DecodePlan`).
        direct_decode = decode_group is not None and self.reads_cache
        if not self.reads_cache or not bool(is_decode.any()) or bool(is_decode.all()):
            if direct_decode and bool(is_decode.all()):
                self.groups = [decode_group(block_tables, k_lens, block_size, None)]
            else:
                tables = block_tables if self.reads_cache else None
                self.groups = [_PaddedGroup(None, q_lens, k_lens, tables, block_size, group)]
        else:
            seq_index, _ = _flat_to_padded_index(cu_seqlens_q)
            tokens = [torch.nonzero(rows[seq_index]).flatten() for rows in (is_decode, ~is_decode)]
            decodes = (decode_group(block_tables[is_decode], k_lens[is_decode], block_size, tokens[0])
                       if direct_decode else
                       _PaddedGroup(tokens[0], q_lens[is_decode], k_lens[is_decode], block_tables[is_decode],
                                    block_size, group))
            self.groups = [decodes, _PaddedGroup(tokens[1], q_lens[~is_decode], k_lens[~is_decode],
                                                 block_tables[~is_decode], block_size, group)]

    def run(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor | None = None,
            v_cache: torch.Tensor | None = None) -> torch.Tensor:
        """q [T, H, D] and k/v [T, Hkv, D] of the new tokens; the caches, already holding them."""
        keys, values = (k_cache, v_cache) if self.reads_cache else (k, v)
        if len(self.groups) == 1:
            return self.groups[0].attend(q, keys, values).to(q.dtype)
        out = torch.empty_like(q)
        for g in self.groups:
            out[g.tokens] = g.attend(q[g.tokens], keys, values).to(q.dtype)
        return out


def _padded_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, visible: torch.Tensor) -> torch.Tensor:
    """Attention over a padded batch: q [B, Lq, H, D], k/v [B, Lk, Hkv, D], visible [B, 1, Lq * group, Lk]
    -> [B, Lq, H, D].

    The query heads that share a KV head are folded into the query rows (the grouped-query trick
    decode kernels use), so torch's fused SDPA reads each KV head once, through strides, with no
    repeated or copied K/V. Padded rows come out as finite junk.
    """
    b, lq, num_heads, d = q.shape
    num_kv_heads = k.shape[2]
    group = num_heads // num_kv_heads
    q_rows = q.view(b, lq, num_kv_heads, group, d).permute(0, 2, 1, 3, 4).reshape(b, num_kv_heads, lq * group, d)
    out = F.scaled_dot_product_attention(q_rows, k.transpose(1, 2), v.transpose(1, 2), attn_mask=visible)
    return out.view(b, num_kv_heads, lq, group, d).permute(0, 2, 1, 3, 4).reshape(b, lq, num_heads, d)


def varlen_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_seqlens: torch.Tensor) -> torch.Tensor:
    """Causal attention of a flat batch of whole sequences (no cache): q [T,H,D], k/v [T,Hkv,D]."""
    group = gqa_group_size(q.shape[1], k.shape[1])
    return PagedAttentionPlan(cu_seqlens, cu_seqlens, None, 1, group).run(q, k, v)


def paged_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_tables: torch.Tensor,
                    cu_seqlens_q: torch.Tensor, cu_seqlens_k: torch.Tensor) -> torch.Tensor:
    """Varlen causal attention over paged KV: prefill, prefill over a cached prefix, chunked prefill
    and decode (Lq = 1) in one batch. q [T, H, D]; caches [N, block_size, Hkv, D], already holding
    the new tokens' K/V; block_tables [B, M]. Vectorized: per group one gather, one fused attention."""
    group = gqa_group_size(q.shape[1], k_cache.shape[2])
    plan = PagedAttentionPlan(cu_seqlens_q, cu_seqlens_k, block_tables, k_cache.shape[1], group,
                              always_read_cache=True)
    return plan.run(q, None, None, k_cache, v_cache)


def paged_decode_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                           block_tables: torch.Tensor, context_lens: torch.Tensor) -> torch.Tensor:
    """One new token per sequence, q [B, H, D], attending to its whole context by gather."""
    cu_q = torch.arange(q.shape[0] + 1, device=q.device)
    cu_k = F.pad(context_lens.long().cumsum(0), (1, 0))
    return paged_attention(q, k_cache, v_cache, block_tables, cu_q, cu_k)


def random_paged_inputs(k_lens, q_lens, num_kv_heads, head_dim, block_size, num_heads,
                        seed: int | torch.Generator = 0, dtype=torch.float32, device="cpu"):
    """Random paged caches holding each sequence's K/V in shuffled blocks, plus q and the metadata:
    (q, k_cache, v_cache, block_tables, cu_seqlens_q, cu_seqlens_k), drawn on the CPU from `seed` (an int,
    or a CPU torch.Generator to draw from), then moved to `device`. Tests and `make gpu-check` compare the
    kernels with the reference on them."""
    g = seed if isinstance(seed, torch.Generator) else torch.Generator().manual_seed(seed)
    blocks_per_seq = [-(-n // block_size) for n in k_lens]
    num_blocks = sum(blocks_per_seq) + 2
    k_cache = torch.randn(num_blocks, block_size, num_kv_heads, head_dim, generator=g).to(dtype)
    v_cache = torch.randn(num_blocks, block_size, num_kv_heads, head_dim, generator=g).to(dtype)
    perm = torch.randperm(num_blocks, generator=g).tolist()
    tables = torch.full((len(k_lens), max(blocks_per_seq)), -1, dtype=torch.int32)
    for b, n in enumerate(blocks_per_seq):
        tables[b, :n] = torch.tensor(perm[:n])
        perm = perm[n:]
    cu_q = torch.tensor([0, *q_lens]).cumsum(0)
    cu_k = torch.tensor([0, *k_lens]).cumsum(0)
    q = torch.randn(sum(q_lens), num_heads, head_dim, generator=g).to(dtype)
    return tuple(t.to(device) for t in (q, k_cache, v_cache, tables, cu_q, cu_k))
