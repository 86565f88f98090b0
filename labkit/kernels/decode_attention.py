"""ctypes binding of `paged_decode.c`: paged decode attention on the CPU, in float32 or bfloat16 pools.

`labkit.attention.cpu_decode.DecodePlan` checks a step's tensors and calls it.
"""

import ctypes
from pathlib import Path

import torch

from labkit.kernels import build

SOURCE = Path(__file__).with_name("paged_decode.c")
ENTRY_POINTS = {torch.float32: "paged_decode_attention_f32", torch.bfloat16: "paged_decode_attention_bf16"}
MAX_BLOCK_SIZE = 1024  # the kernel keeps one block's scores per query head on its stack


class Kernel:
    """The library's entry point per dtype, and the name of its target."""

    def __init__(self, library: ctypes.CDLL, target: str):
        self.name = f"C/{target}"
        self.functions = {}
        for dtype, symbol in ENTRY_POINTS.items():
            # q, k_cache, v_cache, block_tables, context_lens, out; num_seqs, num_heads, num_kv_heads,
            # head_dim, block_size, max_blocks; scale
            fn = getattr(library, symbol)
            fn.argtypes = [ctypes.c_void_p] * 6 + [ctypes.c_int] * 6 + [ctypes.c_float]
            fn.restype = None
            self.functions[dtype] = fn


load = build.Loader(SOURCE, Kernel)
