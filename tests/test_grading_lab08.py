"""Lab 08 graders, fed Triton kernels (run by the interpreter) with each typical mistake."""

import os

os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402
import torch  # noqa: E402
import triton  # noqa: E402
import triton.language as tl  # noqa: E402

from labkit.grading.core import get_exercise, run_exercise  # noqa: E402


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


def stub(*args):
    raise NotImplementedError()


@pytest.mark.parametrize("name, fn, passed, message", [
    ("store_kvcache", store_variant(), True, "slot -1 skipped"),
    ("store_kvcache", stub, False, "not implemented yet"),
    ("store_kvcache", store_variant(mask_minus_one=False), False, "slot -1 was stored"),
    ("store_kvcache", store_variant(store_v=False), False, "store both"),
    ("paged_decode", decode_variant(), True, "matches the gather-then-attend reference"),
    ("paged_decode", stub, False, "not implemented yet"),
    ("paged_decode", decode_variant(mask=False), False, "past the context length"),
    ("paged_decode", decode_variant(gqa_div=False), False, "h % num_kv_heads"),
    ("paged_decode", decode_variant(rescale=False), False, "rescaling"),
])
def test_lab08_graders_triton(name, fn, passed, message):
    outcome = run_exercise(get_exercise("08", name), {name: fn})
    assert message in outcome.message and outcome.passed == passed
