"""KV-cache storage: the contiguous caches of the book, and the paged cache: its storage (in the model's
dtype or quantized to one byte per value by `kv_quant`) and the BlockManager that hands out its blocks."""

from labkit.cache.block_manager import BlockManager
from labkit.cache.kv_cache import KVCache, PreallocatedKVCache

__all__ = ["BlockManager", "KVCache", "PreallocatedKVCache"]
