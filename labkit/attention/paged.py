"""PagedAttentionBackend: the `AttentionBackend` the model calls per layer, over paged KV storage.

Per call it (1) stores the step's new K/V into the slots `meta.slot_mapping` names (-1: skip), then
(2) attends causally over each sequence's whole context through `meta.block_tables`. Two
implementations of the same contract:

- "torch": `labkit.attention.reference` (a vectorized gather plus one fused attention per layer,
  with the step's masks and indices planned once by its first layer), the default on CPU. Its
  decode rows read the pool directly through the block tables with the C kernel of
  `labkit.attention.cpu_decode` wherever that kernel compiles (`labkit.kernels.describe()` says),
  and so do a float32 prefill's rows, each over its causal prefix, when padding the batch would
  more than double the work;
- "triton": `labkit.attention.triton_kernels`, the default on CUDA; on a CPU it runs only under
  the Triton interpreter (TRITON_INTERPRET=1 set before triton is first imported), which is slow
  and meant for tests and the lab.

A quantized pool (`kv_cache_dtype="int8"` or "fp8") is read by the torch backend only: per step
the blocks its tables name are dequantized, once per layer, into a compact buffer the plan gathers
from, and attention always reads the cache (even in a prefill with nothing cached), so a prompt's
result does not depend on whether its prefix came from the prefix cache.

A step with no block tables (`meta.block_tables is None`) has nothing cached: every sequence
attends over its own new tokens (`cu_seqlens_k` must equal `cu_seqlens_q`). The same shortcut
is taken by the torch backend whenever a batch has no cached prefix, which skips the gather.
"""

import importlib.util
from typing import TYPE_CHECKING

import torch

from labkit.attention import cpu_decode, reference, triton_kernels
from labkit.attention.metadata import AttentionMetadata

if TYPE_CHECKING:  # the storage is handed in; attention never builds one (labkit.cache attends with labkit.attention)
    from labkit.cache.paged_storage import PagedKVStorage

BACKENDS = ("auto", "torch", "triton")


def resolve_backend(backend: str, device: torch.device) -> str:
    """"auto" -> "triton" on CUDA (when triton is installed: Linux only), "torch" elsewhere;
    "triton" on CPU needs the interpreter."""
    if backend not in BACKENDS:
        raise ValueError(f"backend must be one of {BACKENDS}, got {backend!r}")
    has_triton = importlib.util.find_spec("triton") is not None
    if backend == "auto":
        return "triton" if device.type == "cuda" and has_triton else "torch"
    if backend == "triton" and not has_triton:
        raise ValueError("backend='triton' needs the triton package (wheels exist for Linux only); "
                         "use backend='torch'")
    if backend == "triton" and device.type != "cuda" and not triton_kernels.interpreted():
        raise ValueError(
            "backend='triton' on a CPU needs the Triton interpreter: set TRITON_INTERPRET=1 before "
            "triton is imported, or use backend='torch'"
        )
    return backend


class PagedAttentionBackend:
    def __init__(self, storage: "PagedKVStorage", backend: str = "auto"):
        self.storage = storage
        self.backend = resolve_backend(backend, storage.device)
        if self.backend == "triton" and storage.quantized:
            raise ValueError(f"the triton attention backend reads K/V in the model's dtype only, not "
                             f"kv_cache_dtype={storage.quant.name!r}: use attention_backend='torch' (the default "
                             f"on CPU) or kv_cache_dtype='auto'")
        if self.backend == "triton":
            self._store, self._kernels = triton_kernels.store_kvcache, triton_kernels
        else:
            self._store, self._kernels = None, None
        self._plan = None  # (metadata, plan, blocks to dequantize or None) of the step being run
        # The torch backend's decode rows: read by the C kernel where it serves this pool, else gathered.
        use_kernel = self.backend == "torch" and cpu_decode.supports(storage)
        self._decode_group = cpu_decode.DecodePlan if use_kernel else None
        # In float32 the kernel serves a prefill's rows too, each a decode row over its causal prefix:
        # on the bench's prompts (16-96 tokens, 64 at once) 3x faster than the padded, masked SDPA.
        # In bfloat16 the padded SDPA measured faster, so bf16 prefills keep it.
        self._every_row_as_decode = use_kernel and storage.dtype == torch.float32

    @property
    def reads_pool_in_c(self) -> bool:
        """Whether decode rows are served by the C kernel reading the block pool (not a torch gather)."""
        return self._decode_group is not None

    def __call__(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                 meta: AttentionMetadata) -> torch.Tensor:
        if q.shape[0] != k.shape[0] or k.shape != v.shape:
            raise ValueError(f"q {tuple(q.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)}: need one row per token")
        k_cache, v_cache = self.storage.layer(layer)
        if meta.slot_mapping is not None:
            if self._store is None:
                self.storage.store(layer, k, v, meta.slot_mapping)
            else:
                self._store(k, v, k_cache, v_cache, meta.slot_mapping)
        if self._kernels is not None and meta.block_tables is not None:
            return self._kernels.paged_attention(q, k_cache, v_cache, meta.block_tables, meta.cu_seqlens_q,
                                                 meta.cu_seqlens_k, meta.max_seqlen_q)
        plan, read_blocks = self._plan_for(meta, reference.gqa_group_size(q.shape[1], k.shape[1]))
        if read_blocks is not None:
            k_cache, v_cache = self.storage.dequantized(layer, read_blocks)
        return plan.run(q, k, v, k_cache, v_cache)

    def _plan_for(self, meta: AttentionMetadata,
                  group: int) -> tuple[reference.PagedAttentionPlan, torch.Tensor | None]:
        """The step's plan: made by its first layer, reused by the others (the metadata is immutable).
        A quantized pool's plan gathers from the step's dequantized blocks, renumbered 0..n-1."""
        if self._plan is None or self._plan[0] is not meta:
            tables, read_blocks = meta.block_tables, None
            if self.storage.quantized and tables is not None:
                read_blocks, tables = compact_block_tables(tables)
            plan = reference.PagedAttentionPlan(meta.cu_seqlens_q, meta.cu_seqlens_k, tables, self.storage.block_size,
                                                group, always_read_cache=self.storage.quantized,
                                                decode_group=self._decode_group,
                                                every_row_as_decode=self._every_row_as_decode)
            self._plan = meta, plan, read_blocks
        return self._plan[1], self._plan[2]


def compact_block_tables(block_tables: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(the distinct block ids the tables use, the tables renumbered to index them; -1 stays -1)."""
    used = block_tables >= 0
    block_ids, renumbered = torch.unique(block_tables[used], return_inverse=True)
    tables = torch.full_like(block_tables, -1)
    tables[used] = renumbered.to(tables.dtype)
    return block_ids.to(torch.int64), tables
