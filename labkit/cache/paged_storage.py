"""Paged KV storage: per layer, K and V as [num_blocks, block_size, num_kv_heads, head_dim].

This is the nano-vLLM / vLLM v1 layout (the sequence design note): one token's K (or V) for all its KV heads is a
contiguous row, and a *slot* `block_id * block_size + offset` addresses it in the flattened view
[num_blocks * block_size, num_kv_heads, head_dim]. The BlockManager decides which blocks a sequence
owns; this module only holds the tensors and turns block tables into slots.

With `kv_cache_dtype="int8"` (or "fp8") the pool holds one byte per value plus one float32 scale per
block, layer and KV head (`labkit.cache.kv_quant`): writes quantize, `dequantized` reads back.
"""

import torch

from labkit.cache import kv_quant


def check_block_size(block_size: int) -> int:
    if not isinstance(block_size, int) or block_size < 8 or block_size & (block_size - 1):
        raise ValueError(f"block_size must be a power of two >= 8, got {block_size!r}")
    return block_size


def slot_mapping(block_table: list[int], start: int, end: int, block_size: int) -> list[int]:
    """KV-cache slots of token positions start..end-1 of a sequence with this block table."""
    if not 0 <= start <= end <= len(block_table) * block_size:
        raise ValueError(
            f"positions {start}..{end} do not fit {len(block_table)} blocks of {block_size} tokens"
        )
    return [block_table[p // block_size] * block_size + p % block_size for p in range(start, end)]


def slots_for_positions(block_tables: torch.Tensor, seq_index: torch.Tensor, positions: torch.Tensor,
                        block_size: int) -> torch.Tensor:
    """Vectorized slot lookup: slot of token `positions[i]` of sequence `seq_index[i]`."""
    blocks = block_tables[seq_index, positions // block_size].to(torch.int64)
    return blocks * block_size + positions % block_size


class PagedKVStorage:
    """K and V block pools for every layer, in one tensor [2, num_layers, num_blocks, block_size, H, D]."""

    def __init__(self, num_layers: int, num_blocks: int, block_size: int, num_kv_heads: int, head_dim: int,
                 dtype: torch.dtype = torch.float32, device: torch.device | str = "cpu",
                 kv_cache_dtype: str = "auto"):
        for name, value in [("num_layers", num_layers), ("num_blocks", num_blocks),
                            ("num_kv_heads", num_kv_heads), ("head_dim", head_dim)]:
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be a positive int, got {value!r}")
        self.block_size = check_block_size(block_size)
        self.num_layers, self.num_blocks = num_layers, num_blocks
        self.num_kv_heads, self.head_dim = num_kv_heads, head_dim
        self.quant = kv_quant.resolve_kv_cache_dtype(kv_cache_dtype)
        self.compute_dtype = dtype  # what attention reads: the model's dtype
        self.kv = torch.zeros(2, num_layers, num_blocks, block_size, num_kv_heads, head_dim,
                              dtype=dtype if self.quant is None else torch.int8, device=device)
        self.scales = None if self.quant is None else torch.zeros(2, num_layers, num_blocks, num_kv_heads,
                                                                  dtype=torch.float32, device=device)

    @property
    def quantized(self) -> bool:
        return self.quant is not None

    @property
    def dtype(self) -> torch.dtype:
        """The pool's element type: the model's dtype, or int8 (the bytes) when quantized."""
        return self.kv.dtype

    @property
    def device(self) -> torch.device:
        return self.kv.device

    @staticmethod
    def bytes_per_block_per_layer(block_size: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype,
                                  kv_cache_dtype: str = "auto") -> int:
        """K and V of one block in one layer; a quantized block also carries its per-head scales."""
        if kv_quant.resolve_kv_cache_dtype(kv_cache_dtype) is None:
            return 2 * block_size * num_kv_heads * head_dim * dtype.itemsize
        return 2 * (block_size * num_kv_heads * head_dim + num_kv_heads * torch.float32.itemsize)

    @property
    def num_bytes(self) -> int:
        scale_bytes = 0 if self.scales is None else self.scales.numel() * self.scales.element_size()
        return self.kv.numel() * self.kv.element_size() + scale_bytes

    def layer(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(k_cache, v_cache) of one layer, each [num_blocks, block_size, num_kv_heads, head_dim] (views)."""
        if not 0 <= layer < self.num_layers:
            raise ValueError(f"layer must be in 0..{self.num_layers - 1}, got {layer}")
        return self.kv[0, layer], self.kv[1, layer]

    def store(self, layer: int, k: torch.Tensor, v: torch.Tensor, slot_mapping: torch.Tensor) -> None:
        """Write new tokens' K/V [T, H, D] into their slots; slot -1 means "do not store" (torch version)."""
        k_cache, v_cache = self.layer(layer)
        if self.quant is None:
            store_kv(k, v, k_cache, v_cache, slot_mapping)
            return
        _check_rows(k, v, k_cache, slot_mapping)
        keep = slot_mapping >= 0
        for i, rows in enumerate((k, v)):
            kv_quant.store_quantized(self.quant, rows[keep], self.kv[i, layer], self.scales[i, layer],
                                     slot_mapping[keep])

    def dequantized(self, layer: int, block_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """K and V of these blocks of one layer in the model's dtype, [len(block_ids), block_size, H, D]
        each: a quantized pool's read path (attention gathers from these instead of the pool)."""
        self.layer(layer)  # checks the index
        return tuple(kv_quant.dequantize(self.quant, self.kv[i, layer].index_select(0, block_ids),
                                         self.scales[i, layer].index_select(0, block_ids), self.compute_dtype)
                     for i in (0, 1))

    def read_blocks(self, block_ids: list[int]) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """A CPU copy of these blocks for all layers, K and V: [2, L, len(block_ids), block_size, H, D]
        (a quantized pool: that tensor of codes and its scales [2, L, len(block_ids), H])."""
        index = torch.tensor(block_ids, dtype=torch.int64, device=self.device)
        kv = self.kv.index_select(2, index).to("cpu", copy=True)
        return kv if self.scales is None else (kv, self.scales.index_select(2, index).to("cpu", copy=True))

    def write_blocks(self, block_ids: list[int], data: torch.Tensor | tuple[torch.Tensor, torch.Tensor]) -> None:
        """Copy `data` (as read_blocks returns it) into these blocks."""
        kv, scales = (data, None) if self.scales is None else data
        expected = (*self.kv.shape[:2], len(block_ids), *self.kv.shape[3:])
        if tuple(kv.shape) != expected:
            raise ValueError(f"data has shape {tuple(kv.shape)}, expected {expected}")
        index = torch.tensor(block_ids, dtype=torch.int64, device=self.device)
        self.kv.index_copy_(2, index, kv.to(self.device, self.dtype))
        if scales is not None:
            self.scales.index_copy_(2, index, scales.to(self.device))

    def copy_blocks(self, pairs: list[tuple[int, int]]) -> None:
        """Copy-on-write: give each destination block the K/V of its source block, in every layer."""
        if not pairs:
            return
        for source, destination in pairs:
            for block_id in (source, destination):
                if not 0 <= block_id < self.num_blocks:
                    raise ValueError(f"block id {block_id} is outside 0..{self.num_blocks - 1}")
        sources = torch.tensor([s for s, _ in pairs], dtype=torch.int64, device=self.device)
        destinations = torch.tensor([d for _, d in pairs], dtype=torch.int64, device=self.device)
        self.kv.index_copy_(2, destinations, self.kv.index_select(2, sources))
        if self.scales is not None:
            self.scales.index_copy_(2, destinations, self.scales.index_select(2, sources))


def store_kv(k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
             slot_mapping: torch.Tensor) -> None:
    """Scatter K/V rows [T, H, D] into caches [N, block_size, H, D] at `slot_mapping` [T]; -1 skips."""
    _check_rows(k, v, k_cache, slot_mapping)
    if bool((slot_mapping < 0).any()):  # the rare step with rows not to store (boolean indexing is slow)
        keep = slot_mapping >= 0
        k, v, slot_mapping = k[keep], v[keep], slot_mapping[keep]
    k_cache.view(-1, *k_cache.shape[2:]).index_copy_(0, slot_mapping, k.to(k_cache.dtype))
    v_cache.view(-1, *v_cache.shape[2:]).index_copy_(0, slot_mapping, v.to(v_cache.dtype))


def _check_rows(k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, slot_mapping: torch.Tensor) -> None:
    if k.shape != v.shape or k.shape[0] != slot_mapping.shape[0] or k.shape[1:] != k_cache.shape[2:]:
        raise ValueError(
            f"k {tuple(k.shape)}, v {tuple(v.shape)} and slot_mapping {tuple(slot_mapping.shape)} do not "
            f"match a cache with rows {tuple(k_cache.shape[2:])}"
        )
