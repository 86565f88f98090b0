"""KV caches: the contiguous KVCache, paged KV storage and the BlockManager with prefix caching."""
