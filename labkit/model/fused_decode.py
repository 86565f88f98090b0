"""Steps on the CPU in one C call (`labkit/kernels/fused_decode.c`): a quantized model's small decode batches, and a
dense float32 or (on AMX or AVX512-BF16 CPUs) bf16 model's steps of any size, prompts included.

At batch 1 the eager model spends more time issuing its ~45 small torch operations per layer than
multiplying its 4-bit weights, and a float32 model's batched decode steps lose a good part of their
time the same way (the profile of `make bench`'s fp32 workload: ~1,350 torch calls a step). `FusedDecoder`
runs a decode-only step through every layer in C instead: the same maths as `layers.py`, with the
residual stream in float32, and the linears the model already multiplies with: `int8_dot.c`'s for
the quantized formats (up to `MAX_ROWS` sequences; larger batches multiply faster as dense GEMMs),
or `gemm_f32.c`'s packed GEMM (`PackedF32Linear`), the same kernel and order of sums as the eager
step, or `gemm_bf16.c`'s bf16 GEMM (`PackedBf16Linear`: the eager bf16 step's kernel too, its inputs
rounded to bf16 as the eager step's are, its residual kept in float32 as the others' is). It is the
CPU's `FastPath` (labkit/engine/fast_path.py), where CUDA graphs are the GPU's: `ModelRunner.forward`
gives it the decode steps it `fits` (`run`) and every other step (`forward_hidden`). A dense model's
fused step runs those too, prompts and mixed steps alike, each
prompt row attending as a decode row over its causal prefix: in bf16 that cut the bench's prefill by
about a quarter (the eager step's ~1,400 small torch ops, its padded and masked attention); in
float32, where the GEMMs dominate, it measured even. A quantized model's prompts stay eager, where
its many rows multiply as dense GEMMs. `FusedDecoder.unsupported(model, storage)` says why a model
cannot use it.
"""

import ctypes

import torch

from labkit.attention import cpu_decode
from labkit.attention.metadata import AttentionMetadata
from labkit.attention.reference import rows_as_decode_rows
from labkit.kernels import fused_decode as fused
from labkit.kernels import gemm, int8_dot
from labkit.model.layers import rope_cos_sin, rope_inv_freq
from labkit.model.packed_linear import PackedBf16Linear, PackedF32Linear
from labkit.model.weight_formats import Int8Linear, Q4Linear

MAX_ROWS = int8_dot.DENSE_FROM_ROWS  # quantized: more sequences than this multiply faster as dense GEMMs
_KIND = {Q4Linear: 0, Int8Linear: 1, PackedF32Linear: 2, PackedBf16Linear: 3}  # fused_decode.c's Q4_1, INT8,
# F32_PACKED, BF16_PACKED


def _linears(layer) -> tuple:
    """A decoder layer's seven linears, in `fused.Layer`'s order."""
    attn, mlp = layer.self_attn, layer.mlp
    return attn.q_proj, attn.k_proj, attn.v_proj, attn.o_proj, mlp.gate_proj, mlp.up_proj, mlp.down_proj


def _linear_struct(layer) -> fused.Linear:
    if isinstance(layer, PackedF32Linear):
        return fused.Linear(_KIND[PackedF32Linear], layer.packed.data_ptr(), None, None, layer.out_features,
                       layer.in_features, layer.in_features)
    if isinstance(layer, PackedBf16Linear):
        return fused.Linear(_KIND[PackedBf16Linear], layer.packed.data_ptr(), None, None, layer.out_features,
                       layer.padded_in_features, layer.in_features)
    packed = layer.native
    return fused.Linear(_KIND[type(layer)], *(t.data_ptr() for t in packed.tensors), packed.out_features,
                   packed.padded_in_features, packed.in_features)


def _weights_kind(model) -> str | None:
    """"quantized" (every linear in int8_dot.c's formats), "float32" (every linear packed for
    gemm_f32.c), "bfloat16" (every linear packed for gemm_bf16.c), or None: the fused step multiplies
    with the kernels the layers already hold."""
    linears = [linear for layer in model.layers for linear in _linears(layer)]
    if any(linear.bias is not None for linear in linears):
        return None
    if all(isinstance(linear, Q4Linear | Int8Linear) and linear.native is not None for linear in linears):
        return "quantized"
    if all(isinstance(linear, PackedF32Linear) for linear in linears):  # each holds the loaded kernel
        return "float32"
    if all(isinstance(linear, PackedBf16Linear) for linear in linears):
        return "bfloat16"
    return None


