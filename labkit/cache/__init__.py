"""KV-cache storage: the contiguous caches of the book (paged storage lives beside them)."""

from labkit.cache.kv_cache import KVCache, PreallocatedKVCache

__all__ = ["KVCache", "PreallocatedKVCache"]
