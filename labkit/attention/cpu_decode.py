"""Decode attention on a CPU that reads K/V straight from the block pool: a small C kernel.

The torch path (`reference.PagedAttentionPlan`) copies every sequence's padded context out of the
pool in every layer, then runs SDPA on the copy; on a decode-heavy batch that copy costs about as
much as the attention itself. `paged_decode.c` instead walks each sequence's block table and folds
block after block into an online softmax (the PagedAttention lesson, "Flash-Paged Attention"),
reading each KV head once for its group of query heads, in float32 or bfloat16 pools with float32
sums. It is single-threaded: the engine runs one thread per process in its tests and benchmarks.

The C file (labkit/kernels/paged_decode.c, bound in `labkit.kernels.decode_attention`) is compiled
at first use for this CPU. Without a compiler, or when compiling fails, attention keeps the torch
path; `labkit.kernels.describe()` names which one runs.
"""

import torch

from labkit.kernels import decode_attention


def supports(storage) -> bool:
    """Whether the kernel can read this `PagedKVStorage`'s pools (compiling it if it was not yet): a
    float32 or bfloat16 pool on the CPU with head_dim a multiple of 16 and blocks of at most
    MAX_BLOCK_SIZE tokens. Quantized pools keep torch."""
    return (storage.device.type == "cpu" and not storage.quantized and storage.dtype in decode_attention.ENTRY_POINTS
            and storage.head_dim % 16 == 0 and storage.block_size <= decode_attention.MAX_BLOCK_SIZE
            and decode_attention.load() is not None)


class DecodePlan:
    """A decode step's block tables and lengths, checked and laid out for the kernel once, then run
    by every layer. `tokens`: the rows of the step's flat batch these sequences' queries occupy
    (None: all of them, in order), as `reference.PagedAttentionPlan` expects of its groups."""

    def __init__(self, block_tables: torch.Tensor, context_lens: torch.Tensor, block_size: int,
                 tokens: torch.Tensor | None = None):
        if block_tables.dim() != 2 or context_lens.shape != block_tables.shape[:1]:
            raise ValueError(f"block_tables {tuple(block_tables.shape)} and context_lens "
                             f"{tuple(context_lens.shape)}: need [B, max_blocks] and [B]")
        if block_tables.device.type != "cpu" or context_lens.device.type != "cpu":
            raise ValueError("the C decode kernel runs on CPU tensors only")
        if not 0 < block_size <= decode_attention.MAX_BLOCK_SIZE:
            raise ValueError(f"block_size must be in 1..{decode_attention.MAX_BLOCK_SIZE}, got {block_size}")
        if context_lens.numel() and int(context_lens.min()) < 1:
            raise ValueError(f"every sequence needs a context of at least one token, got {context_lens.tolist()}")
        blocks_needed = -(-context_lens.long() // block_size)
        if blocks_needed.numel() and int(blocks_needed.max()) > block_tables.shape[1]:
            raise ValueError(f"context lengths {context_lens.tolist()} need more than the block tables' "
                             f"{block_tables.shape[1]} blocks of {block_size} tokens")
        used = block_tables[torch.arange(block_tables.shape[1]) < blocks_needed[:, None]]
        if used.numel() and int(used.min()) < 0:
            raise ValueError("a block table has an unused (-1) entry inside its sequence's context")
        self.max_block_id = int(used.max()) if used.numel() else -1
        self.block_tables = block_tables.to(torch.int32).contiguous()
        self.context_lens = context_lens.to(torch.int32).contiguous()
        self.block_size, self.tokens = block_size, tokens
        self._kernel = decode_attention.load()
        if self._kernel is None:
            raise RuntimeError(f"the C decode kernel is unavailable: {decode_attention.load.why_not()}")
        self._checked = None  # the layout of the last inputs `_check` accepted: every layer's is the same

    def attend(self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor) -> torch.Tensor:
        """q [B, H, D] (one query per sequence) and the layer's block pools [N, block_size, Hkv, D] -> [B, H, D]."""
        layout = (q.dtype, q.device, q.shape, k_cache.dtype, k_cache.device, k_cache.shape, k_cache.stride(),
                  v_cache.dtype, v_cache.device, v_cache.shape, v_cache.stride())
        if layout != self._checked:  # checked by the step's first layer; a batch-1 decode feels every microsecond
            self._check(q, k_cache, v_cache)
            self._checked = layout
        q = q.contiguous()
        out = torch.empty_like(q)
        num_seqs, num_heads, dim = q.shape
        self._kernel.functions[q.dtype](q.data_ptr(), k_cache.data_ptr(), v_cache.data_ptr(),
                                        self.block_tables.data_ptr(), self.context_lens.data_ptr(), out.data_ptr(),
                                        num_seqs, num_heads, k_cache.shape[2], dim, self.block_size,
                                        self.block_tables.shape[1], dim ** -0.5)
        return out

    def _check(self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor) -> None:
        dtypes = list(decode_attention.ENTRY_POINTS)
        if q.dtype not in dtypes or k_cache.dtype != q.dtype or v_cache.dtype != q.dtype:
            raise ValueError(f"q, k_cache and v_cache must share one dtype of {dtypes}, got "
                             f"{q.dtype}, {k_cache.dtype}, {v_cache.dtype}")
        if any(t.device.type != "cpu" for t in (q, k_cache, v_cache)):
            raise ValueError("the C decode kernel runs on CPU tensors only")
        if q.dim() != 3 or k_cache.dim() != 4 or k_cache.shape != v_cache.shape:
            raise ValueError(f"q {tuple(q.shape)}, k_cache {tuple(k_cache.shape)}, v_cache {tuple(v_cache.shape)}: "
                             "need [B, H, D] and two pools [N, block_size, Hkv, D]")
        num_blocks, block_size, num_kv_heads, dim = k_cache.shape
        if q.shape[0] != self.context_lens.numel() or q.shape[2] != dim or q.shape[1] % num_kv_heads:
            raise ValueError(f"q {tuple(q.shape)} does not fit {self.context_lens.numel()} sequences over pools "
                             f"{tuple(k_cache.shape)} (num_heads must be a multiple of num_kv_heads)")
        if block_size != self.block_size:
            raise ValueError(f"the pools have blocks of {block_size} tokens, the plan {self.block_size}")
        if self.max_block_id >= num_blocks:
            raise ValueError(f"block id {self.max_block_id} is outside the pool's {num_blocks} blocks")
        if dim % 16:
            raise ValueError(f"head_dim must be a multiple of 16 for the C decode kernel, got {dim}")
        if not (k_cache.is_contiguous() and v_cache.is_contiguous()):
            raise ValueError("k_cache and v_cache must be contiguous (the kernel walks them by offsets)")


def paged_decode_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                           block_tables: torch.Tensor, context_lens: torch.Tensor) -> torch.Tensor:
    """One new token per sequence, q [B, H, D], against its context in the pools, by the C kernel
    (the same contract as `reference.paged_decode_attention`)."""
    return DecodePlan(block_tables, context_lens, k_cache.shape[1]).attend(q, k_cache, v_cache)
