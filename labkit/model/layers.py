"""The building blocks of a Llama-family decoder layer, each as small as the maths allows.

All of them work on a flat batch: [T, ...] tensors holding the new tokens of every sequence in a
step, with no padding. Attention is the only block that needs to know where one sequence ends and
the next begins; it hands that question to the attention backend together with the metadata.

fp16 (the dtype on GPUs older than sm80) tops out at 65,504, and a decoder's residual stream can
grow past that: the decoder then carries the residual in fp32 (see `residual_dtype`), every norm
hands its sublayer the weights' dtype, and what a sublayer adds back is clamped to fp16's range.

The engine's steps on a GPU in half precision run the element-wise chains (RMSNorm, rotary, SiLU
times up) through torch.compile, one kernel each (`fused_on_gpu`); everywhere else they run op for op.
"""

import contextlib
import contextvars
import functools
import math
import warnings

import torch
import torch.nn.functional as F
from torch import nn

from labkit.attention.metadata import AttentionBackend, AttentionMetadata
from labkit.model.config import ModelConfig, RopeScaling

_FUSING = contextvars.ContextVar("labkit_fusing", default=False)


@contextlib.contextmanager
def fused_elementwise():
    """Within it, `fused_on_gpu` functions on a GPU in half precision run compiled: the engine's steps.

    The engine turns it on around its forward passes (and the CUDA graphs it records); a notebook that
    calls the model directly runs every op as written, with no compile time on its first call."""
    token = _FUSING.set(True)
    try:
        yield
    finally:
        _FUSING.reset(token)


def fused_on_gpu(fn):
    """`fn` as written, or, inside `fused_elementwise` on a GPU in half precision, torch.compile's fusion
    of it: one Triton kernel for its chain of element-wise ops instead of one kernel per op. A decode
    step of Qwen3-0.6B otherwise launches ~1,200 kernels, ~900 of them small element-wise ones that
    cost more to launch and run than their arithmetic. fp32 and the CPU run `fn` op for op (the
    exact-parity checks, the notebooks). If the compiler fails here, a warning says so and `fn` runs
    as written."""
    compiled = None

    @functools.wraps(fn)
    def run(*args):
        nonlocal compiled
        if not fuses(args):
            return fn(*args)
        if compiled is None:
            # Shapes left to torch.compile's own rule (static first; a dimension seen to change becomes
            # symbolic): with every dimension symbolic (dynamic=True) its kernels computed their indices
            # by runtime division and ran rotary at 34 us and SiLU-times-up at 28 us a call on ~1 MB on
            # an H100 (reports/gpu/2026-11-26-1600-*), ten times a bandwidth-bound kernel.
            compiled = torch.compile(fn, fullgraph=True)
        try:
            return compiled(*args)
        except Exception as error:  # noqa: BLE001 - the compiler, not the maths, failed: run it unfused
            warnings.warn(f"torch.compile of {fn.__name__} failed ({type(error).__name__}: {error}); "
                          "running it op by op", stacklevel=2)
            compiled = fn
            return fn(*args)

    return run


def fuses(args) -> bool:
    """Whether `fused_on_gpu` compiles a call: inside `fused_elementwise`, on a GPU, with an fp16 or bf16 tensor."""
    if not _FUSING.get():
        return False
    tensors = [a for a in args if isinstance(a, torch.Tensor)]
    return tensors[0].is_cuda and any(t.dtype in (torch.float16, torch.bfloat16) for t in tensors)


def residual_dtype(dtype: torch.dtype) -> torch.dtype:
    """fp32 for an fp16 model (whose range the residual stream can outgrow), else the model's dtype."""
    return torch.float32 if dtype == torch.float16 else dtype


def clamp_to_range(x: torch.Tensor) -> torch.Tensor:
    """Saturate fp16 values at +-65,504 instead of letting them overflow to inf (and then NaN)."""
    if x.dtype != torch.float16:
        return x
    limit = torch.finfo(torch.float16).max
    return x.clamp(-limit, limit)


class RMSNorm(nn.Module):
    """x / sqrt(mean(x^2) + eps) * weight, computed in fp32 whatever the model's dtype (as Llama does).

    The result has the weight's dtype, so an fp32 residual stream feeds an fp16 sublayer in fp16.
    """

    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return rms_norm(x, self.weight, self.eps)


@fused_on_gpu
def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    # F.rms_norm is x * rsqrt(mean(x^2) + eps) in one call, bit for bit the four-op version.
    return weight * F.rms_norm(x.float(), weight.shape, eps=eps).to(weight.dtype)


