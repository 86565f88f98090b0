"""Quantized linear layers through integer dot products on the CPU: `int8_dot.c`, built at first use.

torch's weight-only CPU kernels (`_weight_int4pack_mm_for_cpu`, `_weight_int8pack_mm`) widen every
code to a float before multiplying, which leaves batch-1 decode far from the memory bound the 4-bit
format was chosen for (measured 5-8 GB/s against the machine's 11-21). This kernel does what
llama.cpp does instead: it quantizes each row of activations to int8 in groups of 32, rounding the
scales to float16 exactly as llama.cpp's Q8_1 blocks do (measured: without that rounding, greedy
decoding left llama.cpp's tokens 13-24 tokens into a prompt where it now follows all 48), and
multiplies codes by codes (AVX-512 VNNI, AVX2, or plain C), applying the float scales once per group.

The layouts it reads are prepared once, when a model is loaded (`pack_q4_1`, `pack_int8`); see the C
file's header for them and for the arithmetic. Without a C compiler the weight formats
(`labkit.model.weight_formats`) keep torch's kernels, and `labkit.kernels.describe()` says why.
"""

import ctypes
import functools
from pathlib import Path

import torch

from labkit.kernels import build

SOURCE = Path(__file__).with_name("int8_dot.c")
GROUP = 32  # inputs per activation scale, and per Q4_1 block
_STEP = 2 * GROUP  # the kernels consume 64 inputs at a time: in_features is padded to a multiple
DENSE_FROM_ROWS = 8  # above this many rows (prefill), a call dequantizes its weight for a float GEMM: faster (measured)
ROWS = 4  # and 4 output rows at a time (ROWS in the C file): out_features is padded to a multiple


class Kernel:
    """The library's entry points, declared for ctypes, and the name of the instructions it multiplies with."""

    def __init__(self, library: ctypes.CDLL, target: str):
        library.int8_dot_kernel_name.restype = ctypes.c_char_p
        self.name = f"C/{library.int8_dot_kernel_name().decode()}"
        pointer, i64 = ctypes.c_void_p, ctypes.c_int64
        self.functions = {}
        for kind in ("q4_1", "int8"):
            # weights, N, K, in_features, then x, x is bf16, M, x's row stride, y
            linear = getattr(library, f"{kind}_linear")
            linear.argtypes = [pointer, pointer, pointer, i64, i64, i64, pointer, ctypes.c_int, i64, i64, pointer]
            linear.restype = ctypes.c_int
            # weights, N, K, in_features, then w, w is bf16
            dequantize = getattr(library, f"{kind}_dequantize")
            dequantize.argtypes = [pointer, pointer, pointer, i64, i64, i64, pointer, ctypes.c_int]
            dequantize.restype = ctypes.c_int
            self.functions[f"{kind}_linear"], self.functions[f"{kind}_dequantize"] = linear, dequantize


load = build.Loader(SOURCE, Kernel)


def _padded_inputs(in_features: int) -> int:
    return -(-in_features // _STEP) * _STEP


def _padded(t: torch.Tensor, rows: int, columns: int) -> torch.Tensor:
    """t zero-padded to rows x columns, contiguous (the kernels read whole blocks of rows and inputs)."""
    return torch.nn.functional.pad(t, (0, columns - t.shape[1], 0, rows - t.shape[0])).contiguous()


class PackedWeights:
    """One layer's weights in a kernel's layout, and the call that multiplies activations by them.

    The weight pointers are bound once: a decode step calls ~200 linears, and each microsecond of
    Python per call is ~0.2 ms a token."""

    def __init__(self, kind: str, in_features: int, out_features: int, *tensors: torch.Tensor):
        self.in_features, self.out_features = in_features, out_features
        self.tensors = tensors  # kept alive: the kernel reads them through raw pointers
        self.padded_in_features = _padded_inputs(in_features)  # K in the C file
        kernel = load()
        self._call, self._dequantize = (
            functools.partial(kernel.functions[name], *(t.data_ptr() for t in tensors), out_features,
                              self.padded_in_features, in_features)
            for name in (f"{kind}_linear", f"{kind}_dequantize"))

    def dequantized(self, dtype: torch.dtype) -> torch.Tensor:
        """The float weight [out, in] these codes stand for."""
        weight = torch.empty(self.out_features, self.in_features, dtype=dtype)
        if self._dequantize(weight.data_ptr(), dtype == torch.bfloat16):
            raise MemoryError("the int8 dot kernel could not allocate one row of weights")
        return weight

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        """x [..., in] float32 or bfloat16 on the CPU -> [..., out] in x's dtype."""
        if x.dtype not in (torch.float32, torch.bfloat16) or x.device.type != "cpu":
            raise ValueError(f"the int8 dot kernel takes float32 or bfloat16 CPU activations, got {x.dtype} on "
                             f"{x.device}")
        if x.shape[-1] != self.in_features:
            raise ValueError(f"activations have {x.shape[-1]} features, the layer takes {self.in_features}")
        rows = x.reshape(-1, self.in_features)
        if rows.shape[0] > DENSE_FROM_ROWS:
            return torch.nn.functional.linear(x, self.dequantized(x.dtype))
        if rows.stride(-1) != 1:
            rows = rows.contiguous()
        y = torch.empty(*x.shape[:-1], self.out_features, dtype=x.dtype)
        if rows.shape[0] and self._call(rows.data_ptr(), x.dtype == torch.bfloat16, rows.shape[0], rows.stride(0),
                                        y.data_ptr()):
            raise MemoryError(f"the int8 dot kernel could not allocate {rows.shape[0]} quantized activation rows")
        return y


def pack_q4_1(codes: torch.Tensor, d: torch.Tensor, m: torch.Tensor) -> PackedWeights:
    """Q4_1 blocks (codes [N, in] 0..15, d and m [N, in/32]) in the kernel's layout: nibbles [N, K/2]
    where, in each run of 64 inputs, byte j holds input j (low nibble) and input j + 32 (high)."""
    (out_features, in_features), K = codes.shape, _padded_inputs(codes.shape[1])
    N = -(-out_features // ROWS) * ROWS
    runs = _padded(codes.to(torch.uint8), N, K).view(N, K // _STEP, 2, GROUP)
    nibbles = (runs[:, :, 0] | (runs[:, :, 1] << 4)).reshape(N, K // 2).contiguous()
    return PackedWeights("q4_1", in_features, out_features, nibbles,
                         _padded(d.float(), N, K // GROUP), _padded(m.float(), N, K // GROUP))


def pack_int8(codes: torch.Tensor, scale: torch.Tensor) -> PackedWeights:
    """int8 codes [N, in] with one scale per row in the kernel's layout, with each group's code sum."""
    (out_features, in_features), K = codes.shape, _padded_inputs(codes.shape[1])
    N = -(-out_features // ROWS) * ROWS
    codes = _padded(codes.to(torch.int8), N, K)
    wsum = codes.view(N, K // GROUP, GROUP).sum(-1, dtype=torch.int32).contiguous()
    return PackedWeights("int8", in_features, out_features, codes, wsum,
                         _padded(scale.float()[:, None], N, 1))
