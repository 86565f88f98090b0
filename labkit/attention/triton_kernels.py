"""Triton kernels for paged attention: store new K/V into their slots, and attend over paged KV.

One attention kernel serves decode (one query per sequence), prefill, prefill over a cached prefix
and chunked prefill: a program takes one sequence, one KV head and a tile of that sequence's new
tokens, and walks the sequence's keys in tiles of BLOCK_N tokens, finding each key's physical block
through the block table (so any block size works, and tl.dot always sees >= 16 rows as GPUs need).
All query heads of a GQA group are stacked in the rows of one tile, so each K/V tile is loaded once
per group. The softmax is the online one: running max, running sum, rescaled accumulator.

Triton is imported when a kernel is first used, not when this module is imported, so the module
loads without triton and TRITON_INTERPRET=1 (the CPU interpreter) only has to be set before the
first call. Tolerances against `labkit.attention.reference` (on the same inputs, reference in fp32):
fp32 max abs diff <= 1e-5 (dots use IEEE fp32, not TF32); fp16 <= 2e-3 on unit-variance inputs (the
softmax weights are rounded to fp16 before the second dot, as FlashAttention does); bf16 <= 3e-2
(three fewer mantissa bits than fp16: 8x the rounding, about 1.5e-2 seen, with fp16's 2x margin).
All three are tested on the interpreter and, compiled, by `make gpu-check`. The interpreter's
tl.dot garbles bf16 operands (NumPy has no bf16), so there, and only there, bf16 operands are
widened to fp32 before each dot: exact, since every bf16 is an fp32, and what tensor cores compute
anyway (exact products, fp32 sums).
"""

import functools
import os

import torch

# max |kernel - fp32 reference| on the same unit-variance inputs, per dtype (see above)
TOLERANCE = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 3e-2}


def interpreted() -> bool:
    """Whether Triton runs kernels in its CPU interpreter (TRITON_INTERPRET=1 when triton was first
    imported) rather than compiling them for a GPU."""
    return os.environ.get("TRITON_INTERPRET") == "1"