def rope_inv_freq(head_dim: int, theta: float, scaling: RopeScaling | None = None,
                  device: torch.device | str | None = None) -> torch.Tensor:
    """The head_dim/2 rotation frequencies theta^(-2i/d); Llama-3 stretches the low ones."""
    inv_freq = 1.0 / theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64, device=device).float() / head_dim)
    if scaling is None:
        return inv_freq
    # Llama 3: wavelengths longer than the original context / low_freq_factor are divided by `factor`,
    # shorter than original / high_freq_factor kept, and those in between blended smoothly.
    wavelen = 2 * math.pi / inv_freq
    low_wavelen = scaling.original_max_position_embeddings / scaling.low_freq_factor
    high_wavelen = scaling.original_max_position_embeddings / scaling.high_freq_factor
    smooth = (scaling.original_max_position_embeddings / wavelen - scaling.low_freq_factor) / (
        scaling.high_freq_factor - scaling.low_freq_factor
    )
    blended = (1 - smooth) * inv_freq / scaling.factor + smooth * inv_freq
    scaled = torch.where(wavelen > low_wavelen, inv_freq / scaling.factor, inv_freq)
    in_between = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
    return torch.where(in_between, blended, scaled)


def rope_cos_sin(positions: torch.Tensor, inv_freq: torch.Tensor, dtype: torch.dtype):
    """cos and sin of position * frequency, [T, head_dim/2] each, computed in fp32."""
    angles = positions.float()[:, None] * inv_freq[None, :]
    return angles.cos().to(dtype), angles.sin().to(dtype)


@fused_on_gpu
def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate the pairs (x[i], x[i + d/2]) of every head by its position's angles.

    x: [T, heads, head_dim]; cos, sin: [T, head_dim/2]. This is the "half-split" (GPT-NeoX) pairing
    Hugging Face checkpoints use; llama.cpp's GGUF files interleave pairs, so the GGUF loader
    permutes the q/k weight rows back into this order.
    """
    x1, x2 = x.chunk(2, dim=-1)
    cos, sin = cos[:, None, :], sin[:, None, :]
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)


class Attention(nn.Module):
    """Grouped-query self-attention: project, (q/k-norm), rotate, then let the backend attend."""

    def __init__(self, config: ModelConfig, layer_idx: int):
        super().__init__()
        self.layer_idx = layer_idx
        self.num_heads, self.num_kv_heads, self.head_dim = config.num_heads, config.num_kv_heads, config.head_dim
        bias = config.attention_bias
        self.q_proj = nn.Linear(config.hidden_size, self.num_heads * self.head_dim, bias=bias)
        self.k_proj = nn.Linear(config.hidden_size, self.num_kv_heads * self.head_dim, bias=bias)
        self.v_proj = nn.Linear(config.hidden_size, self.num_kv_heads * self.head_dim, bias=bias)
        self.o_proj = nn.Linear(self.num_heads * self.head_dim, config.hidden_size, bias=bias)
        if config.qk_norm:
            self.q_norm = RMSNorm(self.head_dim, config.rms_norm_eps)
            self.k_norm = RMSNorm(self.head_dim, config.rms_norm_eps)
        else:
            self.q_norm = self.k_norm = None

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                meta: AttentionMetadata, backend: AttentionBackend) -> torch.Tensor:
        T = x.shape[0]
        q = self.q_proj(x).view(T, self.num_heads, self.head_dim)
        k = self.k_proj(x).view(T, self.num_kv_heads, self.head_dim)
        v = self.v_proj(x).view(T, self.num_kv_heads, self.head_dim)
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)
        out = backend(self.layer_idx, q, k, v, meta)
        return self.o_proj(out.reshape(T, self.num_heads * self.head_dim))


class MLP(nn.Module):
    """SwiGLU: down(silu(gate(x)) * up(x))."""

    def __init__(self, config: ModelConfig):
        super().__init__()
        self.gate_proj = nn.Linear(config.hidden_size, config.intermediate_size, bias=False)
        self.up_proj = nn.Linear(config.hidden_size, config.intermediate_size, bias=False)
        self.down_proj = nn.Linear(config.intermediate_size, config.hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(silu_mul(self.gate_proj(x), self.up_proj(x)))


@fused_on_gpu
def silu_mul(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    return clamp_to_range(F.silu(gate) * up)


class DecoderLayer(nn.Module):
    """Pre-norm residual block: x + attn(norm(x)), then x + mlp(norm(x))."""

    def __init__(self, config: ModelConfig, layer_idx: int):
        super().__init__()
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.self_attn = Attention(config, layer_idx)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.mlp = MLP(config)

    def forward(self, x, cos, sin, meta, backend):
        x = x + clamp_to_range(self.self_attn(self.input_layernorm(x), cos, sin, meta, backend))
        return x + clamp_to_range(self.mlp(self.post_attention_layernorm(x)))
