"""CPU linear layers whose weight a small C GEMM (labkit/kernels/gemm_*.c) packs once, at load.

torch's CPU GEMMs lay the weight out again on every call (MKL's fp32), or spend several times their
arithmetic around a call (oneDNN's bf16), and block for large matrices; the engine's decode steps
multiply a few dozen rows by each weight, where that costs about half of the core (measured, fp32:
~30-95 GFLOP/s of a ~170 GFLOP/s core at 8-64 rows), and C cannot call oneDNN, so a bf16 model could
not decode in one C call (`labkit.model.fused_decode`). The packed GEMMs keep the weight in the order
their micro-kernels read it, so a call streams each panel once and spends its time multiplying:

- `PackedF32Linear`: `gemm_f32.c`'s column panels (any CPU; the engine takes it where it is tuned,
  AVX-512, `labkit.kernels.gemm.f32_serves_this_cpu`);
- `PackedBf16Linear`: `gemm_bf16.c`'s AMX tile layout, which AVX512-BF16's pair dot products read as
  well (CPUs with AMX-BF16 or AVX512-BF16; elsewhere the model keeps oneDNN's prepacked linear).

Where the kernel cannot be built, the model keeps torch's linear and `labkit.kernels.describe()` says why.
"""

import torch
import torch.nn.functional as F
from torch import nn

from labkit.kernels import build, gemm


class PackedLinear(nn.Module):
    """y = x W^T + b on the CPU in `dtype`, W packed once for a C GEMM: the checks, the bound call and a
    forward that flattens the input to rows. A subclass sets `dtype` and `load` (its kernel's loader),
    registers its `packed` weight and its `_kernel_bias` buffer (or None), calls `_bind()`, and
    multiplies in `_multiply`."""

    dtype: torch.dtype
    load: build.Loader

    def __init__(self, linear: nn.Linear):
        super().__init__()
        weight = linear.weight.detach()
        if weight.dtype != self.dtype or weight.device.type != "cpu":
            raise ValueError(f"{type(self).__name__} packs {self._dtype_name} CPU weights, got {weight.dtype} on "
                             f"{weight.device}")
        self._kernel = self.load()
        if self._kernel is None:
            raise RuntimeError(f"the packed {self._dtype_name} GEMM is unavailable: {self.load.why_not()}")
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.bias = linear.bias

    @property
    def _dtype_name(self) -> str:
        return str(self.dtype).removeprefix("torch.")

    def _bind(self) -> None:
        """The call and the buffers' addresses in plain attributes: a decode step calls every linear with
        a few rows, where nn.Module's attribute lookups cost as much as the C call."""
        bias = self._kernel_bias
        self._call = (self._kernel.gemm, self.packed.data_ptr(), None if bias is None else bias.data_ptr())

    def _apply(self, fn, recurse=True):
        module = super()._apply(fn, recurse)  # .to(), .float(), ...: the buffers may have moved
        if self.packed.dtype != self.dtype or self.packed.device.type != "cpu":
            raise ValueError(f"{type(self).__name__} holds {self._dtype_name} CPU weights: it cannot become "
                             f"{self.packed.dtype} on {self.packed.device}")
        self._bind()
        return module

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.dtype != self.dtype or not x.is_cpu or x.dim() == 0 or x.shape[-1] != self.in_features:
            raise ValueError(f"{type(self).__name__}({self.in_features} -> {self.out_features}) takes "
                             f"{self._dtype_name} CPU inputs [..., {self.in_features}], got {x.dtype} "
                             f"{tuple(x.shape)} on {x.device}")
        rows = x.reshape(-1, self.in_features)
        if rows.stride(-1) != 1:
            rows = rows.contiguous()
        y = torch.empty(rows.shape[0], self.out_features, dtype=self.dtype)
        if rows.shape[0]:
            self._multiply(rows, y)
        return y if x.dim() == 2 else y.view(*x.shape[:-1], self.out_features)

    def _multiply(self, rows: torch.Tensor, y: torch.Tensor) -> None:
        """y [m, out_features] = rows [m, in_features] (unit column stride, any row stride) times W, plus b."""
        raise NotImplementedError

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}"


class PackedF32Linear(PackedLinear):
    """y = x W^T + b in float32 on the CPU, with W packed once into the C kernel's column panels."""

    dtype, load = torch.float32, gemm.load_f32

    def __init__(self, linear: nn.Linear):
        super().__init__(linear)
        width = self._kernel.panel_width
        panels = -(-self.out_features // width)
        padded = F.pad(linear.weight.detach(), (0, 0, 0, panels * width - self.out_features))  # zero columns past out
        # [panels, in, width]: panel p holds outputs p*width.. one input feature after another
        self.register_buffer("packed", padded.view(panels, width, self.in_features).transpose(1, 2).contiguous())
        self.register_buffer("_kernel_bias", None if linear.bias is None else
                             F.pad(linear.bias.detach(), (0, panels * width - self.out_features)), persistent=False)
        self._bind()

    def _multiply(self, rows: torch.Tensor, y: torch.Tensor) -> None:
        gemm_f32, packed, bias = self._call
        gemm_f32(rows.data_ptr(), rows.stride(0), packed, bias, y.data_ptr(), rows.shape[0], self.out_features,
                 self.in_features)


class PackedBf16Linear(PackedLinear):
    """y = x W^T + b in bf16 on the CPU (float32 sums), with W packed once into AMX's tile layout (which
    AVX512-BF16's pair dot products read as well)."""

    dtype, load = torch.bfloat16, gemm.load_bf16

    def __init__(self, linear: nn.Linear):
        super().__init__(linear)
        width, step = self._kernel.panel_width, gemm.BF16_STEP
        panels, self.padded_in_features = -(-self.out_features // width), -(-self.in_features // step) * step
        padded = F.pad(linear.weight.detach(),
                       (0, self.padded_in_features - self.in_features, 0, panels * width - self.out_features))
        # [panels, steps, 2 tiles, 16 input pairs, 16 columns, 2]: output n = p*32 + t*16 + c, input
        # k = s*32 + 2*r + e, in the order gemm_bf16.c's tile loads read them
        tiles = padded.view(panels, 2, 16, self.padded_in_features // step, 16, 2).permute(0, 3, 1, 4, 2, 5)
        self.register_buffer("packed", tiles.contiguous())
        self.register_buffer("_kernel_bias", None if linear.bias is None else linear.bias.detach().float(),
                             persistent=False)
        self._bind()

    def _multiply(self, rows: torch.Tensor, y: torch.Tensor) -> None:
        gemm_bf16, packed, bias = self._call
        if gemm_bf16(rows.data_ptr(), 0, rows.stride(0), packed, bias, y.data_ptr(), 0, rows.shape[0],
                     self.out_features, self.padded_in_features, self.in_features):
            raise MemoryError("the packed bf16 GEMM could not allocate its copy of the input rows")
