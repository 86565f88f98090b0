"""The packed fp32 GEMM (labkit/kernels/gemm_f32.c, through labkit.model.packed_linear) against
torch's F.linear, its fallback when there is no compiler, its refusal of bad input, and the engine's
greedy output with it."""

import copy

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from labkit import kernels
from labkit.engine import LLM
from labkit.kernels import build, gemm
from labkit.model import load_model
from labkit.model.packed_linear import PackedF32Linear
from labkit.model.random_weights import SMOLLM2_135M
from labkit.model.weight_formats import apply_weight_format
from labkit.sampling import SamplingParams
from labkit.tokenizer import placeholder_tokenizer

SMOLLM2_SHAPES = [(576, 576), (192, 576), (1536, 576), (576, 1536)]  # (in, out): q/o, k/v, gate/up, down


@pytest.fixture(scope="module")
def compiled():
    if gemm.load_f32() is None:
        pytest.skip(f"no C kernel here: {gemm.load_f32.why_not()}")


def linear(in_features: int, out_features: int, bias: bool = True, seed: int = 0) -> nn.Linear:
    torch.manual_seed(seed)
    return nn.Linear(in_features, out_features, bias=bias)


def assert_matches_f_linear(layer: nn.Linear, x: torch.Tensor) -> None:
    with torch.inference_mode():
        expected = F.linear(x, layer.weight, layer.bias)
        got = PackedF32Linear(layer)(x)
    assert got.shape == expected.shape and got.dtype == torch.float32
    # sums over up to 1536 products in another order: relative error ~1e-6 of the terms' magnitude
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize(("in_features", "out_features"), SMOLLM2_SHAPES)
@pytest.mark.parametrize("rows", [1, 3, 8, 13, 64, 300])
def test_the_models_shapes_match_f_linear(compiled, in_features, out_features, rows):
    """Row counts below, at and past a block of rows, and enough rows for more than one slice of 1536 inputs."""
    assert_matches_f_linear(linear(in_features, out_features, bias=rows % 2 == 1), torch.randn(rows, in_features))


@pytest.mark.parametrize(("rows", "in_features", "out_features"),
                         [(7, 5, 13), (1, 1, 1), (9, 33, 47), (2, 64, 49), (17, 100, 97), (5, 3, 200)])
def test_odd_shapes_match_f_linear(compiled, rows, in_features, out_features):
    """Outputs that fill no panel, part of one, or end in a partial vector; inputs of any length."""
    for bias in (True, False):
        assert_matches_f_linear(linear(in_features, out_features, bias), torch.randn(rows, in_features))


@pytest.mark.parametrize("target", [("AVX2", ["-march=x86-64-v3", "-DLANES=8"]), ("generic", ["-DLANES=4"])])
def test_the_narrower_vector_builds_match_f_linear(compiled, monkeypatch, fresh_build, target):
    """The 8- and 4-float builds (other panel widths and row blocks) that CPUs without AVX-512 get."""
    if target[0] == "AVX2" and torch.backends.cpu.get_cpu_capability() not in ("AVX2", "AVX512"):
        pytest.skip("this CPU cannot run an AVX2 build")
    monkeypatch.setattr(build, "cpu_target", lambda: target)
    assert gemm.load_f32().name == f"C/{target[0]} packed fp32 GEMM"
    assert gemm.load_f32().panel_width == 3 * int(target[1][-1].removeprefix("-DLANES="))
    for rows, in_features, out_features in ((1, 576, 192), (5, 64, 50), (13, 30, 100), (40, 1536, 60)):
        assert_matches_f_linear(linear(in_features, out_features, bias=rows > 4), torch.randn(rows, in_features))


def test_any_leading_shape_strides_and_no_rows(compiled):
    layer = linear(96, 80)
    packed = PackedF32Linear(layer)
    x = torch.randn(3, 5, 96)
    with torch.inference_mode():
        for view in (x, x.transpose(0, 1), x[:, ::2], torch.randn(96, 4).t(), torch.randn(4, 200)[:, 7:103]):
            torch.testing.assert_close(packed(view), F.linear(view, layer.weight, layer.bias), rtol=1e-5, atol=1e-5)
        assert packed(torch.empty(0, 96)).shape == (0, 80) and packed(torch.empty(2, 0, 96)).shape == (2, 0, 80)
        assert packed(torch.randn(96)).shape == (80,)


