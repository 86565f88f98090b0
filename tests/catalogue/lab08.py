"""Lab 08: Triton kernels — a tiled row softmax, the K/V store, paged decode and paged varlen prefill.

The Triton answers run in the interpreter on a CPU; the other mistakes are written in torch, which the
graders accept as readily (they grade values, not the language), to keep the catalogue fast.
"""

import os

os.environ.setdefault("TRITON_INTERPRET", "1")  # before triton is imported

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
import triton  # noqa: E402
import triton.language as tl  # noqa: E402

from catalogue import Right, Wrong  # noqa: E402
from labkit.attention.reference import paged_decode_attention  # noqa: E402
from labkit.cache.paged_storage import store_kv  # noqa: E402


@triton.jit
def _softmax(x_ptr, out_ptr, n_cols, BLOCK: tl.constexpr, TAIL: tl.constexpr, SHIFT: tl.constexpr,
             ONE_TILE: tl.constexpr):
    """Three passes over a row in tiles: max, sum of exp, write. The switches make typical mistakes."""
    row = tl.program_id(0) * n_cols
    cols = tl.arange(0, BLOCK)
    last = BLOCK if ONE_TILE else n_cols  # ONE_TILE: treats the row as one tile of BLOCK lanes
    m = tl.max(tl.full([BLOCK], float("-inf"), tl.float32), 0)
    for start in range(0, last, BLOCK):
        m = tl.maximum(m, tl.max(tl.load(x_ptr + row + start + cols, mask=start + cols < n_cols, other=TAIL), 0))
    if not SHIFT:
        m = 0.0
    total = tl.sum(tl.zeros([BLOCK], tl.float32), 0)
    for start in range(0, last, BLOCK):
        x = tl.load(x_ptr + row + start + cols, mask=start + cols < n_cols, other=TAIL)
        total += tl.sum(tl.exp(x - m), 0)
    for start in range(0, last, BLOCK):
        mask = start + cols < n_cols
        x = tl.load(x_ptr + row + start + cols, mask=mask, other=float("-inf"))
        tl.store(out_ptr + row + start + cols, tl.exp(x - m) / total, mask=mask)


def softmax_variant(tail=float("-inf"), shift=True, one_tile=False, block=128):
    def softmax_rows(x):
        out = torch.zeros_like(x)
        _softmax[(x.shape[0],)](x.contiguous(), out, x.shape[1], BLOCK=block, TAIL=tail, SHIFT=shift,
                                ONE_TILE=one_tile)
        return out
    return softmax_rows


@triton.jit
def _softmax_online(x_ptr, out_ptr, n_cols, BLOCK: tl.constexpr):
    """Two passes: a running max and a sum rescaled whenever the max grows (Lab 07's online softmax)."""
    row = tl.program_id(0) * n_cols
    cols = tl.arange(0, BLOCK)
    m = tl.max(tl.full([BLOCK], float("-inf"), tl.float32), 0)
    total = tl.sum(tl.zeros([BLOCK], tl.float32), 0)
    for start in range(0, n_cols, BLOCK):
        x = tl.load(x_ptr + row + start + cols, mask=start + cols < n_cols, other=float("-inf"))
        m_new = tl.maximum(m, tl.max(x, 0))
        total = total * tl.exp(m - m_new) + tl.sum(tl.exp(x - m_new), 0)
        m = m_new
    for start in range(0, n_cols, BLOCK):
        mask = start + cols < n_cols
        x = tl.load(x_ptr + row + start + cols, mask=mask, other=float("-inf"))
        tl.store(out_ptr + row + start + cols, tl.exp(x - m) / total, mask=mask)


def softmax_online(x):
    out = torch.empty_like(x)
    _softmax_online[(x.shape[0],)](x.contiguous(), out, x.shape[1], BLOCK=256)
    return out


def softmax_torch(x, *, dim=-1, divide=True):
    """exp(x - max) / sum with torch reductions; the switches make typical mistakes."""
    e = (x - x.amax(dim, keepdim=True)).exp()
    return e / e.sum(dim, keepdim=True) if divide else e


def softmax_tilewise(x, block=64):
    """Each tile normalized by its own max and sum, as if tiles were separate rows."""
    return torch.cat([softmax_torch(x[:, i:i + block]) for i in range(0, x.shape[1], block)], dim=1)


