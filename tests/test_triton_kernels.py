"""Triton kernels against the torch reference, on this CPU under the Triton interpreter.

TRITON_INTERPRET=1 must be set before the kernels are defined; labkit defines them on first use,
so setting it here, before anything runs, is enough. Shapes are small: the interpreter is slow.
"""

import os

os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402
import torch  # noqa: E402

from labkit.attention import reference, triton_kernels  # noqa: E402
from labkit.attention.reference import random_paged_inputs as paged_setup  # noqa: E402
from labkit.cache.paged_storage import store_kv  # noqa: E402

pytestmark = pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1" and not torch.cuda.is_available(),
                                reason="TRITON_INTERPRET was set to something other than 1 before the tests ran")

SHAPES = [(d, bs, g) for d in (64, 128) for bs in (8, 16, 32) for g in (1, 3, 8)]


def run_both(k_lens, q_lens, head_dim, block_size, group, num_kv_heads=1, dtype=torch.float32, seed=0):
    q, k_cache, v_cache, tables, cu_q, cu_k = paged_setup(k_lens, q_lens, num_kv_heads, head_dim, block_size,
                                                          group * num_kv_heads, seed=seed, dtype=dtype)
    got = triton_kernels.paged_attention(q, k_cache, v_cache, tables, cu_q, cu_k, max(q_lens))
    expected = reference.paged_attention(q.float(), k_cache.float(), v_cache.float(), tables, cu_q, cu_k)
    assert got.shape == q.shape and got.dtype == dtype
    return (got.float() - expected).abs().max().item()


@pytest.mark.parametrize("head_dim, block_size, group", SHAPES)
def test_triton_paged_decode_matches_reference(head_dim, block_size, group):
    # one-token context, a length that is a multiple of nothing, and one past a block boundary
    assert run_both([1, 13, 2 * block_size + 1], [1, 1, 1], head_dim, block_size, group) <= 1e-5


@pytest.mark.parametrize("head_dim, block_size, group", SHAPES)
def test_triton_paged_prefill_with_cached_prefix_and_chunks_matches_reference(head_dim, block_size, group):
    # whole prompt; prompt after a cached prefix; a middle chunk of a long prompt; a decode in the mix
    k_lens, q_lens = [11, block_size + 5, 37, 9], [11, 5, 17, 1]
    assert run_both(k_lens, q_lens, head_dim, block_size, group) <= 1e-5


def test_triton_paged_attention_several_kv_heads_and_a_long_chunk():
    # more new tokens than one query tile holds, two KV heads with groups of 3
    assert run_both([70, 3], [70, 2], 64, 16, 3, num_kv_heads=2) <= 1e-5


TOLERANCE = triton_kernels.TOLERANCE  # against the fp32 reference on the same (rounded) inputs


@pytest.mark.parametrize("dtype", list(TOLERANCE), ids=str)
@pytest.mark.parametrize("k_lens, q_lens, head_dim, block_size, group, num_kv_heads", [
    ([13, 1, 37], [13, 1, 5], 64, 16, 3, 2),   # prefill, decode and a prefill over a cached prefix
    ([20, 9], [1, 1], 128, 8, 1, 1),           # decode only, no grouping
    ([33], [17], 24, 16, 8, 1),                # a chunk; head_dim not a power of two
])
def test_triton_paged_attention_in_every_engine_dtype(dtype, k_lens, q_lens, head_dim, block_size, group,
                                                      num_kv_heads):
    assert run_both(k_lens, q_lens, head_dim, block_size, group, num_kv_heads, dtype=dtype) <= TOLERANCE[dtype]


@pytest.mark.parametrize("dtype", list(TOLERANCE), ids=str)
def test_triton_store_kvcache_in_every_engine_dtype(dtype):
    g = torch.Generator().manual_seed(1)
    k_cache, v_cache = (torch.randn(3, 4, 2, 16, generator=g).to(dtype) for _ in range(2))
    k, v = (torch.randn(4, 2, 16, generator=g).to(dtype) for _ in range(2))
    slots = torch.tensor([0, 11, -1, 5])
    expected_k, expected_v = k_cache.clone(), v_cache.clone()
    store_kv(k, v, expected_k, expected_v, slots)
    triton_kernels.store_kvcache(k, v, k_cache, v_cache, slots)
    assert torch.equal(k_cache, expected_k) and torch.equal(v_cache, expected_v)


@pytest.mark.parametrize("head_dim", [64, 128, 24])
def test_triton_store_kvcache_matches_torch_and_skips_minus_one(head_dim):
    g = torch.Generator().manual_seed(head_dim)
    k_cache = torch.randn(4, 8, 3, head_dim, generator=g)
    v_cache = torch.randn(4, 8, 3, head_dim, generator=g)
    qkv = torch.randn(5, 10, head_dim, generator=g)  # k and v as slices of a fused projection (strided)
    k, v = qkv[:, 4:7], qkv[:, 7:10]
    slots = torch.tensor([3, -1, 31, 8, -1])
    expected_k, expected_v = k_cache.clone(), v_cache.clone()
    store_kv(k, v, expected_k, expected_v, slots)
    triton_kernels.store_kvcache(k, v, k_cache, v_cache, slots)
    assert torch.equal(k_cache, expected_k) and torch.equal(v_cache, expected_v)


def test_triton_kernels_reject_mismatched_inputs():
    q, k_cache, v_cache, tables, cu_q, cu_k = paged_setup([5], [5], 2, 16, 8, 6)
    with pytest.raises(ValueError, match="num_heads \\(5\\) must be a multiple"):
        triton_kernels.paged_attention(q[:, :5], k_cache, v_cache, tables, cu_q, cu_k, 5)
    with pytest.raises(ValueError, match="does not match caches"):
        triton_kernels.paged_attention(q.half(), k_cache, v_cache, tables, cu_q, cu_k, 5)
    with pytest.raises(ValueError, match="slot_mapping"):
        triton_kernels.store_kvcache(q[:, :2], q[:, :2], k_cache, v_cache, torch.tensor([0, 1]))
