"""The C int8 dot kernel (labkit.kernels.int8_dot) against its arithmetic written out in torch, its dense
path for large batches, its fallback when it cannot be built, and its refusal of bad input."""

import pytest
import torch
import torch.nn.functional as F

from labkit import kernels
from labkit.kernels import build, int8_dot
from labkit.model.weight_formats import Int8Linear, Q4Linear, dequantize_q4_1, quantize_q4_1


@pytest.fixture(scope="module")
def compiled():
    if int8_dot.load() is None:
        pytest.skip(f"no C kernel here: {int8_dot.load.why_not()}")


def built_with_avx() -> bool:
    return "AVX" in int8_dot.load().name


def quantized_activations(x: torch.Tensor):
    """llama.cpp's Q8_1 blocks of each row, as the kernel computes them: per group of 32 (zero-padded),
    codes round(x / s) with s = max|x| / 127 in float32, then s and s * sum(codes) rounded to float16;
    x / s is x * (127 / max|x|) in an AVX build, as llama.cpp's AVX code has it, else x * (1 / s).
    Returns (codes, s, rounded s, rounded s * sum(codes)) in float64."""
    rows, n = x.shape
    groups = F.pad(x.float(), (0, -n % 32)).view(rows, -1, 32)
    amax = groups.abs().amax(-1)
    s = amax / 127
    numerator, divisor = (torch.full_like(s, 127), amax) if built_with_avx() else (torch.ones_like(s), s)
    inverse = torch.where(s > 0, numerator / divisor, torch.zeros_like(s))  # tensor / tensor: one IEEE division
    codes = torch.round(groups * inverse[..., None])
    return (codes.double(), s.double(), s.half().double(), (codes.sum(-1) * s).half().double())


def q4_1_oracle(x, codes, d, m):
    """sum over groups of d s (codes . a) + m S, in float64."""
    a, _, s, sums = quantized_activations(x)
    q = F.pad(codes.double(), (0, -codes.shape[1] % 32)).view(codes.shape[0], -1, 32)
    dots = torch.einsum("rgj,ogj->rog", a, q)
    return (dots * (d.double()[None] * s[:, None]) + m.double()[None] * sums[:, None]).sum(-1)


def int8_oracle(x, codes, scale):
    a, _, s, _ = quantized_activations(x)
    q = F.pad(codes.double(), (0, -codes.shape[1] % 32)).view(codes.shape[0], -1, 32)
    return (torch.einsum("rgj,ogj->rog", a, q) * s[:, None]).sum(-1) * scale.double()


def assert_matches(got, expected):
    """Equal up to float32 sums: errors of a few ulps of the largest output (the int8 kernel's +128
    shift cancels in float32)."""
    torch.testing.assert_close(got.double(), expected, rtol=1e-5, atol=1e-6 * float(expected.abs().max()))


def random_q4_1(out_features, in_features, seed=0):
    weight = torch.randn(out_features, in_features, generator=torch.Generator().manual_seed(seed)) * 0.05
    return quantize_q4_1(weight)


@pytest.mark.parametrize(("out_features", "in_features"), [(576, 576), (192, 576), (576, 1536), (7, 96), (5, 32)])
@pytest.mark.parametrize("rows", [1, 3, 8])
def test_q4_1_kernel_computes_its_integer_arithmetic(compiled, out_features, in_features, rows):
    """Row counts up to DENSE_FROM_ROWS take the integer kernel; out_features not a multiple of 4 and
    in_features not a multiple of 64 take its padding."""
    codes, d, m = random_q4_1(out_features, in_features)
    x = torch.randn(rows, in_features, generator=torch.Generator().manual_seed(rows))
    got = int8_dot.pack_q4_1(codes, d, m)(x)
    assert got.dtype == torch.float32 and got.shape == (rows, out_features)
    assert_matches(got, q4_1_oracle(x, codes, d, m))


