"""The dense backend and the contiguous caches as attention backends, on random tensors against a
naive softmax(QK^T/sqrt(d))V reference, and their refusals of input they cannot serve."""

import pytest
import torch

from labkit.attention.dense import causal_attention, dense_attention
from labkit.attention.metadata import AttentionMetadata
from labkit.cache import KVCache, PreallocatedKVCache
from labkit.model.generate import step_metadata

HQ, HKV, D = 6, 2, 8


def naive(q, k, v):
    """q [Tq, Hq, D] are the last Tq of the Tk positions of k, v [Tk, Hkv, D]."""
    tq, tk = q.shape[0], k.shape[0]
    k, v = k.repeat_interleave(HQ // HKV, 1), v.repeat_interleave(HQ // HKV, 1)
    scores = torch.einsum("qhd,khd->hqk", q, k) / D**0.5
    future = torch.arange(tk)[None, :] > torch.arange(tk - tq, tk)[:, None]
    return torch.einsum("hqk,khd->qhd", scores.masked_fill(future, float("-inf")).softmax(-1), v)


def rand(*shape, seed):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize(("tq", "tk"), [(5, 5), (1, 7), (3, 9)])
def test_causal_attention_aligns_queries_to_the_end(tq, tk):
    q, k, v = rand(tq, HQ, D, seed=1), rand(tk, HKV, D, seed=2), rand(tk, HKV, D, seed=3)
    got = causal_attention(q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1)).transpose(0, 1)
    assert torch.allclose(got, naive(q, k, v), atol=1e-5)


def test_dense_attention_keeps_sequences_apart():
    lens = [3, 1, 5]
    q, k, v = rand(9, HQ, D, seed=4), rand(9, HKV, D, seed=5), rand(9, HKV, D, seed=6)
    got = dense_attention(0, q, k, v, AttentionMetadata.causal(lens))
    bounds = [0, 3, 4, 9]
    for a, b in zip(bounds[:-1], bounds[1:], strict=True):
        assert torch.allclose(got[a:b], naive(q[a:b], k[a:b], v[a:b]), atol=1e-5)


def test_dense_attention_refuses_cached_context():
    q = rand(1, HQ, D, seed=7)
    with pytest.raises(ValueError, match="keeps no KV cache"):
        dense_attention(0, q, q[:, :HKV], q[:, :HKV], step_metadata(1, 1, 4, "cpu"))
    with pytest.raises(ValueError, match="more queries"):
        causal_attention(rand(HQ, 3, D, seed=8), rand(HKV, 2, D, seed=9), rand(HKV, 2, D, seed=9))


@pytest.mark.parametrize("make", [lambda: KVCache(2), lambda: PreallocatedKVCache(2, 2, 16, HKV, D)])
def test_cache_backends_match_attention_over_the_whole_sequence(make):
    cache, batch, total = make(), 2, 9
    q = rand(batch, total, HQ, D, seed=10)
    k, v = rand(batch, total, HKV, D, seed=11), rand(batch, total, HKV, D, seed=12)
    start = 0
    for n in (4, 2, 1, 1, 1):
        meta = step_metadata(batch, n, start, "cpu")
        flat = [x[:, start:start + n].reshape(batch * n, *x.shape[2:]) for x in (q, k, v)]
        for layer in range(2):
            out = cache(layer, *flat, meta).view(batch, n, HQ, D)
        for b in range(batch):
            assert torch.allclose(out[b], naive(q[b, start:start + n], k[b, :start + n], v[b, :start + n]), atol=1e-5)
        start += n
    assert cache.seq_len == total
    assert cache.nbytes == (2 * 2 * batch * HKV * D * 4 * (total if isinstance(cache, KVCache) else 16))


def test_caches_refuse_what_they_cannot_hold():
    q, k = rand(5, HQ, D, seed=13), rand(5, HKV, D, seed=14)
    uneven = AttentionMetadata.causal([2, 3])
    with pytest.raises(ValueError, match="equal-length sequences"):
        KVCache(1)(0, q, k, k, uneven)
    with pytest.raises(ValueError, match="cache holds 0"):
        KVCache(1)(0, q, k, k, step_metadata(1, 5, 3, "cpu"))
    with pytest.raises(ValueError, match="layer 1 out of range"):
        KVCache(1)(1, q, k, k, step_metadata(1, 5, 0, "cpu"))
    with pytest.raises(ValueError, match="KV cache full"):
        PreallocatedKVCache(1, 1, 4, HKV, D)(0, q, k, k, step_metadata(1, 5, 0, "cpu"))
    with pytest.raises(ValueError, match="allocated for batch size 2"):
        PreallocatedKVCache(1, 2, 8, HKV, D)(0, q, k, k, step_metadata(1, 5, 0, "cpu"))
    with pytest.raises(ValueError, match="num_layers must be a positive integer"):
        KVCache(0)
    cache = KVCache(1)
    cache(0, q[:4], k[:4], k[:4], step_metadata(2, 2, 0, "cpu"))
    with pytest.raises(ValueError, match="batch size changed"):
        cache(0, q[:3], k[:3], k[:3], step_metadata(3, 1, 2, "cpu"))
