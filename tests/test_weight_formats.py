"""Weight formats: the GGUF's own Q4_1 blocks, int8 and prepacked bf16/fp32, against the dequantized model."""

import pytest
import torch
import torch.nn.functional as F

from labkit import kernels
from labkit.engine import LLM
from labkit.kernels import build, gemm, int8_dot
from labkit.model import DecoderModel, load_model
from labkit.model.gguf_loader import load_gguf, load_q4_1_blocks
from labkit.model.packed_linear import PackedBf16Linear, PackedF32Linear
from labkit.model.weight_formats import (
    Int8Linear,
    PrepackedLinear,
    Q4Linear,
    apply_weight_format,
    dequantize_q4_1,
    quantize_q4_1,
)
from labkit.registry import resolve_model_path
from labkit.sampling import SamplingParams
from labkit.tokenizer import load_tokenizer

PROMPT = [1, 504, 3458, 282, 4649, 314, 253, 1341, 30, 378, 1978, 314, 3458, 282, 4649, 314]


@pytest.fixture(scope="module")
def gguf():
    path = resolve_model_path("smollm2")
    config, weights = load_gguf(path)
    return config, weights, load_q4_1_blocks(path)


@pytest.fixture(scope="module")
def fp32_model(gguf):
    config, weights, _ = gguf
    return DecoderModel.from_state_dict(config, weights)


def _formatted(gguf, weight_format, prepack=False):
    config, weights, blocks = gguf
    model = DecoderModel.from_state_dict(config, weights, dtype=torch.bfloat16)
    apply_weight_format(model, weight_format, prepack=prepack, q4_blocks=blocks)
    return model


def test_the_files_q4_1_blocks_dequantize_to_exactly_the_loaders_weights(gguf):
    _, weights, blocks = gguf
    assert len(blocks) == 210  # every layer matrix of SmolLM2's file; the embedding is Q8_0
    for name, (codes, d, m) in blocks.items():
        assert codes.dtype == torch.uint8 and int(codes.max()) <= 15
        assert torch.equal(dequantize_q4_1(codes, d, m), weights[name]), name


def test_quantize_q4_1_reproduces_the_files_codes_from_its_weights(gguf):
    """llama.cpp's rounding rule, re-applied to what the file dequantizes to, gives back its blocks."""
    _, weights, blocks = gguf
    for name in ("layers.0.self_attn.q_proj.weight", "layers.7.self_attn.k_proj.weight",
                 "layers.29.mlp.down_proj.weight"):
        codes, d, m = quantize_q4_1(weights[name])
        assert torch.equal(codes, blocks[name][0]) and torch.equal(d, blocks[name][1]), name
        assert torch.equal(m, blocks[name][2]), name


@pytest.mark.parametrize("rows", [1, 5, 64])
def test_each_kernel_multiplies_like_f_linear_on_its_own_weights(gguf, rows):
    _, weights, blocks = gguf
    name = "layers.3.mlp.gate_proj.weight"
    dense = weights[name]
    x = torch.randn(rows, dense.shape[1], generator=torch.Generator().manual_seed(rows)).bfloat16()
    q4 = Q4Linear(*blocks[name])
    # int8 activations (the C kernel, up to DENSE_FROM_ROWS rows) move outputs of size ~5 by up to ~0.2
    # here; tests/test_int8_dot.py checks that arithmetic exactly and bounds its distance from F.linear
    # above it, a bf16 GEMM of the weight rounded to bf16: outputs of ~5 move by up to ~0.06
    atol = 0.3 if q4.native is not None and rows <= int8_dot.DENSE_FROM_ROWS else 0.08
    torch.testing.assert_close(q4(x).float(), F.linear(x.float(), dequantize_q4_1(*blocks[name])), atol=atol, rtol=0.02)
    linear = torch.nn.Linear(dense.shape[1], dense.shape[0], bias=True)
    linear.weight.data, linear.bias.data = dense.clone(), torch.randn(dense.shape[0])
    int8 = Int8Linear(linear)
    dequantized = (int8.native.dequantized(torch.float32) if int8.native
                   else int8.codes.float() * int8.scale.float()[:, None])
    row_max = dense.abs().amax(1, keepdim=True)
    assert ((dequantized - dense).abs() <= row_max / 254 + row_max / 128).all()  # half a step + the bf16 scale
    torch.testing.assert_close(int8(x).float(), F.linear(x.float(), dequantized, linear.bias), atol=atol, rtol=0.02)
    if gemm.prepacks_bf16():
        packed = PrepackedLinear(linear.bfloat16())
        torch.testing.assert_close(packed(x), F.linear(x, linear.weight, linear.bias), atol=0.03, rtol=0.02)