class FusedDecoder:
    """A model's steps in one C call: decode steps (`run`; a quantized model: up to MAX_ROWS sequences)
    and, for a dense model, any step (`forward_hidden`; a quantized model's run eagerly)."""

    @staticmethod
    def unsupported(model, storage) -> str | None:
        """Why this model and KV pool cannot run fused (None: they can)."""
        c = model.config
        if model.device.type != "cpu":
            return f"runs on the CPU, the model is on {model.device.type}"
        if fused.load() is None:
            return fused.load.why_not()
        if c.qk_norm or c.attention_bias or c.head_dim % 16:
            return "the model has q/k norms, attention biases or a head_dim not a multiple of 16"
        if _weights_kind(model) is None:
            return ("its linear layers are neither all in a quantized weight format with the C int8 dot kernel "
                    "nor all packed for a C GEMM (PackedF32Linear, PackedBf16Linear), without biases")
        if storage.quantized or storage.dtype != model.dtype or not cpu_decode.supports(storage):
            return "the KV pool is quantized, not in the model's dtype, or not one the C decode kernel reads"
        return None

    def __init__(self, model, storage, backend):
        reason = self.unsupported(model, storage)
        if reason is not None:
            raise ValueError(f"this model cannot decode fused: {reason}")
        c = model.config
        self.model, self.storage, self.backend = model, storage, backend
        self._norms = [(layer.input_layernorm.weight.float().contiguous(),
                        layer.post_attention_layernorm.weight.float().contiguous()) for layer in model.layers]
        layers = []
        for i, layer in enumerate(model.layers):
            k_cache, v_cache = storage.layer(i)
            layers.append(fused.Layer(*(_linear_struct(linear) for linear in _linears(layer)),
                                      self._norms[i][0].data_ptr(), self._norms[i][1].data_ptr(), k_cache.data_ptr(),
                                      v_cache.data_ptr()))
        self._layers = (fused.Layer * len(layers))(*layers)
        kind = _weights_kind(model)
        self.max_rows = None if kind in ("float32", "bfloat16") else MAX_ROWS  # None: any decode batch
        self.runs_prompts = self.max_rows is None  # `forward_hidden` takes any step
        packed = {"gemm_f32": (gemm.load_f32, "float32"), "gemm_bf16": (gemm.load_bf16, "bfloat16")}
        gemms = {name: ctypes.cast(load().gemm, ctypes.c_void_p).value if kind == dtype else None
                 for name, (load, dtype) in packed.items()}
        # the LM head of a packed bf16 model takes bf16 rows, as the eager step's final norm gives it
        self._head_dtype = torch.bfloat16 if kind == "bfloat16" else torch.float32
        self._shape = dict(hidden=c.hidden_size, num_heads=c.num_heads, num_kv_heads=c.num_kv_heads,
                           head_dim=c.head_dim, intermediate=c.intermediate_size, block_size=storage.block_size,
                           eps=c.rms_norm_eps, kv_bf16=int(storage.dtype == torch.bfloat16), **gemms)
        self._inv_freq = rope_inv_freq(c.head_dim, c.rope_theta, c.rope_scaling)
        # The step's activations, kept from step to step: a prompt step's are tens of MB, which a fresh
        # allocation would fault in page by page every time.
        self._workspace = torch.empty(0, dtype=torch.uint8)

    def fits(self, num_seqs: int, width: int) -> bool:
        return self.max_rows is None or num_seqs <= self.max_rows

    @torch.inference_mode()
    def run(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        """Logits [B, vocab] of a decode-only step of B sequences (every row is sampled)."""
        if not self.fits(input_ids.shape[0], 0) or meta.max_seqlen_q != 1 or input_ids.shape != positions.shape:
            limit = "any number of" if self.max_rows is None else f"up to {self.max_rows}"
            raise ValueError(f"a fused step takes {limit} sequences adding one token each, got "
                             f"{tuple(input_ids.shape)} tokens with max_seqlen_q={meta.max_seqlen_q}")
        x = self._layers_in_c(input_ids, positions, meta.block_tables, meta.context_lens, meta.slot_mapping)
        return self.model.compute_logits(self.model.norm(x.to(self._head_dtype)))

    @torch.inference_mode()
    def forward_hidden(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        """Final-norm hidden states [T, hidden] of any step's T new tokens (prompts, chunks, decodes mixed).

        Row j of a sequence attends as a decode row over its own causal prefix, read from the pool
        through its sequence's block table: every new K/V row of a layer is stored before that layer
        attends, so the pool holds the prefix. Only a dense model's fused step takes prompts
        (`runs_prompts`): a quantized one multiplies more rows faster as the eager model's dense GEMMs."""
        if not self.runs_prompts:
            return self.model.forward_hidden(input_ids, positions, meta, self.backend)
        if input_ids.shape != positions.shape or input_ids.dim() != 1:
            raise ValueError(f"input_ids {tuple(input_ids.shape)} and positions {tuple(positions.shape)} must be "
                             "one flat batch")
        tables, context = rows_as_decode_rows(meta.cu_seqlens_q, meta.cu_seqlens_k, meta.block_tables)
        x = self._layers_in_c(input_ids, positions, tables, context, meta.slot_mapping)
        return self.model.norm(x.to(self._head_dtype))

    def _layers_in_c(self, input_ids, positions, block_tables, context_lens, slot_mapping) -> torch.Tensor:
        """The residual stream [T, hidden] (float32) after every layer, each row's attention reading
        `context_lens[row]` tokens through `block_tables[row]`."""
        plan = cpu_decode.DecodePlan(block_tables, context_lens, self.storage.block_size)  # checks them
        block_tables, context_lens = plan.block_tables, plan.context_lens  # int32, contiguous
        slots = slot_mapping.to(torch.int64).contiguous()
        if int(slots.min()) < 0 or int(slots.max()) >= self.storage.num_blocks * self.storage.block_size:
            raise ValueError(f"slot_mapping {slots.tolist()} has slots outside the pool's "
                             f"{self.storage.num_blocks * self.storage.block_size}")
        cos, sin = (t.contiguous() for t in rope_cos_sin(positions, self._inv_freq, torch.float32))
        x = self.model.embed_tokens(input_ids).float().contiguous()
        shape = fused.Shape(**self._shape, max_blocks=block_tables.shape[1])
        kernel = fused.load()
        needed = kernel.workspace(ctypes.byref(shape), x.shape[0]) + 64  # + room to align
        if self._workspace.numel() < needed:
            self._workspace = torch.empty(needed, dtype=torch.uint8)
        work = -self._workspace.data_ptr() % 64 + self._workspace.data_ptr()
        if kernel.step(self._layers, len(self._layers), ctypes.byref(shape), x.shape[0], x.data_ptr(), cos.data_ptr(),
                       sin.data_ptr(), slots.data_ptr(), block_tables.data_ptr(), context_lens.data_ptr(), work):
            raise MemoryError("the fused step's GEMM could not allocate its copy of the input rows")
        return x