@functools.cache
def jit_kernels():
    """The Triton kernels (store_kv, paged attention), defined at first use so that importing labkit
    needs no triton and TRITON_INTERPRET is read when they are made, not at import."""
    import triton
    import triton.language as tl

    @triton.jit
    def store_kv_kernel(k_ptr, v_ptr, k_cache_ptr, v_cache_ptr, slot_ptr, stride_k, stride_v,
                        ROW: tl.constexpr, ROW_PAD: tl.constexpr):
        """One program per new token: copy its K and V rows (num_kv_heads * head_dim) into its slot."""
        t = tl.program_id(0)
        slot = tl.load(slot_ptr + t).to(tl.int64)
        offs = tl.arange(0, ROW_PAD)
        mask = offs < tl.where(slot >= 0, ROW, 0)  # slot -1: a padded token, nothing to store
        tl.store(k_cache_ptr + slot * ROW + offs, tl.load(k_ptr + t * stride_k + offs, mask=mask), mask=mask)
        tl.store(v_cache_ptr + slot * ROW + offs, tl.load(v_ptr + t * stride_v + offs, mask=mask), mask=mask)

    @triton.jit
    def paged_attention_kernel(
        q_ptr, k_cache_ptr, v_cache_ptr, out_ptr, block_tables_ptr, cu_q_ptr, cu_k_ptr, scale,
        stride_qt, stride_qh, stride_ot, stride_oh, stride_cb, stride_cs, stride_ch, stride_bt,
        GROUP: tl.constexpr, GROUP_PAD: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
        BLOCK_SIZE: tl.constexpr, HEAD_DIM: tl.constexpr, D_PAD: tl.constexpr, WIDEN_DOTS: tl.constexpr,
    ):
        seq, kv_head, m_tile = tl.program_id(0), tl.program_id(1), tl.program_id(2)
        q_start = tl.load(cu_q_ptr + seq)
        q_len = tl.load(cu_q_ptr + seq + 1) - q_start
        k_len = tl.load(cu_k_ptr + seq + 1) - tl.load(cu_k_ptr + seq)
        m0 = m_tile * BLOCK_M

        # Rows of the tile: BLOCK_M tokens x GROUP_PAD query heads of this KV head's group.
        rows = tl.arange(0, BLOCK_M * GROUP_PAD)
        tok = m0 + rows // GROUP_PAD
        head = kv_head * GROUP + rows % GROUP_PAD
        row_ok = (tok < q_len) & (rows % GROUP_PAD < GROUP)
        q_pos = k_len - q_len + tok  # each row's position in its sequence: it sees keys 0..q_pos
        d = tl.arange(0, D_PAD)
        d_ok = d < HEAD_DIM
        q_offs = (q_start + tok).to(tl.int64)[:, None] * stride_qt + head[:, None] * stride_qh + d[None, :]
        q = tl.load(q_ptr + q_offs, mask=row_ok[:, None] & d_ok[None, :], other=0.0)
        if WIDEN_DOTS:
            q = q.to(tl.float32)

        m_i = tl.full([BLOCK_M * GROUP_PAD], float("-inf"), tl.float32)
        l_i = tl.zeros([BLOCK_M * GROUP_PAD], tl.float32)
        acc = tl.zeros([BLOCK_M * GROUP_PAD, D_PAD], tl.float32)
        # keys this tile can see: up to the last row's position (causal), none for an empty tile
        kv_end = tl.where(m0 < q_len, tl.minimum(k_len, k_len - q_len + m0 + BLOCK_M), 0)
        for n0 in range(0, kv_end, BLOCK_N):
            kpos = n0 + tl.arange(0, BLOCK_N)
            k_ok = kpos < kv_end
            block = tl.load(block_tables_ptr + seq * stride_bt + kpos // BLOCK_SIZE, mask=k_ok, other=0)
            kv_offs = block.to(tl.int64) * stride_cb + (kpos % BLOCK_SIZE) * stride_cs + kv_head * stride_ch
            kv_mask = k_ok[:, None] & d_ok[None, :]
            k = tl.load(k_cache_ptr + kv_offs[:, None] + d[None, :], mask=kv_mask, other=0.0)
            v = tl.load(v_cache_ptr + kv_offs[:, None] + d[None, :], mask=kv_mask, other=0.0)
            p_dtype = v.dtype  # the softmax weights are rounded to V's dtype before the second dot
            if WIDEN_DOTS:
                k, v = k.to(tl.float32), v.to(tl.float32)

            s = tl.dot(q, tl.trans(k), input_precision="ieee") * scale  # [rows, BLOCK_N] fp32
            s = tl.where((kpos[None, :] <= q_pos[:, None]) & k_ok[None, :], s, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(s, 1))
            m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # a row that has seen no key yet
            p = tl.exp(s - m_safe[:, None])
            alpha = tl.exp(m_i - m_safe)  # rescales what was summed under the old max
            l_i = l_i * alpha + tl.sum(p, 1)
            acc = acc * alpha[:, None] + tl.dot(p.to(p_dtype).to(v.dtype), v, input_precision="ieee")
            m_i = m_new

        out = acc / tl.where(l_i == 0.0, 1.0, l_i)[:, None]
        o_offs = (q_start + tok).to(tl.int64)[:, None] * stride_ot + head[:, None] * stride_oh + d[None, :]
        tl.store(out_ptr + o_offs, out.to(out_ptr.dtype.element_ty), mask=row_ok[:, None] & d_ok[None, :])

    return store_kv_kernel, paged_attention_kernel, triton.next_power_of_2


def _rows_contiguous(x: torch.Tensor) -> torch.Tensor:
    """Each token's [H, D] must be one contiguous row (true for slices of a fused QKV projection)."""
    return x if x.stride(-1) == 1 and x.stride(-2) == x.shape[-1] else x.contiguous()


def store_kvcache(k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                  slot_mapping: torch.Tensor) -> None:
    """Triton twin of `labkit.cache.paged_storage.store_kv`: k/v [T, Hkv, D] into [N, bs, Hkv, D] slots."""
    store_kv_kernel, _, next_power_of_2 = jit_kernels()
    if k.shape != v.shape or k.shape[0] != slot_mapping.numel() or k.shape[1:] != k_cache.shape[2:]:
        raise ValueError(f"k {tuple(k.shape)}, v {tuple(v.shape)}, slot_mapping {tuple(slot_mapping.shape)} "
                         f"do not match a cache with rows {tuple(k_cache.shape[2:])}")
    if not (k_cache.is_contiguous() and v_cache.is_contiguous()):
        raise ValueError("k_cache and v_cache must be contiguous")
    if k.shape[0] == 0:
        return
    k, v = _rows_contiguous(k), _rows_contiguous(v)
    row = k.shape[1] * k.shape[2]
    store_kv_kernel[(k.shape[0],)](k, v, k_cache, v_cache, slot_mapping.contiguous(), k.stride(0), v.stride(0),
                                   ROW=row, ROW_PAD=next_power_of_2(row))


def paged_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_tables: torch.Tensor,
                    cu_seqlens_q: torch.Tensor, cu_seqlens_k: torch.Tensor, max_seqlen_q: int,
                    block_n: int = 64, num_warps: int | None = None, num_stages: int | None = None) -> torch.Tensor:
    """Causal attention of q [T, H, D] over paged K/V [N, block_size, Hkv, D] (new tokens already stored).

    Same contract as `labkit.attention.reference.paged_attention`; returns [T, H, D] in q's dtype.
    `block_n` keys per tile, and Triton's `num_warps` / `num_stages` tune the launch. A decode step defaults
    to two stages of loads in flight (Triton's default on Hopper is three): on an H100 that took the
    decode of 64 sequences x 2048 tokens from 82% to 94% of the measured copy bandwidth, and Qwen3-0.6B's
    256 x 800 from 92% to 97% (reports/gpu/2026-11-26-*); prefill keeps Triton's choice.
    """
    _, kernel, next_power_of_2 = jit_kernels()
    num_tokens, num_heads, head_dim = q.shape
    num_kv_heads, block_size = k_cache.shape[2], k_cache.shape[1]
    if num_heads % num_kv_heads:
        raise ValueError(f"num_heads ({num_heads}) must be a multiple of num_kv_heads ({num_kv_heads})")
    if q.dtype != k_cache.dtype or k_cache.shape != v_cache.shape or k_cache.shape[3] != head_dim:
        raise ValueError(f"q {tuple(q.shape)} {q.dtype} does not match caches {tuple(k_cache.shape)} "
                         f"{k_cache.dtype} / {tuple(v_cache.shape)}")
    if not (k_cache.is_contiguous() and v_cache.is_contiguous()):
        raise ValueError("k_cache and v_cache must be contiguous")
    q = q if q.stride(-1) == 1 else q.contiguous()
    out = torch.empty_like(q, memory_format=torch.contiguous_format)
    if num_tokens == 0:
        return out
    if num_stages is None and max_seqlen_q == 1:
        num_stages = 2
    group = num_heads // num_kv_heads
    group_pad = next_power_of_2(group)
    rows = 16 if max_seqlen_q == 1 else 64  # >= 16: the smallest tile tl.dot accepts on a GPU
    block_m = max(1, rows // group_pad)
    block_tables = block_tables.contiguous()
    grid = (cu_seqlens_q.numel() - 1, num_kv_heads, -(-max_seqlen_q // block_m))
    kernel[grid](
        q, k_cache, v_cache, out, block_tables, cu_seqlens_q.contiguous(), cu_seqlens_k.contiguous(),
        head_dim**-0.5, q.stride(0), q.stride(1), out.stride(0), out.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2), block_tables.stride(0),
        GROUP=group, GROUP_PAD=group_pad, BLOCK_M=block_m, BLOCK_N=max(16, block_n),
        BLOCK_SIZE=block_size, HEAD_DIM=head_dim, D_PAD=max(16, next_power_of_2(head_dim)),
        WIDEN_DOTS=q.dtype == torch.bfloat16 and interpreted(),
        **{name: value for name, value in (("num_warps", num_warps), ("num_stages", num_stages)) if value is not None},
    )
    return out
