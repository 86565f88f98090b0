"""fp16 tops out at 65,504; a decoder's residual stream can outgrow it. In fp16 the decoder carries the
residual in fp32 and saturates what sublayers add, so a model whose activations exceed fp16's range
still gives finite logits close to the same model in fp32 (fp16 matmuls run on the CPU too)."""

import torch

from labkit.attention.dense import dense_attention
from labkit.attention.metadata import AttentionMetadata
from labkit.model import DecoderModel, ModelConfig
from labkit.model.layers import clamp_to_range, residual_dtype, rope_cos_sin, rope_inv_freq

CONFIG = ModelConfig(architecture="llama", vocab_size=64, hidden_size=32, intermediate_size=64, num_layers=3,
                     num_heads=4, num_kv_heads=2, head_dim=8, max_position_embeddings=64, rms_norm_eps=1e-5,
                     rope_theta=10000.0, tie_word_embeddings=False)


def large_activation_model(seed=0) -> dict[str, torch.Tensor]:
    """Random weights, each representable in fp16, whose sublayers push the residual stream past 65,504."""
    g = torch.Generator().manual_seed(seed)
    with torch.device("meta"):
        shapes = {k: v.shape for k, v in DecoderModel(CONFIG).state_dict().items()}
    weights = {k: torch.randn(s, generator=g) * 0.2 for k, s in shapes.items()}
    for k in weights:
        if k.endswith("norm.weight"):
            weights[k] = torch.ones_like(weights[k])
        if k.endswith(("o_proj.weight", "down_proj.weight")):
            weights[k] *= 1e4  # outliers of the kind real models have in a few channels
    weights["embed_tokens.weight"] = (weights["embed_tokens.weight"] * 1e5).clamp(-6e4, 6e4)
    return weights


def residual_peak(model: DecoderModel, ids: torch.Tensor) -> float:
    """The largest |value| the residual stream takes between layers."""
    meta = AttentionMetadata.causal([len(ids)])
    cos, sin = rope_cos_sin(torch.arange(len(ids)), rope_inv_freq(CONFIG.head_dim, CONFIG.rope_theta), model.dtype)
    x, peak = model.embed_tokens(ids), 0.0
    for layer in model.layers:
        x = layer(x, cos, sin, meta, dense_attention)
        peak = max(peak, x.abs().max().item())
    return peak


def test_fp16_residual_stream_beyond_65504_stays_finite_and_matches_fp32():
    weights = large_activation_model()
    ids = torch.tensor([3, 17, 42, 5, 9, 60])
    fp32 = DecoderModel.from_state_dict(CONFIG, weights, dtype=torch.float32)
    fp16 = DecoderModel.from_state_dict(CONFIG, weights, dtype=torch.float16)
    assert residual_peak(fp32, ids) > 1.25 * torch.finfo(torch.float16).max  # the premise: fp16 alone overflows
    expected = fp32(ids)
    got = fp16(ids)
    assert got.dtype == torch.float16 and torch.isfinite(got).all()
    assert (got.float() - expected).abs().max() <= 0.01 * expected.abs().max()
    assert torch.equal(got.float().argmax(-1), expected.argmax(-1))


def test_only_fp16_gets_an_fp32_residual_and_a_clamp():
    assert residual_dtype(torch.float16) == torch.float32
    assert residual_dtype(torch.bfloat16) == torch.bfloat16 and residual_dtype(torch.float32) == torch.float32
    big = torch.tensor([1e6, -1e6, 3.0])
    assert clamp_to_range(big).tolist() == big.tolist()  # fp32 untouched
    assert clamp_to_range(torch.tensor([float("inf"), -float("inf"), 3.0]).half()).tolist() == [65504.0, -65504.0, 3.0]
