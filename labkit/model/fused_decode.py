"""Decode steps of a quantized model on the CPU in one C call (`fused_decode.c`), for small batches.

At batch 1 the eager model spends more time issuing its ~45 small torch operations per layer than
multiplying its 4-bit weights. `FusedDecoder` runs a decode-only step of up to `MAX_ROWS` sequences
through every layer in C instead: the same maths as `layers.py`, with the residual stream in
float32 and `int8_dot.c`'s linears. It plugs into the engine where CUDA graphs do (`fits`, `run`:
`ModelRunner.forward` replays a decode step through it), so prefill, larger batches and every other
path stay the eager model's. `FusedDecoder.unsupported(model, storage)` says why a model cannot use it.
"""

import ctypes
from pathlib import Path

import torch

from labkit import native
from labkit.attention import cpu_decode
from labkit.attention.metadata import AttentionMetadata
from labkit.model import int8_dot
from labkit.model.layers import rope_cos_sin, rope_inv_freq
from labkit.model.weight_formats import Int8Linear, Q4Linear

SOURCE = Path(__file__).with_name("fused_decode.c")
MAX_ROWS = int8_dot.DENSE_FROM_ROWS  # more sequences than this: the eager model's dense GEMMs are faster
_LINEARS = ("q", "k", "v", "o", "gate", "up", "down")


class _Linear(ctypes.Structure):
    _fields_ = [("kind", ctypes.c_int64), ("a", ctypes.c_void_p), ("b", ctypes.c_void_p), ("c", ctypes.c_void_p),
                ("N", ctypes.c_int64), ("K", ctypes.c_int64), ("n", ctypes.c_int64)]


class _Layer(ctypes.Structure):
    _fields_ = [*((name, _Linear) for name in _LINEARS), ("input_norm", ctypes.c_void_p),
                ("post_norm", ctypes.c_void_p), ("k_cache", ctypes.c_void_p), ("v_cache", ctypes.c_void_p)]


class _Shape(ctypes.Structure):
    _fields_ = [(name, ctypes.c_int64) for name in ("hidden", "num_heads", "num_kv_heads", "head_dim",
                                                     "intermediate", "block_size", "max_blocks")] + [
        ("eps", ctypes.c_float), ("kv_bf16", ctypes.c_int32)]


def _declare(library: ctypes.CDLL, target: str) -> ctypes.CDLL:
    pointer, i64 = ctypes.c_void_p, ctypes.c_int64
    library.fused_decode_step.argtypes = [pointer, i64, pointer, i64, pointer, pointer, pointer, pointer, pointer,
                                          pointer]
    library.fused_decode_step.restype = ctypes.c_int
    return library


_load = native.loader(SOURCE, _declare, includes=(int8_dot.SOURCE, cpu_decode.SOURCE))


def _linears(layer) -> tuple:
    """A decoder layer's seven linears, in `_Layer`'s order."""
    attn, mlp = layer.self_attn, layer.mlp
    return attn.q_proj, attn.k_proj, attn.v_proj, attn.o_proj, mlp.gate_proj, mlp.up_proj, mlp.down_proj


def _linear_struct(layer) -> _Linear:
    packed = layer.native
    return _Linear(0 if isinstance(layer, Q4Linear) else 1, *(t.data_ptr() for t in packed.tensors),
                   packed.out_features, packed.padded_in_features, packed.in_features)


class FusedDecoder:
    """A model's decode steps of up to MAX_ROWS sequences, each adding one token, in one C call."""

    @staticmethod
    def unsupported(model, storage) -> str | None:
        """Why this model and KV pool cannot run fused (None: they can)."""
        c = model.config
        if model.device.type != "cpu":
            return f"runs on the CPU, the model is on {model.device.type}"
        if isinstance(_load(), str):
            return _load()
        if c.qk_norm or c.attention_bias or c.head_dim % 16:
            return "the model has q/k norms, attention biases or a head_dim not a multiple of 16"
        if not all(isinstance(linear, Q4Linear | Int8Linear) and linear.native is not None
                   and linear.bias is None for layer in model.layers for linear in _linears(layer)):
            return "its linear layers are not in a quantized weight format with the C int8 dot kernel"
        if storage.quantized or storage.dtype != model.dtype or not cpu_decode.supports(storage):
            return "the KV pool is quantized, not in the model's dtype, or not one the C decode kernel reads"
        return None

    def __init__(self, model, storage):
        reason = self.unsupported(model, storage)
        if reason is not None:
            raise ValueError(f"this model cannot decode fused: {reason}")
        c = model.config
        self.model, self.storage = model, storage
        self._norms = [(layer.input_layernorm.weight.float().contiguous(),
                        layer.post_attention_layernorm.weight.float().contiguous()) for layer in model.layers]
        layers = []
        for i, layer in enumerate(model.layers):
            k_cache, v_cache = storage.layer(i)
            layers.append(_Layer(*(_linear_struct(linear) for linear in _linears(layer)), self._norms[i][0].data_ptr(),
                                 self._norms[i][1].data_ptr(), k_cache.data_ptr(), v_cache.data_ptr()))
        self._layers = (_Layer * len(layers))(*layers)
        self._shape = dict(hidden=c.hidden_size, num_heads=c.num_heads, num_kv_heads=c.num_kv_heads,
                           head_dim=c.head_dim, intermediate=c.intermediate_size, block_size=storage.block_size,
                           eps=c.rms_norm_eps, kv_bf16=int(storage.dtype == torch.bfloat16))
        self._inv_freq = rope_inv_freq(c.head_dim, c.rope_theta, c.rope_scaling)

    def fits(self, num_seqs: int, width: int) -> bool:
        return num_seqs <= MAX_ROWS

    @torch.inference_mode()
    def run(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        """Logits [B, vocab] of a decode-only step of B <= MAX_ROWS sequences (every row is sampled)."""
        if input_ids.shape[0] > MAX_ROWS or meta.max_seqlen_q != 1 or input_ids.shape != positions.shape:
            raise ValueError(f"a fused step takes up to {MAX_ROWS} sequences adding one token each, got "
                             f"{tuple(input_ids.shape)} tokens with max_seqlen_q={meta.max_seqlen_q}")
        plan = cpu_decode.DecodePlan(meta.block_tables, meta.context_lens, self.storage.block_size)  # checks them
        block_tables, context_lens = plan.block_tables, plan.context_lens  # int32, contiguous
        slots = meta.slot_mapping.to(torch.int64).contiguous()
        if int(slots.min()) < 0 or int(slots.max()) >= self.storage.num_blocks * self.storage.block_size:
            raise ValueError(f"slot_mapping {slots.tolist()} has slots outside the pool's "
                             f"{self.storage.num_blocks * self.storage.block_size}")
        cos, sin = (t.contiguous() for t in rope_cos_sin(positions, self._inv_freq, torch.float32))
        x = self.model.embed_tokens(input_ids).float().contiguous()
        shape = _Shape(**self._shape, max_blocks=block_tables.shape[1])
        if _load().fused_decode_step(self._layers, len(self._layers), ctypes.byref(shape), x.shape[0], x.data_ptr(),
                                     cos.data_ptr(), sin.data_ptr(), slots.data_ptr(), block_tables.data_ptr(),
                                     context_lens.data_ptr()):
            raise MemoryError("the fused decode step could not allocate its activations")
        return self.model.compute_logits(self.model.norm(x))
