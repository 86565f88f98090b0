"""The engine's native code: small C kernels for the CPU, built at first use, and their ctypes bindings.

- `paged_decode.c` (`decode_attention`): decode attention reading K/V straight from the block pool;
- `gemm_f32.c`, `gemm_bf16.c` (`gemm`): GEMMs whose weight is packed once, at load, fp32 and bf16;
- `int8_dot.c` (`int8_dot`): the quantized formats' linears, integer dot products as llama.cpp's;
- `fused_decode.c` (`fused_decode`): a decoder step through every layer in one C call, with the above.

`simd.h` holds what they share (the CPU's float vector, bf16 conversions), `gemm_tiles.h` the tile
driver of both GEMMs, `build` the compiler and the cache. The torch side, which checks tensors and
falls back to torch where a kernel cannot be built, is `labkit.attention.cpu_decode`,
`labkit.model.packed_linear`, `labkit.model.weight_formats` and `labkit.model.fused_decode`.
`describe()` names the kernels that run.
"""

from dataclasses import dataclass

import torch

from labkit.kernels import build, decode_attention, fused_decode, gemm, int8_dot


@dataclass(frozen=True)
class Kernels:
    """The kernels an engine runs, in words for benchmark output; each says why where it falls back."""

    cpu: str  # the CPU extension that decides them, e.g. "AMX-BF16"
    attention: str  # decode attention over the paged KV pool, e.g. "C/AVX-512 VNNI" or "torch gather (no C compiler)"
    linear: str  # the model's linear layers, e.g. "C/AMX-BF16 packed bf16 GEMM (AMX-BF16)"
    fused_step: str  # the CPU's step in one C call, e.g. "C/AVX-512 fused step (every step)", or "none (why)"


def describe(device: torch.device | str = "cpu", dtype: torch.dtype = torch.float32,
             weight_format: str = "dequantized") -> Kernels:
    """What `LLM(..., device=device, dtype=dtype, weight_format=weight_format)` runs here (building the
    kernels at the first call). The fused step serves models `FusedDecoder.unsupported` accepts."""
    device = torch.device(device)
    return Kernels(build.cpu_features(), _attention(device), _linear(device, dtype, weight_format),
                   _fused_step(device, dtype, weight_format))


def _attention(device: torch.device) -> str:
    if device.type != "cpu":
        return f"torch gather ({device.type})"
    kernel = decode_attention.load()
    return kernel.name if kernel is not None else f"torch gather ({decode_attention.load.why_not()})"


def _linear(device: torch.device, dtype: torch.dtype, weight_format: str) -> str:
    dtype_name = str(dtype).removeprefix("torch.")
    if device.type == "cuda":
        return f"cuBLAS {dtype_name}"
    features = build.cpu_features()
    if weight_format in ("int8", "q4_1"):
        kernel = int8_dot.load()
        if kernel is not None:
            return (f"{kernel.name} {'Q4_1' if weight_format == 'q4_1' else 'int8'} x int8 activations per 32, "
                    f"float GEMM of the dequantized weight above {int8_dot.DENSE_FROM_ROWS} rows")
        why = int8_dot.load.why_not()
        if weight_format == "int8":
            return f"torch int8 weight-only, bf16 activations ({features}; {why})"
        return f"torch int4 weight-only, Q4_1 groups of 32, bf16 activations ({features}; {why})"
    if dtype == torch.bfloat16 and gemm.load_bf16() is not None:
        return f"{gemm.load_bf16().name} ({features})"
    if dtype == torch.bfloat16 and gemm.prepacks_bf16():
        return f"oneDNN prepacked bf16 ({features})"
    if dtype == torch.float32 and gemm.f32_serves_this_cpu():
        return f"{gemm.load_f32().name} ({features})"
    if dtype == torch.float32:
        why = gemm.load_f32.why_not() or f"{gemm.load_f32().name} is untuned here"
        return f"torch default GEMM float32 ({why}) ({features})"
    return f"torch default GEMM {dtype_name} ({features})"


def _fused_step(device: torch.device, dtype: torch.dtype, weight_format: str) -> str:
    if device.type != "cpu":
        return f"none ({device.type})"
    kernel = fused_decode.load()
    if kernel is None:
        return f"none ({fused_decode.load.why_not()})"
    if weight_format in ("int8", "q4_1"):
        return f"{kernel.name} fused step (decode steps of up to {int8_dot.DENSE_FROM_ROWS} sequences)"
    if dtype == torch.float32 and not gemm.f32_serves_this_cpu():
        return "none (the fp32 linears are torch's here)"
    if dtype == torch.bfloat16 and gemm.load_bf16() is None:
        return f"none (no packed bf16 GEMM: {gemm.load_bf16.why_not()})"
    if dtype not in (torch.float32, torch.bfloat16):
        return f"none ({str(dtype).removeprefix('torch.')} linears are torch's)"
    return f"{kernel.name} fused step (every step)"
