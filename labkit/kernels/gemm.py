"""ctypes bindings of the packed GEMMs: `gemm_f32.c` (any CPU; tuned for AVX-512) and `gemm_bf16.c`
(AMX or AVX512-BF16), and the rules that say where each is the engine's fastest linear.

`labkit.model.packed_linear` packs a weight into their layouts and calls them.
"""

import ctypes
from pathlib import Path

import torch

from labkit.kernels import build

F32_SOURCE = Path(__file__).with_name("gemm_f32.c")
BF16_SOURCE = Path(__file__).with_name("gemm_bf16.c")
BF16_STEP = 32  # inputs per bf16 tile product: in_features is padded to a multiple of it


class Kernel:
    """A GEMM entry point, the width of its weight panels and its name."""

    def __init__(self, name: str, gemm, panel_width: int, argtypes: list, restype):
        self.name, self.gemm, self.panel_width = name, gemm, panel_width
        self.gemm.argtypes, self.gemm.restype = argtypes, restype


def _bind_f32(library: ctypes.CDLL, target: str) -> Kernel:
    # x, ldx, packed, bias, y, m, n, k
    pointer = ctypes.c_void_p
    return Kernel(f"C/{target} packed fp32 GEMM", library.gemm_f32, library.gemm_f32_panel_width(),
                  [pointer, ctypes.c_int64, pointer, pointer, pointer, ctypes.c_int, ctypes.c_int, ctypes.c_int], None)


def _bind_bf16(library: ctypes.CDLL, target: str) -> Kernel | str:
    if library.gemm_bf16_init() != 0:
        return "Linux refused this process AMX's tile state"
    library.gemm_bf16_extension.restype = ctypes.c_char_p
    # x, x is float32, ldx, packed, bias, y, y is float32, m, n, K, used
    pointer, i64, i32 = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int
    return Kernel(f"C/{library.gemm_bf16_extension().decode()} packed bf16 GEMM", library.gemm_bf16,
                  library.gemm_bf16_panel_width(), [pointer, i32, i64, pointer, pointer, pointer, i32, i64, i64, i64,
                                                    i64], ctypes.c_int)


def _bf16_flags() -> tuple[str, ...] | str:
    """The build for the CPU's bf16 extension: AMX where it has it, else AVX512-BF16 (on a CPU with
    AVX-512: the build targets it); or why there is none."""
    flags = build.x86_flags()
    if {"amx_tile", "amx_bf16"} <= flags:
        return "-mamx-tile", "-mamx-bf16"
    if "avx512_bf16" in flags and build.cpu_target()[0].startswith("AVX-512"):
        return ("-mavx512bf16",)
    return "the CPU has neither AMX-BF16 nor AVX512-BF16"


load_f32 = build.Loader(F32_SOURCE, _bind_f32)
load_bf16 = build.Loader(BF16_SOURCE, _bind_bf16, extra_flags=_bf16_flags)


def f32_serves_this_cpu() -> bool:
    """Whether the engine's fp32 linears take the packed GEMM here: where it builds for AVX-512, the
    target it is tuned for (measured on this course's machines: the fp32 workload 1.3x faster than
    torch's MKL, identical greedy tokens). Its AVX2 and generic builds are correct but untuned, so
    those CPUs keep torch's GEMM. A rule per CPU, not a timing per process: the same machine always
    runs the same kernel, so its outputs do not change from run to run."""
    kernel = load_f32()
    return kernel is not None and kernel.name.startswith("C/AVX-512")


def prepacks_bf16() -> bool:
    """Whether oneDNN's prepacked bf16 GEMM is the fast torch path on this CPU (native bf16 dot products)."""
    return torch.backends.mkldnn.is_available() and build.cpu_features() in ("AMX-BF16", "AVX512-BF16")
