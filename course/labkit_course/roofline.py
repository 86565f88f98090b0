"""The roofline: what a machine can compute and stream, and where a model's steps fall on it.

A step that does F floating-point operations and moves B bytes between memory and the cores takes
at least max(F / peak, B / bandwidth): its arithmetic intensity F / B decides which term wins. The
machine's two numbers are measured here on the machine itself (they differ from every datasheet);
a step's F and B are counted from the model's shape.
"""

from dataclasses import dataclass

import torch

from labkit.model.config import ModelConfig
from labkit.timing import measure


def measure_matmul_flops(m: int, k: int, n: int, dtype: torch.dtype = torch.float32, repeats: int = 5,
                         device: torch.device | str = "cpu") -> float:
    """FLOP/s of torch.matmul on [m, k] @ [k, n] (2*m*k*n operations), best of `repeats` runs."""
    a = torch.randn(m, k, dtype=dtype, device=device)
    b = torch.randn(k, n, dtype=dtype, device=device)
    out = torch.empty(m, n, dtype=dtype, device=device)
    return 2 * m * k * n / measure(lambda: torch.matmul(a, b, out=out), repeats, device=device).best


def measure_read_bandwidth(num_bytes: int = 256 * 2**20, repeats: int = 5,
                           device: torch.device | str = "cpu") -> float:
    """Bytes/s streamed from a float32 tensor far larger than the caches, best of `repeats`: the faster of
    a sum and a matrix-vector product over it (batch-1 decode's own operation; on some CPUs it streams
    half again as fast as torch's sum)."""
    x = torch.ones(num_bytes // 4, dtype=torch.float32, device=device)
    matrix, vector = x.view(-1, 1024), torch.ones(1024, device=device)
    seconds = min(measure(x.sum, repeats, device=device).best,
                  measure(lambda: matrix @ vector, repeats, device=device).best)
    return x.numel() * 4 / seconds


@dataclass(frozen=True)
class StepCost:
    """What one forward pass costs: operations and bytes moved between memory and the cores."""

    flops: float
    bytes_moved: float

    @property
    def intensity(self) -> float:
        """FLOP per byte: where the step sits on the roofline's horizontal axis."""
        return self.flops / self.bytes_moved


def _linear_params_per_layer(c: ModelConfig) -> int:
    qkv_and_out = c.hidden_size * (2 * c.num_heads + 2 * c.num_kv_heads) * c.head_dim
    return qkv_and_out + 3 * c.hidden_size * c.intermediate_size


def weight_bytes(c: ModelConfig, dtype_bytes: int) -> int:
    """Bytes of every weight a forward pass reads once (the tied LM head counts once)."""
    return (c.num_layers * _linear_params_per_layer(c) + c.vocab_size * c.hidden_size) * dtype_bytes


def step_cost(c: ModelConfig, num_new_tokens: int, context_per_token: float, num_sequences: int,
              context_len: int, dtype_bytes: int) -> StepCost:
    """One forward pass over `num_new_tokens` tokens (of `num_sequences` sequences together).

    FLOPs: 2 per weight per token in the linear layers and the LM head, plus attention's QK^T and
    PV (2 * 2 * num_heads * head_dim per attended position, `context_per_token` on average).
    Bytes: every weight once, plus the K/V of `context_len` tokens per sequence read once. Small
    terms (norms, rotary, activations) are left out.
    """
    linear = c.num_layers * _linear_params_per_layer(c) + c.vocab_size * c.hidden_size
    attention = c.num_layers * 4 * c.num_heads * c.head_dim * context_per_token
    flops = num_new_tokens * (2 * linear + attention)
    kv_read = num_sequences * context_len * c.kv_cache_bytes_per_token(dtype_bytes)
    return StepCost(flops, weight_bytes(c, dtype_bytes) + kv_read)


def prefill_cost(c: ModelConfig, prompt_len: int, dtype_bytes: int = 4) -> StepCost:
    """A causal prefill of one prompt: token t attends to t + 1 positions, (T + 1) / 2 on average."""
    return step_cost(c, prompt_len, (prompt_len + 1) / 2, 1, 0, dtype_bytes)


def decode_cost(c: ModelConfig, batch: int, context_len: int, dtype_bytes: int = 4) -> StepCost:
    """One decode step of `batch` sequences, each attending to `context_len` cached tokens."""
    return step_cost(c, batch, context_len, batch, context_len, dtype_bytes)


def engine_step_cost(c: ModelConfig, q_lens: list[int], k_lens: list[int], num_scored_rows: int,
                     dtype_bytes: int) -> StepCost:
    """One engine step over a flat batch: sequence i computes q_lens[i] new tokens over a context of
    k_lens[i] (cached + new), and only `num_scored_rows` rows go through the LM head (a prompt chunk
    that does not end its prompt needs no logits). Query j of sequence i attends to
    k_lens[i] - q_lens[i] + j + 1 positions. Bytes: every weight once, plus each sequence's K/V."""
    tokens = sum(q_lens)
    attended = sum(q * (k - q) + q * (q + 1) / 2 for q, k in zip(q_lens, k_lens, strict=True))
    flops = (2 * c.num_layers * _linear_params_per_layer(c) * tokens + 2 * c.vocab_size * c.hidden_size
             * num_scored_rows + c.num_layers * 4 * c.num_heads * c.head_dim * attended)
    return StepCost(flops, weight_bytes(c, dtype_bytes) + sum(k_lens) * c.kv_cache_bytes_per_token(dtype_bytes))


# A fixed machine for results that must not depend on the one a lab runs on: roughly an H100 SXM's
# dense bf16 peak and its HBM3 bandwidth, rounded.
ILLUSTRATIVE_PEAK_FLOPS = 1.0e15
ILLUSTRATIVE_BANDWIDTH = 3.35e12
