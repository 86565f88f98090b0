"""What the CPU linears whose weight a C GEMM packs once, at load (`PackedF32Linear`, `PackedBf16Linear`),
share: their checks, their bound call, and a forward that flattens the input to rows.

A subclass sets `dtype`, registers its `packed` weight and its `_kernel_bias` buffer (or None), sets
`_kernel`, calls `_bind()`, and multiplies in `_multiply(rows, y)`.
"""

import torch
from torch import nn


class PackedLinear(nn.Module):
    """y = x W^T + b on the CPU in `dtype`, W packed once for a C GEMM."""

    dtype: torch.dtype

    def __init__(self, linear: nn.Linear):
        super().__init__()
        weight = linear.weight.detach()
        if weight.dtype != self.dtype or weight.device.type != "cpu":
            raise ValueError(f"{type(self).__name__} packs {self._dtype_name} CPU weights, got {weight.dtype} on "
                             f"{weight.device}")
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