@triton.jit
def _prefill(q_ptr, k_cache_ptr, v_cache_ptr, out_ptr, block_tables_ptr, cu_q_ptr, cu_k_ptr, scale, max_blocks,
             NUM_HEADS: tl.constexpr, NUM_KV_HEADS: tl.constexpr, BLOCK_SIZE: tl.constexpr, HEAD_DIM: tl.constexpr,
             OFFSET: tl.constexpr):
    seq, head, i = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    q_start = tl.load(cu_q_ptr + seq)
    q_len = tl.load(cu_q_ptr + seq + 1) - q_start
    k_len = tl.load(cu_k_ptr + seq + 1) - tl.load(cu_k_ptr + seq)
    if i < q_len:
        last = k_len - q_len + i if OFFSET else i  # OFFSET off: the causal diagonal from the top-left
        kv_head = head // (NUM_HEADS // NUM_KV_HEADS)
        d = tl.arange(0, HEAD_DIM)
        j = tl.arange(0, BLOCK_SIZE)
        q = tl.load(q_ptr + ((q_start + i) * NUM_HEADS + head) * HEAD_DIM + d)
        m = tl.max(tl.full([BLOCK_SIZE], float("-inf"), tl.float32), 0)
        denom = tl.sum(tl.zeros([BLOCK_SIZE], tl.float32), 0)
        acc = tl.zeros([HEAD_DIM], tl.float32)
        for b in range(0, last // BLOCK_SIZE + 1):
            block = tl.load(block_tables_ptr + seq * max_blocks + b).to(tl.int64)
            valid = b * BLOCK_SIZE + j <= last
            rows = ((block * BLOCK_SIZE + j) * NUM_KV_HEADS + kv_head) * HEAD_DIM
            k = tl.load(k_cache_ptr + rows[:, None] + d[None, :], mask=valid[:, None], other=0.0)
            v = tl.load(v_cache_ptr + rows[:, None] + d[None, :], mask=valid[:, None], other=0.0)
            s = tl.where(valid, tl.sum(k * q[None, :], 1) * scale, float("-inf"))
            m_new = tl.maximum(m, tl.max(s, 0))
            p = tl.exp(s - m_new)
            alpha = tl.exp(m - m_new)
            denom = denom * alpha + tl.sum(p, 0)
            acc = acc * alpha + tl.sum(p[:, None] * v, 0)
            m = m_new
        tl.store(out_ptr + ((q_start + i) * NUM_HEADS + head) * HEAD_DIM + d, acc / denom)


def prefill_variant(offset=True):
    def paged_prefill(q, k_cache, v_cache, block_tables, cu_seqlens_q, cu_seqlens_k, max_seqlen_q):
        out = torch.empty_like(q)
        _prefill[(len(cu_seqlens_q) - 1, q.shape[1], max_seqlen_q)](
            q.contiguous(), k_cache, v_cache, out, block_tables, cu_seqlens_q, cu_seqlens_k, q.shape[2] ** -0.5,
            block_tables.shape[1], NUM_HEADS=q.shape[1], NUM_KV_HEADS=k_cache.shape[2], BLOCK_SIZE=k_cache.shape[1],
            HEAD_DIM=q.shape[2], OFFSET=offset)
        return out
    return paged_prefill


def prefill_torch(q, k_cache, v_cache, block_tables, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, *, causal=True,
                  prefix=True, gqa_div=True, scale=True):
    """Per sequence and row: gather the visible keys block by block, softmax, weighted sum of values."""
    out = torch.empty_like(q)
    block_size, num_kv_heads = k_cache.shape[1], k_cache.shape[2]
    group = q.shape[1] // num_kv_heads
    heads = torch.arange(q.shape[1])
    kv_heads = heads // group if gqa_div else heads % num_kv_heads
    for s in range(len(cu_seqlens_q) - 1):
        q0, q_len = int(cu_seqlens_q[s]), int(cu_seqlens_q[s + 1] - cu_seqlens_q[s])
        k_len = int(cu_seqlens_k[s + 1] - cu_seqlens_k[s])
        for i in range(q_len):
            last = k_len - q_len + i if causal else k_len - 1
            first = k_len - q_len if not prefix else 0
            slots = [int(block_tables[s, t // block_size]) * block_size + t % block_size
                     for t in range(first, last + 1)]
            keys = k_cache.flatten(0, 1)[slots][:, kv_heads]  # [n, H, D]
            values = v_cache.flatten(0, 1)[slots][:, kv_heads]
            scores = torch.einsum("hd,nhd->hn", q[q0 + i], keys) * (q.shape[-1] ** -0.5 if scale else 1.0)
            out[q0 + i] = torch.einsum("hn,nhd->hd", scores.softmax(-1), values)
    return out


@triton.jit
def _store(k_ptr, v_ptr, k_cache_ptr, v_cache_ptr, slot_ptr, ROW: tl.constexpr, ROW_PAD: tl.constexpr,
           MASK_MINUS_ONE: tl.constexpr, STORE_V: tl.constexpr):
    t = tl.program_id(0)
    slot = tl.load(slot_ptr + t)
    offs = tl.arange(0, ROW_PAD)
    if MASK_MINUS_ONE:
        mask = offs < tl.where(slot >= 0, ROW, 0)
    else:
        mask = offs < ROW  # a slot of -1 writes one row before the cache
    tl.store(k_cache_ptr + slot * ROW + offs, tl.load(k_ptr + t * ROW + offs, mask=mask), mask=mask)
    if STORE_V:
        tl.store(v_cache_ptr + slot * ROW + offs, tl.load(v_ptr + t * ROW + offs, mask=mask), mask=mask)


def store_variant(mask_minus_one=True, store_v=True):
    def store_kvcache(k, v, k_cache, v_cache, slot_mapping):
        row = k.shape[1] * k.shape[2]
        _store[(k.shape[0],)](k.contiguous(), v.contiguous(), k_cache, v_cache, slot_mapping, ROW=row,
                              ROW_PAD=triton.next_power_of_2(row), MASK_MINUS_ONE=mask_minus_one, STORE_V=store_v)
    return store_kvcache


@triton.jit
def _decode(q_ptr, k_cache_ptr, v_cache_ptr, out_ptr, block_tables_ptr, context_lens_ptr, scale, max_blocks,
            NUM_HEADS: tl.constexpr, NUM_KV_HEADS: tl.constexpr, BLOCK_SIZE: tl.constexpr, HEAD_DIM: tl.constexpr,
            MASK: tl.constexpr, GQA_DIV: tl.constexpr, RESCALE: tl.constexpr):
    seq, head = tl.program_id(0), tl.program_id(1)
    kv_head = head // (NUM_HEADS // NUM_KV_HEADS) if GQA_DIV else head % NUM_KV_HEADS
    context_len = tl.load(context_lens_ptr + seq)
    d = tl.arange(0, HEAD_DIM)
    i = tl.arange(0, BLOCK_SIZE)
    q = tl.load(q_ptr + (seq * NUM_HEADS + head) * HEAD_DIM + d)
    m = tl.max(tl.full([BLOCK_SIZE], float("-inf"), tl.float32), 0)
    l_sum = tl.sum(tl.zeros([BLOCK_SIZE], tl.float32), 0)
    acc = tl.zeros([HEAD_DIM], tl.float32)
    for b in range(0, tl.cdiv(context_len, BLOCK_SIZE)):
        block = tl.load(block_tables_ptr + seq * max_blocks + b)
        valid = (b * BLOCK_SIZE + i < context_len) | (not MASK)
        rows = ((block * BLOCK_SIZE + i) * NUM_KV_HEADS + kv_head) * HEAD_DIM
        k = tl.load(k_cache_ptr + rows[:, None] + d[None, :])
        v = tl.load(v_cache_ptr + rows[:, None] + d[None, :])
        s = tl.where(valid, tl.sum(k * q[None, :], 1) * scale, float("-inf"))
        m_new = tl.maximum(m, tl.max(s, 0))
        p = tl.exp(s - m_new)
        if RESCALE:
            alpha = tl.exp(m - m_new)
            l_sum = l_sum * alpha + tl.sum(p, 0)
            acc = acc * alpha + tl.sum(p[:, None] * v, 0)
        else:  # sums terms taken under different maxima
            l_sum = l_sum + tl.sum(p, 0)
            acc = acc + tl.sum(p[:, None] * v, 0)
        m = m_new
    tl.store(out_ptr + (seq * NUM_HEADS + head) * HEAD_DIM + d, acc / l_sum)


def decode_variant(mask=True, gqa_div=True, rescale=True):
    def paged_decode(q, k_cache, v_cache, block_tables, context_lens):
        out = torch.empty_like(q)
        _decode[(q.shape[0], q.shape[1])](q.contiguous(), k_cache, v_cache, out, block_tables, context_lens,
                                          q.shape[2] ** -0.5, block_tables.shape[1], NUM_HEADS=q.shape[1],
                                          NUM_KV_HEADS=k_cache.shape[2], BLOCK_SIZE=k_cache.shape[1],
                                          HEAD_DIM=q.shape[2], MASK=mask, GQA_DIV=gqa_div, RESCALE=rescale)
        return out
    return paged_decode


def store_torch(k, v, k_cache, v_cache, slot_mapping, *, mask=True, swap=False, rows="slot", store_v=True):
    """store_kvcache in torch, flattening the cache to one row per slot; the switches make typical mistakes."""
    k_rows, v_rows = k_cache.view(-1, k.shape[1] * k.shape[2]), v_cache.view(-1, v.shape[1] * v.shape[2])
    if swap:
        k_rows, v_rows = v_rows, k_rows
    for t, slot in enumerate(slot_mapping.tolist()):
        if slot < 0 and mask:
            continue
        row = t if rows == "token" else slot
        if rows == "head_dim":  # forgot that a slot holds num_kv_heads rows of head_dim
            k_cache.view(-1, k.shape[2])[slot] = k[t, 0]
            continue
        if slot < 0:  # slot -1 wraps round to the last row of the cache
            row = len(k_rows) - 1
        k_rows[row] = k[t].flatten()
        if store_v:
            v_rows[row] = v[t].flatten()


def decode_torch(q, k_cache, v_cache, block_tables, context_lens, *, scale=True, use_table=True, last_block=False):
    """Gather each sequence's keys block by block, then attend; the switches make typical mistakes."""
    out = torch.empty_like(q)
    block_size, group = k_cache.shape[1], q.shape[1] // k_cache.shape[2]
    for s, n in enumerate(context_lens.tolist()):
        blocks = [int(b) for b in block_tables[s, : -(-n // block_size)]]
        if not use_table:
            blocks = [s * block_tables.shape[1] + i for i in range(len(blocks))]
        keys = torch.cat([k_cache[b] for b in blocks])[:n].repeat_interleave(group, 1)  # [n, H, D]
        values = torch.cat([v_cache[b] for b in blocks])[:n].repeat_interleave(group, 1)
        if last_block:
            keys, values = keys[(len(blocks) - 1) * block_size:], values[(len(blocks) - 1) * block_size:]
        scores = torch.einsum("hd,nhd->hn", q[s], keys) * (q.shape[-1] ** -0.5 if scale else 1.0)
        out[s] = torch.einsum("hn,nhd->hd", scores.softmax(-1), values)
    return out


def labkit_store(k, v, k_cache, v_cache, slot_mapping):
    store_kv(k, v, k_cache, v_cache, slot_mapping)


RIGHT = [
    Right("softmax_rows", "Triton, three passes over tiles (max, sum, write)", softmax_variant()),
    Right("softmax_rows", "Triton, online max and rescaled sum, then write", softmax_online),
    Right("softmax_rows", "torch reductions", softmax_torch),
    Right("paged_prefill", "Triton, one program per (sequence, head, new token)", prefill_variant()),
    Right("paged_prefill", "torch, gather the visible keys per row", prefill_torch),
    Right("store_kvcache", "Triton kernel, one program per token", store_variant()),
    Right("store_kvcache", "torch rows, one slot at a time", store_torch),
    Right("paged_decode", "Triton kernel with online softmax", decode_variant()),
    Right("paged_decode", "torch gather then softmax", decode_torch),
]

WRONG = [
    Wrong("softmax_rows", "tail lanes load 0, not -inf (Triton)", softmax_variant(tail=0.0),
          "included lanes past its end"),
    Wrong("softmax_rows", "no max subtracted (Triton)", softmax_variant(shift=False), "exp overflowed"),
    Wrong("softmax_rows", "one tile per row, no loop (Triton)", softmax_variant(one_tile=True),
          "only the first 128 columns"),
    Wrong("softmax_rows", "each tile normalized on its own", softmax_tilewise, "the whole row, every tile"),
    Wrong("softmax_rows", "not divided by the sum", lambda x: softmax_torch(x, divide=False), "not divided"),
    Wrong("softmax_rows", "normalized over the batch axis", lambda x: softmax_torch(x, dim=0), "wrong axis"),
    Wrong("softmax_rows", "calls torch.softmax", lambda x: torch.softmax(x, -1), "`torch.softmax`",
          calls="torch.softmax"),
    Wrong("paged_prefill", "causal diagonal from the top-left (Triton)", prefill_variant(offset=False),
          "as if the prompt started the context"),
    Wrong("paged_prefill", "no causal mask", lambda *a: prefill_torch(*a, causal=False), "no causal mask"),
    Wrong("paged_prefill", "cached prefix ignored", lambda *a: prefill_torch(*a, prefix=False),
          "cached prefix was ignored"),
    Wrong("paged_prefill", "GQA head by modulo", lambda *a: prefill_torch(*a, gqa_div=False), "h % num_kv_heads"),
    Wrong("paged_prefill", "forgot the 1/sqrt(d) scale", lambda *a: prefill_torch(*a, scale=False), "not scaled"),
    Wrong("paged_prefill", "returned [num_seqs, ...] (one row per sequence)", lambda *a: prefill_torch(*a)[:3],
          "expected a [total_new_tokens"),
    Wrong("paged_prefill", "calls torch's SDPA", lambda q, kc, vc, bt, cq, ck, mq: F.scaled_dot_product_attention(
          q.transpose(0, 1), q.transpose(0, 1), q.transpose(0, 1)).transpose(0, 1),
          "`torch.nn.functional.scaled_dot_product_attention`",
          calls="torch.nn.functional.scaled_dot_product_attention"),
    Wrong("store_kvcache", "slot -1 not masked (Triton)", store_variant(mask_minus_one=False), "slot -1 was stored"),
    Wrong("store_kvcache", "stores only K (Triton)", store_variant(store_v=False), "store both"),
    Wrong("store_kvcache", "stores nothing", lambda k, v, k_cache, v_cache, slots: None, "stored nothing"),
    Wrong("store_kvcache", "K and V swapped", lambda *a: store_torch(*a, swap=True), "K went into the V cache"),
    Wrong("store_kvcache", "row indexed by token, not slot", lambda *a: store_torch(*a, rows="token"),
          "row of slot s starts at s * num_kv_heads * head_dim"),
    Wrong("store_kvcache", "slot stride of head_dim only", lambda *a: store_torch(*a, rows="head_dim"),
          "row of slot s starts at s * num_kv_heads * head_dim"),
    Wrong("store_kvcache", "slot -1 wraps to the last row", lambda *a: store_torch(*a, mask=False),
          "cache rows differ"),
    Wrong("store_kvcache", "calls labkit's store_kv", labkit_store, "`store_kv`",
          calls="labkit.cache.paged_storage.store_kv"),
    Wrong("paged_decode", "no mask past the context (Triton)", decode_variant(mask=False), "past the context length"),
    Wrong("paged_decode", "GQA head by modulo (Triton)", decode_variant(gqa_div=False), "h % num_kv_heads"),
    Wrong("paged_decode", "no rescaling of the running sums (Triton)", decode_variant(rescale=False), "rescaling"),
    Wrong("paged_decode", "forgot the 1/sqrt(d) scale", lambda *a: decode_torch(*a, scale=False), "not scaled"),
    Wrong("paged_decode", "ignored the block table", lambda *a: decode_torch(*a, use_table=False),
          "block table was ignored"),
    Wrong("paged_decode", "attends over the last block only", lambda *a: decode_torch(*a, last_block=True),
          "right for the one-token context, wrong for longer ones"),
    Wrong("paged_decode", "returned [num_seqs, head_dim]", lambda *a: decode_torch(*a)[:, 0],
          "expected a [num_seqs, num_heads, head_dim]"),
    Wrong("paged_decode", "calls labkit's reference", lambda *a: paged_decode_attention(*a),
          "`paged_decode_attention`",
          calls="labkit.attention.reference.paged_decode_attention"),
]
