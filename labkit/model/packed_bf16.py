"""bf16 linear layers through a small C GEMM (`gemm_bf16.c`, AMX or AVX512-BF16) whose weight is packed
once, at load.

oneDNN's bf16 GEMM reaches the hardware's rate on a prefill's thousands of rows, but a decode step
multiplies a few dozen rows by each weight, where a oneDNN call costs several times its arithmetic, and
C cannot call it: a bf16 model could neither decode at the weights' streaming speed nor in one C call
(`fused_decode.c`). `gemm_bf16.c` keeps the weight in AMX's operand layout, so a call streams it
through the multiply units and nothing else.

Built at first use (see `labkit.native`) for the CPU's bf16 extension: AMX's tiles on CPUs that list
`amx_bf16` (Intel Sapphire Rapids and later), AVX512-BF16's pair dot products on those that list
`avx512_bf16` (AMD Zen 4 and later). Elsewhere, or when the build fails or Linux refuses AMX's tile
state, the model keeps oneDNN's prepacked linear (or torch's), and `gemm_kernel()` says why.
"""

import ctypes
import functools
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from labkit import native
from labkit.model.packed_linear import PackedLinear

SOURCE = Path(__file__).with_name("gemm_bf16.c")
STEP = 32  # inputs per tile product: in_features is padded to a multiple of it


class _Kernel:
    """The loaded library's GEMM, the width of its weight panels and the extension it runs on."""

    def __init__(self, library: ctypes.CDLL, extension: str):
        self.name = f"C/{extension} packed bf16 GEMM"
        self.panel_width = library.gemm_bf16_panel_width()
        self.gemm = library.gemm_bf16
        pointer, i64, i32 = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int
        self.gemm.argtypes = [pointer, i32, i64, pointer, pointer, pointer, i32, i64, i64, i64, i64]
        self.gemm.restype = ctypes.c_int


def _bind_amx(library: ctypes.CDLL, target: str) -> _Kernel | str:
    if library.gemm_bf16_init() != 0:
        return "Linux refused this process AMX's tile state"
    return _Kernel(library, "AMX-BF16")


_build_amx = native.loader(SOURCE, _bind_amx, extra_flags=("-mamx-tile", "-mamx-bf16"))
_build_avx512 = native.loader(SOURCE, lambda library, target: _Kernel(library, "AVX512-BF16"),
                              extra_flags=("-mavx512bf16",))


@functools.cache
def _load() -> _Kernel | str:
    """The kernel, or why there is none: AMX where the CPU has it, else AVX512-BF16 (on a CPU with
    AVX-512: the build targets it)."""
    flags = native.x86_flags()
    if {"amx_tile", "amx_bf16"} <= flags:
        return _build_amx()
    if "avx512_bf16" in flags and native.cpu_target()[0].startswith("AVX-512"):
        return _build_avx512()
    return "the CPU has neither AMX-BF16 nor AVX512-BF16"


def kernel() -> _Kernel | None:
    loaded = _load()
    return loaded if isinstance(loaded, _Kernel) else None


def gemm_kernel() -> str:
    """What the engine's bf16 linears could run here: the kernel's name, or why not."""
    loaded = _load()
    return loaded.name if isinstance(loaded, _Kernel) else f"no packed bf16 GEMM ({loaded})"


class PackedBf16Linear(PackedLinear):
    """y = x W^T + b in bf16 on the CPU (float32 sums), with W packed once into AMX's tile layout (which
    AVX512-BF16's pair dot products read as well)."""

    dtype = torch.bfloat16

    def __init__(self, linear: nn.Linear):
        super().__init__(linear)
        self._kernel = kernel()
        if self._kernel is None:
            raise RuntimeError(f"the packed bf16 GEMM is unavailable: {gemm_kernel()}")
        width = self._kernel.panel_width
        panels, self.padded_in_features = -(-self.out_features // width), -(-self.in_features // STEP) * STEP
        padded = F.pad(linear.weight.detach(),
                       (0, self.padded_in_features - self.in_features, 0, panels * width - self.out_features))
        # [panels, steps, 2 tiles, 16 input pairs, 16 columns, 2]: output n = p*32 + t*16 + c, input
        # k = s*32 + 2*r + e, in the order gemm_bf16.c's tile loads read them
        tiles = padded.view(panels, 2, 16, self.padded_in_features // STEP, 16, 2).permute(0, 3, 1, 4, 2, 5)
        self.register_buffer("packed", tiles.contiguous())
        self.register_buffer("_kernel_bias", None if linear.bias is None else linear.bias.detach().float(),
                             persistent=False)
        self._bind()

    def _multiply(self, rows: torch.Tensor, y: torch.Tensor) -> None:
        gemm, packed, bias = self._call
        if gemm(rows.data_ptr(), 0, rows.stride(0), packed, bias, y.data_ptr(), 0, rows.shape[0], self.out_features,
                self.padded_in_features, self.in_features):
            raise MemoryError("the packed bf16 GEMM could not allocate its copy of the input rows")
