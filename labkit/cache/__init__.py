"""KV-cache storage: the contiguous caches of the book (paged storage, in the model's dtype or
quantized to one byte per value by `kv_quant`, lives beside them)."""

from labkit.cache.kv_cache import KVCache, PreallocatedKVCache

__all__ = ["KVCache", "PreallocatedKVCache"]