@pytest.mark.parametrize("in_features", [100, 576])
def test_torchs_int8_fallback_takes_any_width(monkeypatch, in_features):
    """torch's _weight_int8pack_mm segfaults on bf16 widths such as 100 (not multiples of 16): the fallback pads."""
    monkeypatch.setattr(int8_dot, "load", lambda: None)
    linear = torch.nn.Linear(in_features, 24, bias=True)
    int8 = Int8Linear(linear)
    assert int8.native is None and int8.codes.shape == (24, -(-in_features // 16) * 16)
    x = torch.randn(2, 3, in_features, generator=torch.Generator().manual_seed(0)).bfloat16()
    dequantized = int8.codes[:, :in_features].float() * int8.scale.float()[:, None]
    torch.testing.assert_close(int8(x).float(), F.linear(x.float(), dequantized, linear.bias), atol=0.03, rtol=0.02)


@pytest.mark.parametrize("weight_format", ["q4_1", "int8"])
def test_a_quantized_model_stays_near_the_dequantized_fp32_model(gguf, fp32_model, weight_format):
    """The GGUF's own 4-bit weights differ from fp32 by bf16 activations only; int8 re-rounds the
    weights too, so its bound is looser. Both predict the same next tokens on a real prompt."""
    ids = torch.tensor(PROMPT)
    model = _formatted(gguf, weight_format)
    layer = model.layers[0]
    assert isinstance(layer.mlp.down_proj, Q4Linear if weight_format == "q4_1" else Int8Linear)
    assert isinstance(model.lm_head, Int8Linear) and model.embed_tokens.weight.dtype == torch.bfloat16
    with torch.inference_mode():
        reference, logits = fp32_model(ids), model(ids).float()
    assert (logits - reference).abs().max() < (2.0 if weight_format == "q4_1" else 4.0)
    assert (logits.argmax(-1) == reference.argmax(-1)).float().mean() >= 0.9


def test_the_engine_runs_q4_1_greedy_like_the_dequantized_bf16_model(gguf):
    tokenizer = load_tokenizer("smollm2")
    greedy = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    tokens = {fmt: LLM(_formatted(gguf, fmt, prepack=True), tokenizer=tokenizer).generate([PROMPT], greedy)[0].token_ids
              for fmt in ("q4_1", "dequantized")}
    assert tokens["q4_1"] == tokens["dequantized"]


def test_prepacking_applies_where_it_is_the_faster_kernel(gguf):
    config, weights, _ = gguf
    fp32 = DecoderModel.from_state_dict(config, weights)
    apply_weight_format(fp32, "dequantized", prepack=True)  # fp32: the packed C GEMM where it measured faster
    assert type(fp32.layers[0].self_attn.q_proj) is (PackedF32Linear if gemm.f32_serves_this_cpu() else torch.nn.Linear)
    packed = _formatted(gguf, "dequantized", prepack=True)  # bf16: the C GEMM (AMX, AVX512-BF16), else oneDNN's
    ours = gemm.load_bf16() is not None
    expected = PackedBf16Linear if ours else PrepackedLinear if gemm.prepacks_bf16() else torch.nn.Linear
    assert type(packed.layers[0].self_attn.q_proj) is expected
    bf16 = kernels.describe(dtype=torch.bfloat16).linear
    assert ("oneDNN" in bf16) == (gemm.prepacks_bf16() and not ours) and ("packed bf16 GEMM" in bf16) == ours
    expected = ("Q4_1 x int8", "int8 x int8") if int8_dot.load() is not None else ("torch int4", "torch int8")
    assert (expected[0] in kernels.describe(dtype=torch.bfloat16, weight_format="q4_1").linear
            and expected[1] in kernels.describe(dtype=torch.bfloat16, weight_format="int8").linear)


def test_bad_formats_are_refused_before_any_weight_is_read(gguf, monkeypatch, fresh_build):
    with pytest.raises(ValueError, match="weight_format must be one of"):
        load_model("smollm2", device="cpu", weight_format="q4_0")
    with pytest.raises(ValueError, match="takes float32 or bfloat16 activations, got torch.float16"):
        load_model("smollm2", device="cpu", dtype=torch.float16, weight_format="q4_1")
    with monkeypatch.context() as patch:  # torch's own kernels: bf16 only
        patch.setattr(build, "find_c_compiler", lambda: None)
        with pytest.raises(ValueError, match=r"needs dtype=torch.bfloat16 here: without the C int8 dot kernel \(no C"):
            load_model("smollm2", device="cpu", dtype=torch.float32, weight_format="int8")
    int8_dot.load.cache_clear()
    with pytest.raises(ValueError, match="chosen when the model is loaded"):
        LLM(_formatted(gguf, "dequantized"), tokenizer=object(), weight_format="q4_1")
    codes, d, m = gguf[2]["layers.0.self_attn.k_proj.weight"]
    with pytest.raises(ValueError, match="codes must lie in 0..15"):
        Q4Linear(codes + 16, d, m)
    with pytest.raises(ValueError, match="do not match codes"):
        Q4Linear(codes, d[:, :-1], m[:, :-1])
    with pytest.raises(ValueError, match="divisible by 32"):
        quantize_q4_1(torch.randn(4, 40))
