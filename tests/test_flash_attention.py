"""The Triton FlashAttention forward against torch's SDPA (on the interpreter without a GPU), and its traffic."""

import pytest
import torch
import torch.nn.functional as F

from labkit.attention.flash import attention_hbm_bytes, flash_attention
from labkit.attention.triton_kernels import TOLERANCE


def sdpa_varlen(q, k, v, seq_lens):
    """The oracle: torch's SDPA, causal, one sequence at a time, KV heads repeated for GQA."""
    group = q.shape[1] // k.shape[1]
    out, start = [], 0
    for n in seq_lens:
        qs, ks, vs = (t[start:start + n].transpose(0, 1).float() for t in (q, k, v))
        ks, vs = ks.repeat_interleave(group, 0), vs.repeat_interleave(group, 0)
        out.append(F.scaled_dot_product_attention(qs, ks, vs, is_causal=True).transpose(0, 1))
        start += n
    return torch.cat(out)


def packed(seq_lens, heads, kv_heads, head_dim, dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    t = sum(seq_lens)
    q, k, v = (torch.randn(t, h, head_dim, generator=g).to(dtype) for h in (heads, kv_heads, kv_heads))
    cu = torch.tensor([0, *seq_lens]).cumsum(0)
    return q, k, v, cu


@pytest.mark.parametrize("seq_lens, heads, kv_heads, head_dim", [
    ([1, 5, 40], 4, 2, 16),   # a one-token sequence, a partial tile, several tiles; GQA
    ([17], 2, 2, 24),         # head_dim padded to 32
    ([33, 16], 3, 1, 16),     # MQA, a sequence ending exactly on a tile boundary
])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_flash_attention_matches_sdpa(seq_lens, heads, kv_heads, head_dim, dtype):
    q, k, v, cu = packed(seq_lens, heads, kv_heads, head_dim, dtype)
    out = flash_attention(q, k, v, cu, max(seq_lens), block_m=16, block_n=16)
    assert out.dtype == dtype and out.shape == q.shape
    torch.testing.assert_close(out.float(), sdpa_varlen(q, k, v, seq_lens), rtol=0, atol=TOLERANCE[dtype])


def test_flash_attention_rejects_bad_inputs():
    q, k, v, cu = packed([4, 4], 4, 2, 16, torch.float32)
    with pytest.raises(ValueError, match="cu_seqlens must run from 0 to the 8 tokens"):
        flash_attention(q, k, v, cu[:-1], 4)
    with pytest.raises(ValueError, match=r"num_heads \(4\) must be a multiple of num_kv_heads \(3\)"):
        flash_attention(q, torch.zeros(8, 3, 16), torch.zeros(8, 3, 16), cu, 4)
    with pytest.raises(ValueError, match="must share a dtype"):
        flash_attention(q, k.half(), v.half(), cu, 4)
    with pytest.raises(ValueError, match=r"must be on one device, got \['cpu', 'meta'\]"):
        flash_attention(q, k, v, cu.to("meta"), 4)


def test_flash_attention_names_cpu_tensors_without_the_interpreter(monkeypatch):
    """Compiled Triton reads GPU memory: CPU tensors get an error that says so, not Triton's pointer error."""
    q, k, v, cu = packed([4], 2, 2, 16, torch.float32)
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    with pytest.raises(ValueError, match="got CPU tensors, but Triton compiles for the GPU here"):
        flash_attention(q, k, v, cu, 4)


def test_hbm_traffic_formulas():
    # N = 128, d = 64, tiles of 64: naive 4Nd + 4N^2; flash 2Nd + 2d (64 + 128) K/V rows (tile 0 reads one key tile)
    bytes_ = attention_hbm_bytes(128, 64, num_heads=1, dtype_bytes=2)
    assert bytes_["naive"] == (4 * 128 * 64 + 4 * 128 * 128) * 2
    assert bytes_["flash"] == (2 * 128 * 64 + 2 * 64 * (64 + 128)) * 2
    # long sequences: naive ~ 4 N^2, causal flash ~ N^2 d / block_m, so the ratio tends to 4 block_m / d = 8
    long = attention_hbm_bytes(4096, 64, num_heads=9, dtype_bytes=2, block_m=128)
    assert 0.85 * 8 < long["naive"] / long["flash"] < 8
