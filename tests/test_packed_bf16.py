"""The packed bf16 GEMM (labkit/kernels/gemm_bf16.c, through labkit.model.packed_linear), in each
build this CPU runs (AMX, AVX512-BF16), against float64 products of the same bf16 numbers; its
float32-in/float32-out entry (the fused decode step's), its fallback on CPUs with neither extension,
and its refusal of bad input."""

import re

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from labkit import kernels
from labkit.kernels import build, gemm
from labkit.model.packed_linear import PackedBf16Linear
from labkit.model.weight_formats import PrepackedLinear, apply_weight_format

SMOLLM2_SHAPES = [(576, 576), (576, 192), (576, 1536), (1536, 576)]  # (in, out): q/o, k/v, gate/up, down


EXTENSION_FLAGS = {"AMX-BF16": {"amx_tile", "amx_bf16"}, "AVX512-BF16": {"avx512_bf16"}}


@pytest.fixture(scope="module", params=list(EXTENSION_FLAGS))
def compiled(request):
    """The kernel built for one extension: a CPU with AMX also runs the AVX512-BF16 build, which these
    tests reach by hiding AMX's flags from the loader."""
    flags = build.x86_flags()
    if not EXTENSION_FLAGS[request.param] <= flags:
        pytest.skip(f"this CPU has no {request.param}")
    with pytest.MonkeyPatch.context() as patch:
        if request.param != "AMX-BF16":
            patch.setattr(build, "x86_flags", lambda: flags - EXTENSION_FLAGS["AMX-BF16"])
        gemm.load_bf16.cache_clear()
        if gemm.load_bf16() is None:
            pytest.skip(f"no packed bf16 GEMM here: {gemm.load_bf16.why_not()}")
        yield request.param
    gemm.load_bf16.cache_clear()


def linear(in_features: int, out_features: int, bias: bool = True, seed: int = 0) -> nn.Linear:
    torch.manual_seed(seed)
    return nn.Linear(in_features, out_features, bias=bias, dtype=torch.bfloat16)


def exact(layer: nn.Linear, x: torch.Tensor) -> torch.Tensor:
    """The float64 product of the same bf16 numbers: what a bf16 GEMM with float32 sums approximates."""
    bias = None if layer.bias is None else layer.bias.double()
    return F.linear(x.double(), layer.weight.double(), bias)


def assert_matches(layer: nn.Linear, x: torch.Tensor) -> None:
    with torch.inference_mode():
        got = PackedBf16Linear(layer)(x)
    expected = exact(layer, x)
    assert got.shape == expected.shape and got.dtype == torch.bfloat16
    # float32 sums, then one rounding to bf16 (8 bits): within one bf16 step of the exact value
    torch.testing.assert_close(got.double(), expected, rtol=2 ** -7, atol=1e-4)


@pytest.mark.parametrize(("in_features", "out_features"), SMOLLM2_SHAPES)
@pytest.mark.parametrize("rows", [1, 15, 16, 17, 40, 64, 300])
def test_the_models_shapes_match_the_exact_product(compiled, in_features, out_features, rows):
    """Rows in part of a tile, one, a tile and one, a decode batch, and more than one slice of rows."""
    assert_matches(linear(in_features, out_features, bias=rows % 2 == 1), torch.randn(rows, in_features,
                                                                                      dtype=torch.bfloat16))


@pytest.mark.parametrize(("rows", "in_features", "out_features"),
                         [(7, 5, 13), (1, 1, 1), (9, 33, 47), (2, 64, 49), (33, 100, 97), (5, 3, 200)])
def test_odd_shapes_match_the_exact_product(compiled, rows, in_features, out_features):
    """Inputs padded to a step of 32, outputs that fill part of a panel."""
    for bias in (True, False):
        assert_matches(linear(in_features, out_features, bias), torch.randn(rows, in_features, dtype=torch.bfloat16))


