"""FlashAttention's forward in Triton: causal self-attention over a varlen flat batch, tile by tile.

The naive kernel writes the [N, N] score matrix to memory, reads it back for the softmax, writes the
probabilities and reads them again for the product with V. FlashAttention never materialises them:
a program owns BLOCK_M queries of one head, streams that head's keys and values through in tiles of
BLOCK_N, and keeps the online softmax (running max, running sum, rescaled accumulator) in registers.
Causal masking also lets a tile skip every key tile above the diagonal. Sequences are packed as in
flash_attn_varlen_func: q [T, H, D], k/v [T, Hkv, D] with cu_seqlens marking where each one starts.
`attention_hbm_bytes` counts the bytes each kernel moves, on paper, so the two can be compared.

The kernel is the teaching version: one query head per program (the paged kernel in
`triton_kernels` stacks a GQA group per program to load each K/V tile once per group).
Tolerances against SDPA are those of `triton_kernels.TOLERANCE`; bf16 dots are widened on the
interpreter for the reason given there.
"""

import functools

import torch

from labkit.attention.triton_kernels import interpreted


@functools.cache
def _kernel():
    import triton
    import triton.language as tl

    @triton.jit
    def flash_forward_kernel(
        q_ptr, k_ptr, v_ptr, out_ptr, cu_seqlens_ptr, scale,
        stride_qt, stride_qh, stride_kt, stride_kh, stride_vt, stride_vh, stride_ot, stride_oh,
        GROUP: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
        HEAD_DIM: tl.constexpr, D_PAD: tl.constexpr, WIDEN_DOTS: tl.constexpr,
    ):
        seq, head, m_tile = tl.program_id(0), tl.program_id(1), tl.program_id(2)
        start = tl.load(cu_seqlens_ptr + seq)
        seq_len = tl.load(cu_seqlens_ptr + seq + 1) - start
        kv_head = head // GROUP
        m0 = m_tile * BLOCK_M
        rows = m0 + tl.arange(0, BLOCK_M)  # query positions within the sequence
        d = tl.arange(0, D_PAD)
        row_mask = (rows < seq_len)[:, None] & (d < HEAD_DIM)[None, :]
        q = tl.load(q_ptr + (start + rows).to(tl.int64)[:, None] * stride_qt + head * stride_qh + d[None, :],
                    mask=row_mask, other=0.0)
        if WIDEN_DOTS:
            q = q.to(tl.float32)

        m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
        l_i = tl.zeros([BLOCK_M], tl.float32)
        acc = tl.zeros([BLOCK_M, D_PAD], tl.float32)
        # Causal: the tile's last query sees keys up to m0 + BLOCK_M - 1, so later key tiles are skipped.
        # Key 0 is in the first tile and visible to every row, so no row's max stays -inf.
        kv_end = tl.where(m0 < seq_len, tl.minimum(seq_len, m0 + BLOCK_M), 0)
        for n0 in range(0, kv_end, BLOCK_N):
            cols = n0 + tl.arange(0, BLOCK_N)
            col_mask = (cols < kv_end)[:, None] & (d < HEAD_DIM)[None, :]
            kv_rows = (start + cols).to(tl.int64)[:, None]
            k = tl.load(k_ptr + kv_rows * stride_kt + kv_head * stride_kh + d[None, :], mask=col_mask, other=0.0)
            v = tl.load(v_ptr + kv_rows * stride_vt + kv_head * stride_vh + d[None, :], mask=col_mask, other=0.0)
            p_dtype = v.dtype
            if WIDEN_DOTS:
                k, v = k.to(tl.float32), v.to(tl.float32)
            s = tl.dot(q, tl.trans(k), input_precision="ieee") * scale
            s = tl.where((cols[None, :] <= rows[:, None]) & (cols < kv_end)[None, :], s, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(s, 1))
            p = tl.exp(s - m_new[:, None])
            alpha = tl.exp(m_i - m_new)  # what was summed under the old max, rescaled to the new one
            l_i = l_i * alpha + tl.sum(p, 1)
            acc = acc * alpha[:, None] + tl.dot(p.to(p_dtype).to(v.dtype), v, input_precision="ieee")
            m_i = m_new

        out = acc / tl.where(l_i == 0.0, 1.0, l_i)[:, None]  # l_i = 0 only in a tile past the sequence's end
        tl.store(out_ptr + (start + rows).to(tl.int64)[:, None] * stride_ot + head * stride_oh + d[None, :],
                 out.to(out_ptr.dtype.element_ty), mask=row_mask)

    return flash_forward_kernel, triton.next_power_of_2


