"""fp32 linear layers through a small C GEMM whose weight is packed once, at load.

torch's CPU GEMM (MKL) lays the weight out again on every call and blocks for large matrices; the
engine's decode steps multiply a few dozen rows by each weight, where that costs about half of the
core (measured: ~30-95 GFLOP/s of a ~170 GFLOP/s core at 8-64 rows). `gemm_f32.c` keeps the weight
in column panels in the order its register-blocked micro-kernel reads them, so a call streams each
panel once and spends its time in fused multiply-adds.

The C file is compiled at first use for this CPU (see `labkit.native`). Without a compiler, or when
compiling fails, the model keeps torch's `nn.Linear`; `gemm_kernel()` says which and why.
"""

import ctypes
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from labkit import native
from labkit.model.packed_linear import PackedLinear

SOURCE = Path(__file__).with_name("gemm_f32.c")


class _Kernel:
    """The loaded library's GEMM, the width of its weight panels and the name of its target."""

    def __init__(self, library: ctypes.CDLL, target: str):
        self.name = f"C/{target} packed fp32 GEMM"
        self.panel_width = library.gemm_f32_panel_width()
        self.gemm = library.gemm_f32
        self.gemm.argtypes = [ctypes.c_void_p, ctypes.c_int64, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p,
                              ctypes.c_int, ctypes.c_int, ctypes.c_int]
        self.gemm.restype = None


_load = native.loader(SOURCE, _Kernel)  # the kernel, or why there is none (shown by `gemm_kernel`)


def kernel() -> _Kernel | None:
    """The compiled kernel (compiled at the first call), or None when linears must stay torch's."""
    loaded = _load()
    return loaded if isinstance(loaded, _Kernel) else None


def gemm_kernel() -> str:
    """What the engine's fp32 linears run: the packed GEMM's name, e.g. "C/AVX-512 packed fp32 GEMM",
    or torch's default GEMM and why."""
    loaded = _load()
    if not isinstance(loaded, _Kernel):
        return f"torch default GEMM float32 ({loaded})"
    return loaded.name if serves_this_cpu() else f"torch default GEMM float32 ({loaded.name} is untuned here)"


class PackedF32Linear(PackedLinear):
    """y = x W^T + b in float32 on the CPU, with W packed once into the C kernel's column panels."""

    dtype = torch.float32

    def __init__(self, linear: nn.Linear):
        super().__init__(linear)
        self._kernel = kernel()
        if self._kernel is None:
            raise RuntimeError(f"the packed fp32 GEMM is unavailable: {gemm_kernel()}")
        width = self._kernel.panel_width
        panels = -(-self.out_features // width)
        padded = F.pad(linear.weight.detach(), (0, 0, 0, panels * width - self.out_features))  # zero columns past out
        # [panels, in, width]: panel p holds outputs p*width.. one input feature after another
        self.register_buffer("packed", padded.view(panels, width, self.in_features).transpose(1, 2).contiguous())
        self.register_buffer("_kernel_bias", None if linear.bias is None else
                             F.pad(linear.bias.detach(), (0, panels * width - self.out_features)), persistent=False)
        self._bind()

    def _multiply(self, rows: torch.Tensor, y: torch.Tensor) -> None:
        gemm, packed, bias = self._call
        gemm(rows.data_ptr(), rows.stride(0), packed, bias, y.data_ptr(), rows.shape[0], self.out_features,
             self.in_features)


def serves_this_cpu() -> bool:
    """Whether the engine's fp32 linears take the packed GEMM here: where it builds for AVX-512, the
    target it is tuned for (measured on this course's machines: the fp32 workload 1.3x faster than
    torch's MKL, identical greedy tokens). Its AVX2 and generic builds are correct but untuned, so
    those CPUs keep torch's GEMM. A rule per CPU, not a timing per process: the same machine always
    runs the same kernel, so its outputs do not change from run to run."""
    loaded = kernel()
    return loaded is not None and loaded.name.startswith("C/AVX-512")