def test_float32_rows_in_and_out_as_the_fused_step_calls_it(compiled):
    """x float32 is rounded to bf16 (nearest even, as torch rounds) and y stays float32: equal, up to the
    order of float32 sums, to torch's product of the rounded rows."""
    layer, x = linear(200, 70, bias=False), torch.randn(21, 200) * 3
    packed, y = PackedBf16Linear(layer), torch.empty(21, 70)
    kernel = gemm.load_bf16()
    assert kernel.gemm(x.data_ptr(), 1, 200, packed.packed.data_ptr(), None, y.data_ptr(), 1, 21, 70,
                       packed.padded_in_features, 200) == 0
    expected = F.linear(x.to(torch.bfloat16).double(), layer.weight.double()).float()
    torch.testing.assert_close(y, expected, rtol=1e-5, atol=1e-5)
    assert kernels.describe(dtype=torch.bfloat16).linear.startswith(f"C/{compiled} packed bf16 GEMM")


def test_any_leading_shape_strides_and_no_rows(compiled):
    layer = linear(96, 80)
    packed = PackedBf16Linear(layer)
    x = torch.randn(3, 5, 96, dtype=torch.bfloat16)
    with torch.inference_mode():
        for view in (x, x.transpose(0, 1), x[:, ::2], torch.randn(96, 4, dtype=torch.bfloat16).t(),
                     torch.randn(4, 200, dtype=torch.bfloat16)[:, 7:103]):
            torch.testing.assert_close(packed(view).double(), exact(layer, view), rtol=2 ** -7, atol=1e-4)
        assert packed(torch.empty(0, 96, dtype=torch.bfloat16)).shape == (0, 80)
        assert packed(torch.randn(96, dtype=torch.bfloat16)).shape == (80,)


def test_nan_and_infinity_pass_through(compiled):
    layer = linear(64, 32, bias=False)
    x = torch.randn(3, 64, dtype=torch.bfloat16)
    x[1, 5], x[2, 7] = float("nan"), float("inf")
    with torch.inference_mode():
        got = PackedBf16Linear(layer)(x)
    assert got[0].isfinite().all() and got[1].isnan().all() and not got[2].isfinite().any()


def test_bad_input_is_refused_with_the_reason(compiled):
    packed = PackedBf16Linear(linear(16, 8))
    for bad, words in ((torch.randn(2, 15, dtype=torch.bfloat16), r"\(2, 15\)"), (torch.randn(2, 16), "float32"),
                       (torch.tensor(1.0, dtype=torch.bfloat16), r"\(\)")):
        with pytest.raises(ValueError, match=rf"takes bfloat16 CPU inputs \[\.\.\., 16\], got .*{words}"):
            packed(bad)
    with pytest.raises(ValueError, match="packs bfloat16 CPU weights, got torch.float32"):
        PackedBf16Linear(linear(16, 8).float())
    with pytest.raises(ValueError, match="cannot become torch.float32"):
        packed.float()


def test_without_a_bf16_extension_a_bf16_model_keeps_onednn_or_torch_and_says_why(monkeypatch, fresh_build):
    monkeypatch.setattr(build, "x86_flags", lambda: {"avx512f", "avx2"})
    why = "the CPU has neither AMX-BF16 nor AVX512-BF16"
    assert gemm.load_bf16.why_not() == why
    with pytest.raises(RuntimeError, match=rf"unavailable: {re.escape(why)}"):
        PackedBf16Linear(linear(8, 8))
    described = kernels.describe(dtype=torch.bfloat16)
    assert "packed bf16" not in described.linear and described.fused_step == f"none (no packed bf16 GEMM: {why})"
    model = nn.Sequential(linear(8, 8))
    model.dtype, model.device = torch.bfloat16, torch.device("cpu")
    apply_weight_format(model, "dequantized", prepack=True)
    assert type(model[0]) in (PrepackedLinear, nn.Linear)
    assert not list(fresh_build.glob("gemm_bf16-*"))  # nothing was built


def test_a_build_that_fails_is_named(compiled, monkeypatch, fresh_build):
    monkeypatch.setattr(build, "find_c_compiler", lambda: None)
    assert gemm.load_bf16.why_not() == "no C compiler"

