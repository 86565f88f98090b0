"""Lab 08: a Triton paged-attention kernel — store K/V into slots, paged decode with online softmax.

The student's kernels run wherever the notebook runs them: compiled on CUDA, or in the Triton
interpreter on a CPU (the notebook sets TRITON_INTERPRET=1 before importing triton).
"""

import torch

from labkit.attention.reference import paged_decode_attention
from labkit.cache.paged_storage import store_kv
from labkit.device import pick_device
from labkit.grading import ExerciseFailed, exercise, require


def _device():
    return pick_device()


@exercise("08", "store_kvcache", forbidden=(
    "labkit.cache.paged_storage.store_kv", "labkit.attention.triton_kernels.store_kvcache",
    "labkit.attention.triton_kernels._kernels",
))
def store_kvcache(ns):
    fn = require(ns, "store_kvcache")
    g = torch.Generator().manual_seed(8)
    dev = _device()
    row = 2 * 16
    # each cache sits in a buffer one block past a guard region, where a stray slot -1 would land
    k_buf = torch.cat([torch.zeros(8 * row), torch.randn(4 * 8 * row, generator=g)]).to(dev)
    v_buf = torch.cat([torch.zeros(8 * row), torch.randn(4 * 8 * row, generator=g)]).to(dev)
    k_cache, v_cache = k_buf[8 * row:].view(4, 8, 2, 16), v_buf[8 * row:].view(4, 8, 2, 16)
    k, v = torch.randn(5, 2, 16, generator=g).to(dev), torch.randn(5, 2, 16, generator=g).to(dev)
    slots = torch.tensor([9, -1, 31, 0, -1], device=dev)
    want_k, want_v = k_cache.clone(), v_cache.clone()
    store_kv(k, v, want_k, want_v, slots)
    before_k = k_cache.clone()
    fn(k, v, k_cache, v_cache, slots)
    if torch.equal(k_cache, before_k):
        raise ExerciseFailed("the cache did not change: the kernel stored nothing")
    if k_buf[:8 * row].any() or v_buf[:8 * row].any():
        raise ExerciseFailed("a token with slot -1 was stored (just before the cache, out of bounds): mask it out")
    stored = slots >= 0
    k_rows, v_rows = k_cache.reshape(-1, row)[slots[stored]], v_cache.reshape(-1, row)[slots[stored]]
    if torch.equal(k_rows, v[stored].flatten(1)) and torch.equal(v_rows, k[stored].flatten(1)):
        raise ExerciseFailed("K went into the V cache and V into the K cache: keep the argument order "
                             "(k, v, k_cache, v_cache, slot_mapping)")
    if torch.equal(k_cache, want_k) and not torch.equal(v_cache, want_v):
        raise ExerciseFailed("K is right but V is not: store both")
    if not torch.equal(k_cache, want_k) or not torch.equal(v_cache, want_v):
        wrong = int((k_cache != want_k).any(-1).any(-1).sum())
        raise ExerciseFailed(f"{wrong} cache rows differ from storing token t's K/V row at slot_mapping[t]; "
                             "row of slot s starts at s * num_kv_heads * head_dim")
    return "every token's K/V row is in its slot; slot -1 skipped"


def _decode_inputs(g, dev):
    k_cache = torch.randn(10, 8, 2, 16, generator=g)
    v_cache = torch.randn(10, 8, 2, 16, generator=g)
    context_lens = torch.tensor([1, 13, 20])
    block_tables = torch.tensor([[7, -1, -1], [2, 9, -1], [4, 0, 5]], dtype=torch.int32)
    for s, n in enumerate(context_lens.tolist()):  # slots past the context hold large junk
        for t in range(n, 24):
            block = int(block_tables[s, t // 8])
            if block >= 0:
                k_cache[block, t % 8], v_cache[block, t % 8] = 30.0, 30.0
    q = torch.randn(3, 6, 16, generator=g)
    return [x.to(dev) for x in (q, k_cache, v_cache, block_tables, context_lens)]


@exercise("08", "paged_decode", forbidden=(
    "labkit.attention.reference.paged_decode_attention", "labkit.attention.reference.paged_attention",
    "labkit.attention.reference.gather_kv", "labkit.attention.triton_kernels.paged_attention",
    "labkit.attention.triton_kernels._kernels",
))
def paged_decode(ns):
    fn = require(ns, "paged_decode")
    g = torch.Generator().manual_seed(80)
    q, k_cache, v_cache, block_tables, context_lens = _decode_inputs(g, _device())
    got = fn(q, k_cache, v_cache, block_tables, context_lens)
    want = paged_decode_attention(q, k_cache, v_cache, block_tables, context_lens)
    if not isinstance(got, torch.Tensor) or got.shape != want.shape:
        raise ExerciseFailed(f"expected a [num_seqs, num_heads, head_dim] = {tuple(want.shape)} tensor")
    if torch.allclose(got, want, atol=1e-4):
        return "matches the gather-then-attend reference (GQA, partial last blocks)"
    padded = paged_decode_attention(q, k_cache, v_cache, block_tables, (context_lens + 7) // 8 * 8)
    if torch.allclose(got, padded, atol=1e-4):
        raise ExerciseFailed("keys past the context length were attended to: mask positions >= context_len")
    k_mod = k_cache.repeat(1, 1, 3, 1)  # query head h reading KV head h % num_kv_heads
    v_mod = v_cache.repeat(1, 1, 3, 1)
    if torch.allclose(got, paged_decode_attention(q, k_mod, v_mod, block_tables, context_lens), atol=1e-4):
        raise ExerciseFailed("query head h read KV head h % num_kv_heads: with GQA it is h // (num_heads // "
                             "num_kv_heads)")
    if torch.allclose(got, paged_decode_attention(q * q.shape[-1] ** 0.5, k_cache, v_cache, block_tables,
                                                  context_lens), atol=1e-4):
        raise ExerciseFailed("scores were not scaled: multiply q . k by scale = 1/sqrt(head_dim)")
    in_order = torch.arange(block_tables.numel(), dtype=block_tables.dtype, device=block_tables.device)
    if torch.allclose(got, paged_decode_attention(q, k_cache, v_cache, in_order.view_as(block_tables), context_lens),
                      atol=1e-4):
        raise ExerciseFailed("the block table was ignored (blocks assumed to be 0, 1, 2, ...): load block b of "
                             "sequence s from block_tables[s, b]")
    one = paged_decode_attention(q[:1], k_cache, v_cache, block_tables[:1], context_lens[:1])
    if torch.allclose(got[:1], one, atol=1e-4):
        raise ExerciseFailed("right for the one-token context, wrong for longer ones: check the running max "
                             "rescaling (alpha = exp(m_old - m_new)) and the block-table lookup")
    raise ExerciseFailed(f"differs from the reference (max abs diff {(got - want).abs().max():.2e})")


@exercise("08", "knowledge_check")
def knowledge_check(ns):
    from labkit.grading.quiz import Choice, Number, grade_answers, smollm2_config

    block_size, table, position = 16, [7, 1, 4], 37
    smol = smollm2_config()
    return grade_answers(ns, {
        1: Number(table[position // block_size] * block_size + position % block_size,
                  "section 2: block id x block_size + offset"),
        2: Number(7 // (smol.num_heads // smol.num_kv_heads), "section 3, on GQA: h // (H / H_kv)"),
        3: Number(4 * smol.num_heads, "section 3: the grid of the decode kernel"),
        4: Choice("a", "the introduction, on the gather's cost"),
        5: Choice("a", "section 5, achieved memory bandwidth"),
    })
