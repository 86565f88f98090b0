"""How many KV-cache blocks fit, decided the way vLLM decides it (its "profile run").

On a GPU the KV cache gets what is left of `gpu_memory_utilization` x the device's memory once
everything else the engine needs at its worst moment is counted: the weights and the activations of
the largest step the scheduler can form (`max_num_batched_tokens` tokens), memory others hold (the
CUDA context, other processes) and, when decode steps replay CUDA graphs, the activations their
memory pool keeps. Activations are measured, not guessed: reset torch's peak-memory counter, run a
dummy step of that size, read the peak. On the CPU the cache gets a fixed budget instead (host
memory is shared with everything else on the machine, and nothing tells us our share).

The arithmetic (`MemoryProfile`, `num_blocks_for_memory`) is plain Python, tested on the CPU with
made-up numbers. `profile_cuda_memory` runs only on CUDA, out of the CPU test suite's reach:
`make gpu-check` runs it (reports/gpu/).
"""

from dataclasses import dataclass

import torch

from labkit.attention.dense import dense_attention
from labkit.attention.metadata import AttentionMetadata
from labkit.cache.paged_storage import PagedKVStorage
from labkit.model.layers import fused_elementwise

DEFAULT_CPU_KV_CACHE_BYTES = 512 * 2**20
OTHERS_HOLD_GPU_BYTES = 2 * 2**30  # a CUDA context takes well under this; more means another process


def _gib(num_bytes: int) -> str:
    return f"{num_bytes / 2**30:.2f} GiB"


@dataclass(frozen=True)
class MemoryProfile:
    """What a profile run measured on one GPU, in bytes."""

    total: int  # the device's memory
    peak: int  # the most torch held during the largest step: weights + activations
    non_torch: int  # held outside torch's allocator: the CUDA context, other processes
    graph_pool: int = 0  # activations a decode CUDA graph keeps for its largest batch (0: no graphs)

    def kv_cache_budget(self, gpu_memory_utilization: float) -> int:
        return int(self.total * gpu_memory_utilization) - self.peak - self.non_torch - self.graph_pool

    def explain(self, gpu_memory_utilization: float) -> str:
        return (f"{gpu_memory_utilization:g} x {_gib(self.total)} of GPU memory, less {_gib(self.peak)} at the "
                f"profile run's peak (weights + activations), {_gib(self.non_torch)} held outside torch and "
                f"{_gib(self.graph_pool)} for CUDA graphs")


def kv_bytes_per_block(config, block_size: int, dtype: torch.dtype, kv_cache_dtype: str = "auto") -> int:
    """K and V of one block for every layer (quantized: one byte per value plus the per-head scales)."""
    return config.num_layers * PagedKVStorage.bytes_per_block_per_layer(
        block_size, config.num_kv_heads, config.head_dim, dtype, kv_cache_dtype)


def num_blocks_for_memory(config, block_size: int, dtype: torch.dtype, *, profile: MemoryProfile | None = None,
                          gpu_memory_utilization: float = 0.9,
                          cpu_kv_cache_bytes: int = DEFAULT_CPU_KV_CACHE_BYTES,
                          max_model_len: int | None = None, kv_cache_dtype: str = "auto") -> int:
    """How many KV blocks fit: the GPU's budget after a profile run, or the CPU's fixed budget.

    An engine whose cache cannot hold one block, or one sequence of `max_model_len` tokens, is an
    error that gives the numbers and what to change.
    """
    if not 0 < gpu_memory_utilization <= 1:
        raise ValueError(f"gpu_memory_utilization must lie in (0, 1], got {gpu_memory_utilization}")
    if profile is None:
        budget, where = int(cpu_kv_cache_bytes), f"the CPU budget cpu_kv_cache_bytes={int(cpu_kv_cache_bytes)}"
    else:
        budget, where = profile.kv_cache_budget(gpu_memory_utilization), profile.explain(gpu_memory_utilization)
    per_block = kv_bytes_per_block(config, block_size, dtype, kv_cache_dtype)
    num_blocks = max(budget, 0) // per_block
    fix = ("raise gpu_memory_utilization, lower max_num_batched_tokens or max_num_seqs, or use a smaller dtype"
           if profile is not None else "raise cpu_kv_cache_bytes or use kv_cache_dtype='int8'")
    if profile is not None and profile.non_torch > OTHERS_HOLD_GPU_BYTES:
        fix = (f"{_gib(profile.non_torch)} of this GPU is held outside this process's torch, more than a CUDA "
               "context takes: another process (a second engine or server?) holds it. Give each engine on a "
               "shared GPU a fixed num_kvcache_blocks, or stop the other process; else " + fix)
    if num_blocks < 1:
        raise ValueError(f"the KV cache does not fit: {where} leaves {_gib(budget)} ({budget} bytes), and one "
                         f"block of {block_size} tokens needs {per_block} bytes; {fix}")
    if max_model_len is not None and num_blocks * block_size < max_model_len:
        raise ValueError(f"the KV cache holds {num_blocks} blocks x {block_size} = {num_blocks * block_size} tokens, "
                         f"fewer than one sequence of max_model_len={max_model_len} ({where} leaves "
                         f"{_gib(budget)}); {fix}, or lower max_model_len")
    return num_blocks


@torch.inference_mode()
@fused_elementwise()  # as the engine's steps run
def _dummy_step(model, num_tokens: int, num_seqs: int) -> None:
    """A forward pass shaped like a step of `num_seqs` sequences and `num_tokens` new tokens."""
    lens = [num_tokens // num_seqs + (i < num_tokens % num_seqs) for i in range(num_seqs)]
    meta = AttentionMetadata.causal(lens, device=model.device)
    ids = torch.zeros(num_tokens, dtype=torch.int64, device=model.device)
    positions = torch.cat([torch.arange(n, device=model.device) for n in lens])
    hidden = model.forward_hidden(ids, positions, meta, dense_attention)
    model.compute_logits(hidden[meta.cu_seqlens_q[1:] - 1]).float()  # the sampler works on fp32 logits


def profile_cuda_memory(model, max_num_batched_tokens: int, max_num_seqs: int,
                        graph_batch_size: int = 0) -> MemoryProfile:
    """vLLM's profile run, before the KV cache exists (CUDA only: `make gpu-check` runs it).

    Attention runs densely (each dummy sequence over its own tokens); the Triton kernels the engine
    uses need no workspace beyond their output, so the dense pass is the larger of the two.
    """
    device = model.device
    torch.cuda.synchronize(device)
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats(device)
    _dummy_step(model, max_num_batched_tokens, min(max_num_seqs, max_num_batched_tokens))
    torch.cuda.synchronize(device)
    peak = torch.cuda.max_memory_allocated(device)
    graph_pool = 0
    if graph_batch_size:
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(device)
        before = torch.cuda.memory_allocated(device)
        _dummy_step(model, graph_batch_size, graph_batch_size)  # one token per sequence: a decode step
        torch.cuda.synchronize(device)
        graph_pool = torch.cuda.max_memory_allocated(device) - before
    torch.cuda.empty_cache()
    free, total = torch.cuda.mem_get_info(device)
    non_torch = max(total - free - torch.cuda.memory_reserved(device), 0)
    return MemoryProfile(total=total, peak=peak, non_torch=non_torch, graph_pool=graph_pool)