@pytest.mark.parametrize(("out_features", "in_features"), [(576, 576), (49152, 64), (7, 100), (3, 5)])
def test_int8_kernel_computes_its_integer_arithmetic(compiled, out_features, in_features):
    gen = torch.Generator().manual_seed(out_features)
    codes = torch.randint(-127, 128, (out_features, in_features), generator=gen, dtype=torch.int8)
    scale = torch.rand(out_features, generator=gen) / 100
    x = torch.randn(4, in_features, generator=gen)
    got = int8_dot.pack_int8(codes, scale)(x)
    assert_matches(got, int8_oracle(x, codes, scale))


def test_activations_move_by_at_most_half_a_step_plus_the_float16_rounding(compiled):
    """The kernel's only departure from F.linear on its own weights: each activation x moves to s_h a,
    at most s/2 + 127 |s - s_h| away (s_h: s rounded to float16), and the offsets' sum S by its own
    float16 rounding, so |y - F.linear| <= sum over groups of (|d| sum(codes) + 32 |m|) (s/2 + 127
    |s - s_h|) + |m| |S_h - S|. A group of zeros (scale 0) contributes nothing."""
    codes, d, m = random_q4_1(192, 576, seed=3)
    x = torch.randn(2, 576, generator=torch.Generator().manual_seed(5)) * torch.logspace(-3, 2, 576)
    x[1, :64] = 0
    got = int8_dot.pack_q4_1(codes, d, m)(x).double()
    exact = F.linear(x.double(), dequantize_q4_1(codes, d, m).double())
    a, s, s_h, sums_h = quantized_activations(x)
    step = s / 2 + 127 * (s - s_h).abs()  # [rows, groups]
    weight_mass = d.double().abs() * codes.double().view(192, -1, 32).sum(-1) + 32 * m.double().abs()
    bound = (torch.einsum("rg,og->ro", step, weight_mass)
             + torch.einsum("rg,og->ro", (sums_h - a.sum(-1) * s).abs(), m.double().abs()))
    assert ((got - exact).abs() <= bound + 1e-5).all()
    assert ((got - exact).abs() > 1e-4).any()  # the bound is not vacuous: activations did move


def test_bfloat16_activations_give_bfloat16_outputs_rounded_once(compiled):
    codes, d, m = random_q4_1(64, 128)
    x = torch.randn(2, 128).bfloat16()
    got = int8_dot.pack_q4_1(codes, d, m)(x)
    assert got.dtype == torch.bfloat16
    torch.testing.assert_close(got, q4_1_oracle(x.float(), codes, d, m).bfloat16(), rtol=2 ** -8, atol=1e-5)


def test_activation_codes_round_as_llama_cpp_builds_for_this_cpu(compiled):
    """For x = 0.33502504 in a group whose max is 0.59507948, x * (127 / max) is 71.49999 and x * (1 / s)
    71.5 in float32, codes 71 and 72: the kernel must pick the one llama.cpp's build for this CPU picks, or the two
    engines' layers part by a whole code step on the same input. A one-hot int8 weight reads the code."""
    top, x = 0.5950794816017151, 0.33502504229545593
    layer = int8_dot.pack_int8(torch.tensor([[0, 1] + [0] * 30], dtype=torch.int8), torch.tensor([1.0]))
    s = torch.tensor(top / 127, dtype=torch.float32)
    code = layer(torch.tensor([[top, x] + [0.0] * 30]))[0, 0] / s.half().float()
    assert code.item() == (71.0 if built_with_avx() else 72.0)


def test_batches_above_the_threshold_run_a_float_gemm_of_the_exact_weights(compiled):
    codes, d, m = random_q4_1(192, 576)
    packed = int8_dot.pack_q4_1(codes, d, m)
    assert torch.equal(packed.dequantized(torch.float32), dequantize_q4_1(codes, d, m))
    assert torch.equal(packed.dequantized(torch.bfloat16), dequantize_q4_1(codes, d, m).bfloat16())
    x = torch.randn(int8_dot.DENSE_FROM_ROWS + 1, 576)
    torch.testing.assert_close(packed(x), F.linear(x, dequantize_q4_1(codes, d, m)))
    int8 = int8_dot.pack_int8(torch.tensor([[1, -2, 127]], dtype=torch.int8), torch.tensor([0.5]))
    assert torch.equal(int8.dequantized(torch.float32), torch.tensor([[0.5, -1.0, 63.5]]))