def test_bad_input_is_refused_with_the_reason(compiled):
    packed = PackedF32Linear(linear(16, 8))
    for bad, words in ((torch.randn(2, 15), r"\(2, 15\)"), (torch.randn(2, 16, dtype=torch.float64), "float64"),
                       (torch.tensor(1.0), r"\(\)")):
        with pytest.raises(ValueError, match=rf"takes float32 CPU inputs \[\.\.\., 16\], got .*{words}"):
            packed(bad)
    with pytest.raises(ValueError, match="packs float32 CPU weights, got torch.bfloat16"):
        PackedF32Linear(linear(16, 8).to(torch.bfloat16))
    with pytest.raises(ValueError, match="cannot become torch.bfloat16"):
        packed.to(torch.bfloat16)


def test_without_a_compiler_the_model_keeps_torchs_linear_and_says_so(monkeypatch, fresh_build):
    monkeypatch.setattr(build, "find_c_compiler", lambda: None)
    assert kernels.describe(dtype=torch.float32).linear.startswith("torch default GEMM float32 (no C compiler)")
    model = nn.Sequential(nn.Linear(8, 8))
    model.dtype, model.device = torch.float32, torch.device("cpu")
    apply_weight_format(model, "dequantized", prepack=True)
    assert type(model[0]) is nn.Linear
    with pytest.raises(RuntimeError, match="unavailable: no C compiler"):
        PackedF32Linear(nn.Linear(8, 8))
    assert list(fresh_build.iterdir()) == []


def test_prepacking_follows_the_rule_per_cpu(compiled, monkeypatch):
    assert gemm.f32_serves_this_cpu() == gemm.load_f32().name.startswith("C/AVX-512")
    for faster, expected in ((True, PackedF32Linear), (False, nn.Linear)):
        monkeypatch.setattr(gemm, "f32_serves_this_cpu", lambda faster=faster: faster)
        model = nn.Sequential(nn.Linear(8, 8))
        model.dtype, model.device = torch.float32, torch.device("cpu")
        apply_weight_format(model, "dequantized", prepack=True)
        assert type(model[0]) is expected
        assert kernels.describe(dtype=torch.float32).linear.startswith("C/") is faster


def test_the_packed_model_keeps_the_logits_and_the_engines_greedy_tokens(compiled, monkeypatch):
    """SmolLM2 with every linear packed, the tied LM head included, against the same model with torch's
    linears (itself at parity with transformers: tests/test_engine.py)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        plain = load_model("smollm2", device="cpu", dtype=torch.float32)
        packed = copy.deepcopy(plain)
        monkeypatch.setattr(gemm, "f32_serves_this_cpu", lambda: True)
        apply_weight_format(packed, "dequantized", prepack=True)
        assert type(packed.lm_head) is PackedF32Linear and type(packed.layers[0].mlp.down_proj) is PackedF32Linear
        ids = torch.tensor([1, 504, 3458, 282, 4649, 314, 253, 1341, 30, 378, 1978, 314])
        with torch.inference_mode():
            assert (packed(ids) - plain(ids)).abs().max() <= 1e-3
        # byte ids: the same prompts for both engines, without a tokenizer load
        tokenizer = placeholder_tokenizer(SMOLLM2_135M.vocab_size)
        greedy = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
        prompts = ["The capital of France is", "def fibonacci(n):\n    ", "1, 2, 3, 4,"]
        engines = [LLM(model, tokenizer=tokenizer, num_kvcache_blocks=32) for model in (plain, packed)]
        tokens = [[out.token_ids for out in llm.generate(prompts, greedy)] for llm in engines]
        assert tokens[0] == tokens[1]
    finally:
        torch.set_num_threads(threads)