def flash_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_seqlens: torch.Tensor,
                    max_seqlen: int, block_m: int = 64, block_n: int = 64) -> torch.Tensor:
    """Causal attention of each packed sequence to itself: q [T, H, D], k/v [T, Hkv, D] -> [T, H, D]."""
    kernel, next_power_of_2 = _kernel()
    if q.dim() != 3 or k.shape != v.shape or k.dim() != 3 or q.shape[0] != k.shape[0] or q.shape[2] != k.shape[2]:
        raise ValueError(f"q {tuple(q.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)}: expected q [T, H, D] "
                         "and k, v [T, Hkv, D] over the same tokens")
    if q.shape[1] % k.shape[1]:
        raise ValueError(f"num_heads ({q.shape[1]}) must be a multiple of num_kv_heads ({k.shape[1]})")
    if not q.dtype == k.dtype == v.dtype:
        raise ValueError(f"q, k, v must share a dtype, got {q.dtype}, {k.dtype}, {v.dtype}")
    devices = {t.device for t in (q, k, v, cu_seqlens)}
    if len(devices) > 1:
        raise ValueError(f"q, k, v and cu_seqlens must be on one device, got {sorted(map(str, devices))}")
    if q.device.type == "cpu" and not interpreted():
        raise ValueError("flash_attention got CPU tensors, but Triton compiles for the GPU here: move q, k, v and "
                         "cu_seqlens to the GPU, or set TRITON_INTERPRET=1 before triton is first imported")
    if cu_seqlens.dim() != 1 or int(cu_seqlens[0]) != 0 or int(cu_seqlens[-1]) != q.shape[0]:
        raise ValueError(f"cu_seqlens must run from 0 to the {q.shape[0]} tokens, got {cu_seqlens.tolist()}")
    q, k, v = (t if t.stride(-1) == 1 else t.contiguous() for t in (q, k, v))
    out = torch.empty_like(q, memory_format=torch.contiguous_format)
    if q.shape[0] == 0:
        return out
    head_dim = q.shape[2]
    block_m, block_n = max(16, block_m), max(16, block_n)  # tl.dot needs >= 16 rows on a GPU
    grid = (cu_seqlens.numel() - 1, q.shape[1], -(-max_seqlen // block_m))
    kernel[grid](
        q, k, v, out, cu_seqlens.contiguous(), head_dim**-0.5,
        q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1), out.stride(0), out.stride(1),
        GROUP=q.shape[1] // k.shape[1], BLOCK_M=block_m, BLOCK_N=block_n, HEAD_DIM=head_dim,
        D_PAD=max(16, next_power_of_2(head_dim)),
        WIDEN_DOTS=q.dtype == torch.bfloat16 and interpreted(),
    )
    return out


def attention_hbm_bytes(seq_len: int, head_dim: int, num_heads: int, dtype_bytes: int,
                        block_m: int = 64) -> dict[str, int]:
    """Bytes read + written from GPU memory by causal attention over one sequence, naive vs flash.

    Naive (one kernel per step, as a framework runs it): read Q, K (2Nd), write S (N^2); the softmax
    reads S and writes P (2N^2); P V reads P and V (N^2 + Nd) and writes O (Nd): 4Nd + 4N^2 per head.
    Flash: Q read and O written once (2Nd); query tile i reads the key tiles up to the diagonal, each
    K and V row once per tile that needs it. Flash counts no score bytes at all: that is the point.
    K/V are counted per query head (each program loads its own), so GQA does not change the totals;
    the key tile width does not matter either, only how many query tiles re-read the keys.
    """
    n, d = seq_len, head_dim
    naive = 4 * n * d + 4 * n * n
    # query tile i loads keys 0 .. min(n, (i + 1) block_m) - 1 (masked loads past the end move nothing)
    kv_rows = sum(min(n, m0 + block_m) for m0 in range(0, n, block_m))
    flash = 2 * n * d + 2 * kv_rows * d
    return {"naive": naive * num_heads * dtype_bytes, "flash": flash * num_heads * dtype_bytes}
