"""ctypes binding of `fused_decode.c`: a decoder step through every layer in one C call. Its structs
mirror the C file's; `labkit.model.fused_decode.FusedDecoder` fills them from a model and calls it.
"""

import ctypes
from pathlib import Path

from labkit.kernels import build

SOURCE = Path(__file__).with_name("fused_decode.c")
LINEARS = ("q", "k", "v", "o", "gate", "up", "down")  # a layer's linears, in `Layer`'s order


class Linear(ctypes.Structure):
    _fields_ = [("kind", ctypes.c_int64), ("a", ctypes.c_void_p), ("b", ctypes.c_void_p), ("c", ctypes.c_void_p),
                ("N", ctypes.c_int64), ("K", ctypes.c_int64), ("n", ctypes.c_int64)]


class Layer(ctypes.Structure):
    _fields_ = [*((name, Linear) for name in LINEARS), ("input_norm", ctypes.c_void_p),
                ("post_norm", ctypes.c_void_p), ("k_cache", ctypes.c_void_p), ("v_cache", ctypes.c_void_p)]


class Shape(ctypes.Structure):
    _fields_ = [(name, ctypes.c_int64) for name in ("hidden", "num_heads", "num_kv_heads", "head_dim",
                                                     "intermediate", "block_size", "max_blocks")] + [
        ("eps", ctypes.c_float), ("kv_bf16", ctypes.c_int32), ("gemm_f32", ctypes.c_void_p),
        ("gemm_bf16", ctypes.c_void_p)]


class Kernel:
    """The library's two entry points, declared for ctypes, and the name of its target."""

    def __init__(self, library: ctypes.CDLL, target: str):
        self.name = f"C/{target}"
        pointer, i64 = ctypes.c_void_p, ctypes.c_int64
        # layers, num_layers, shape, M, x, cos, sin, slots, block_tables, context_lens, work
        self.step = library.fused_decode_step
        self.step.argtypes = [pointer, i64, pointer, i64, pointer, pointer, pointer, pointer, pointer, pointer, pointer]
        self.step.restype = ctypes.c_int
        # shape, M -> bytes
        self.workspace = library.fused_decode_workspace
        self.workspace.argtypes = [pointer, i64]
        self.workspace.restype = i64


load = build.Loader(SOURCE, Kernel)
