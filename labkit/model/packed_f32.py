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


class PackedF32Linear(nn.Module):
    """y = x W^T + b in float32 on the CPU, with W packed once into the C kernel's column panels."""

    def __init__(self, linear: nn.Linear):
        super().__init__()
        weight = linear.weight.detach()
        if weight.dtype != torch.float32 or weight.device.type != "cpu":
            raise ValueError(f"PackedF32Linear packs float32 CPU weights, got {weight.dtype} on {weight.device}")
        self._kernel = kernel()
        if self._kernel is None:
            raise RuntimeError(f"the packed fp32 GEMM is unavailable: {gemm_kernel()}")
        self.in_features, self.out_features = linear.in_features, linear.out_features
        width = self._kernel.panel_width
        panels = -(-self.out_features // width)
        padded = F.pad(weight, (0, 0, 0, panels * width - self.out_features))  # zero columns past out_features
        # [panels, in, width]: panel p holds outputs p*width.. one input feature after another
        self.register_buffer("packed", padded.view(panels, width, self.in_features).transpose(1, 2).contiguous())
        self.bias = linear.bias
        self.register_buffer("_padded_bias", None if linear.bias is None else
                             F.pad(linear.bias.detach(), (0, panels * width - self.out_features)), persistent=False)
        self._bind()

    def _bind(self) -> None:
        """Keep the kernel's call and the packed tensors' addresses in plain attributes: a decode step
        calls every linear with a few rows, where nn.Module's attribute lookups cost as much as the C call."""
        bias = self._padded_bias
        self._call = (self._kernel.gemm, self.packed.data_ptr(), None if bias is None else bias.data_ptr())

    def _apply(self, fn, recurse=True):
        module = super()._apply(fn, recurse)  # .to(), .float(), ...: the buffers may have moved
        if self.packed.dtype != torch.float32 or self.packed.device.type != "cpu":
            raise ValueError(f"PackedF32Linear holds float32 CPU weights: it cannot become {self.packed.dtype} "
                             f"on {self.packed.device}")
        self._bind()
        return module

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.dtype != torch.float32 or not x.is_cpu or x.dim() == 0 or x.shape[-1] != self.in_features:
            raise ValueError(f"PackedF32Linear({self.in_features} -> {self.out_features}) takes float32 CPU "
                             f"inputs [..., {self.in_features}], got {x.dtype} {tuple(x.shape)} on {x.device}")
        rows = x.reshape(-1, self.in_features)
        if rows.stride(-1) != 1:
            rows = rows.contiguous()
        count = rows.shape[0]
        y = torch.empty(count, self.out_features)
        if count:
            gemm, packed, bias = self._call
            gemm(rows.data_ptr(), rows.stride(0), packed, bias, y.data_ptr(), count, self.out_features,
                 self.in_features)
        return y if x.dim() == 2 else y.view(*x.shape[:-1], self.out_features)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}"


def serves_this_cpu() -> bool:
    """Whether the engine's fp32 linears take the packed GEMM here: where it builds for AVX-512, the
    target it is tuned for (measured on this course's machines: the fp32 workload 1.3x faster than
    torch's MKL, identical greedy tokens). Its AVX2 and generic builds are correct but untuned, so
    those CPUs keep torch's GEMM. A rule per CPU, not a timing per process: the same machine always
    runs the same kernel, so its outputs do not change from run to run."""
    loaded = kernel()
    return loaded is not None and loaded.name.startswith("C/AVX-512")
