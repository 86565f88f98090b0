"""PagedAttentionBackend: the `AttentionBackend` the model calls per layer, over paged KV storage.

Per call it (1) stores the step's new K/V into the slots `meta.slot_mapping` names (-1: skip), then
(2) attends causally over each sequence's whole context through `meta.block_tables`. Two
implementations of the same contract:

- "torch": `labkit.attention.reference` (a vectorized gather plus one fused attention per layer,
  with the step's masks and indices planned once by its first layer), the default on CPU;
- "triton": `labkit.attention.triton_kernels`, the default on CUDA; on a CPU it runs only under
  the Triton interpreter (TRITON_INTERPRET=1 set before triton is first imported), which is slow
  and meant for tests and the lab.

A step with no block tables (`meta.block_tables is None`) has nothing cached: every sequence
attends over its own new tokens (`cu_seqlens_k` must equal `cu_seqlens_q`). The same shortcut
is taken by the torch backend whenever a batch has no cached prefix, which skips the gather.
"""

import importlib.util
import os

import torch

from labkit.attention import reference
from labkit.attention.metadata import AttentionMetadata
from labkit.cache.paged_storage import PagedKVStorage, store_kv

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
    if backend == "triton" and device.type != "cuda" and os.environ.get("TRITON_INTERPRET") != "1":
        raise ValueError(
            "backend='triton' on a CPU needs the Triton interpreter: set TRITON_INTERPRET=1 before "
            "triton is imported, or use backend='torch'"
        )
    return backend


class PagedAttentionBackend:
    def __init__(self, storage: PagedKVStorage, backend: str = "auto"):
        self.storage = storage
        self.backend = resolve_backend(backend, storage.device)
        if self.backend == "triton":
            from labkit.attention import triton_kernels

            self._store, self._kernels = triton_kernels.store_kvcache, triton_kernels
        else:
            self._store, self._kernels = store_kv, None
        self._plan = None  # (metadata, plan) of the step being run

    def __call__(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                 meta: AttentionMetadata) -> torch.Tensor:
        if q.shape[0] != k.shape[0] or k.shape != v.shape:
            raise ValueError(f"q {tuple(q.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)}: need one row per token")
        k_cache, v_cache = self.storage.layer(layer)
        if meta.slot_mapping is not None:
            self._store(k, v, k_cache, v_cache, meta.slot_mapping)
        if self._kernels is not None and meta.block_tables is not None:
            return self._kernels.paged_attention(q, k_cache, v_cache, meta.block_tables, meta.cu_seqlens_q,
                                                 meta.cu_seqlens_k, meta.max_seqlen_q)
        return self._plan_for(meta, reference.gqa_group_size(q.shape[1], k.shape[1])).run(q, k, v, k_cache, v_cache)

    def _plan_for(self, meta: AttentionMetadata, group: int) -> reference.PagedAttentionPlan:
        """The step's plan: made by its first layer, reused by the others (the metadata is immutable)."""
        if self._plan is None or self._plan[0] is not meta:
            self._plan = meta, reference.PagedAttentionPlan(meta.cu_seqlens_q, meta.cu_seqlens_k, meta.block_tables,
                                                            self.storage.block_size, group)
        return self._plan[1]