def test_shapes_strides_and_empty_batches(compiled):
    codes, d, m = random_q4_1(96, 128)
    packed = int8_dot.pack_q4_1(codes, d, m)
    x = torch.randn(2, 3, 256)[..., ::2]  # 3-D and strided
    torch.testing.assert_close(packed(x), packed(x.contiguous()))
    assert packed(x).shape == (2, 3, 96)
    assert packed(torch.empty(0, 128)).shape == (0, 96)


def test_bad_activations_are_refused_by_name(compiled):
    packed = int8_dot.pack_q4_1(*random_q4_1(8, 64))
    with pytest.raises(ValueError, match="float32 or bfloat16 CPU activations, got torch.float16"):
        packed(torch.randn(1, 64).half())
    with pytest.raises(ValueError, match="activations have 32 features, the layer takes 64"):
        packed(torch.randn(1, 32))


def test_without_a_compiler_the_formats_keep_torchs_kernels_and_say_why(monkeypatch, fresh_build):
    monkeypatch.setattr(build, "find_c_compiler", lambda: None)
    assert int8_dot.load() is None and int8_dot.load.why_not() == "no C compiler"
    kernel = kernels.describe(dtype=torch.bfloat16, weight_format="q4_1").linear
    assert "torch int4" in kernel and "no C compiler" in kernel
    codes, d, m = random_q4_1(64, 128)
    layer = Q4Linear(codes, d, m)
    assert layer.native is None
    x = torch.randn(2, 128).bfloat16()
    torch.testing.assert_close(layer(x).float(), F.linear(x.float(), dequantize_q4_1(codes, d, m)),
                               atol=0.02, rtol=0.02)
    linear = torch.nn.Linear(128, 64, bias=False)
    assert Int8Linear(linear).native is None
    assert list(fresh_build.iterdir()) == []


@pytest.mark.parametrize("magnitude", [1e-7, 1e-4, 1.0, 3e3])
def test_activation_scales_round_to_float16_like_torch_across_its_range(compiled, magnitude):
    """Tiny groups give float16 subnormal scales (below 2^-14 * 127), large ones plain normals."""
    codes, d, m = random_q4_1(8, 256, seed=1)
    x = torch.randn(3, 256, generator=torch.Generator().manual_seed(2)) * magnitude
    assert_matches(int8_dot.pack_q4_1(codes, d, m)(x), q4_1_oracle(x, codes, d, m))


@pytest.mark.parametrize("target", [("AVX-512", ["-march=x86-64-v4", "-DLANES=16"]),
                                    ("AVX2", ["-march=x86-64-v3", "-DLANES=8"]), ("generic", ["-DLANES=4"])])
def test_the_other_builds_compute_the_same_arithmetic(compiled, monkeypatch, fresh_build, target):
    """AVX-512 without VNNI and AVX2 take the vpmaddubsw path (int8 by sign transfer, no +128 shift),
    other CPUs plain C: the same integers, so the same outputs up to float32 sums."""
    if target[0] != "generic" and torch.backends.cpu.get_cpu_capability() not in ("AVX2", "AVX512"):
        pytest.skip("this CPU cannot run an AVX2 build")
    if target[0] == "AVX-512" and torch.backends.cpu.get_cpu_capability() != "AVX512":
        pytest.skip("this CPU cannot run an AVX-512 build")
    monkeypatch.setattr(build, "cpu_target", lambda: target)
    assert int8_dot.load().name == f"C/{'AVX2' if target[0] == 'AVX-512' else target[0]}"
    codes, d, m = random_q4_1(13, 96)
    x = torch.randn(3, 96)
    assert_matches(int8_dot.pack_q4_1(codes, d, m)(x), q4_1_oracle(x, codes, d, m))
    gen = torch.Generator().manual_seed(1)
    int8_codes = torch.randint(-127, 128, (6, 200), generator=gen, dtype=torch.int8)
    scale, x = torch.rand(6, generator=gen), torch.randn(3, 200, generator=gen)
    assert_matches(int8_dot.pack_int8(int8_codes, scale)(x), int8_oracle(x, int8_codes, scale))
