"""Lab 09: prefix caching's hash chain, the prefix lookup and LRU eviction."""

from catalogue import Right, Wrong
from labkit.cache.block_manager import BlockManager, hash_block
from labkit.grading.labs.lab09 import _reference_chain


def chain(tokens, bs, chained=True, partial=False, start=None, whole_prefix=False):
    out, prev = [], start
    n = -(-len(tokens) // bs) if partial else len(tokens) // bs
    for i in range(n):
        if whole_prefix:
            h = hash_block(None, tokens[: (i + 1) * bs])
        else:
            h = hash_block(prev if chained else start, tokens[i * bs:(i + 1) * bs])
        out.append(h)
        prev = h
    return out


def chain_by_slices(token_ids, block_size):
    full = len(token_ids) - len(token_ids) % block_size
    hashes = []
    for start in range(0, full, block_size):
        hashes.append(hash_block(hashes[-1] if hashes else None, token_ids[start:start + block_size]))
    return hashes


def lookup(tokens, bs, table, blocks, stop_at_miss=True, check_tokens=True, blocks_considered=None,
           chained=True, answer="ids"):
    hits, prev = [], None
    n = (len(tokens) - 1) // bs if blocks_considered is None else blocks_considered(len(tokens), bs)
    for i in range(n):
        chunk = tuple(tokens[i * bs:(i + 1) * bs])
        h = hash_block(prev if chained else None, chunk)
        prev = h
        bid = table.get(h)
        if bid is None or (check_tokens and blocks[bid].token_ids != chunk):
            if stop_at_miss:
                break
            continue
        hits.append({"ids": bid, "hashes": h, "blocks": blocks[bid]}[answer])
    return hits


def lookup_while(token_ids, block_size, hash_to_block, blocks):
    hits, prev, i = [], None, 0
    while (i + 1) * block_size < len(token_ids):  # a whole block strictly before the last token
        chunk = tuple(token_ids[i * block_size:(i + 1) * block_size])
        prev = hash_block(prev, chunk)
        if prev not in hash_to_block or blocks[hash_to_block[prev]].token_ids != chunk:
            return hits
        hits.append(hash_to_block[prev])
        i += 1
    return hits


def take(uncached, cached, table, blocks, prefer_uncached=True, lru=True, drop_entry=True, pop=True, clear=True,
         ref=True, lifo=False):
    if uncached and prefer_uncached:
        bid = uncached.pop() if lifo else uncached.popleft()
    else:
        bid = next(iter(cached)) if lru else next(reversed(cached))
        if pop:
            del cached[bid]
        if drop_entry:
            del table[blocks[bid].hash]
        if clear:
            blocks[bid].hash = blocks[bid].token_ids = None
    if ref:
        blocks[bid].ref_count = 1
    return bid


def take_explicit(free_uncached, free_cached, hash_to_block, blocks):
    if len(free_uncached) > 0:
        block = blocks[free_uncached.popleft()]
    else:
        oldest, _ = free_cached.popitem(last=False)
        block = blocks[oldest]
        hash_to_block.pop(block.hash)
        block.hash, block.token_ids = None, None
    block.ref_count = 1
    return block.block_id


def greedy_take(uncached, cached, table, blocks):
    bid = take(uncached, cached, table, blocks)
    cached.clear()
    return bid


def labkit_prefix_hits(token_ids, block_size, hash_to_block, blocks):
    manager = BlockManager(len(blocks), block_size)
    manager.blocks, manager.hash_to_block = blocks, hash_to_block
    return [b.block_id for b in manager.prefix_hits(token_ids)]


RIGHT = [
    Right("chain_hashes", "index loop carrying the previous hash", chain),
    Right("chain_hashes", "slices of the full part, chained through the list", chain_by_slices),
    Right("cached_prefix_blocks", "for loop over (len - 1) // block_size blocks", lookup),
    Right("cached_prefix_blocks", "while loop with an early return", lookup_while),
    Right("take_free_block", "popitem(last=False)", take),
    Right("take_free_block", "explicit branches on the Block object", take_explicit),
]

WRONG = [
    Wrong("chain_hashes", "each block hashed on its own", lambda t, bs: chain(t, bs, chained=False),
          "each block is hashed on its own"),
    Wrong("chain_hashes", "hashes the partial last block", lambda t, bs: chain(t, bs, partial=True),
          "partial last block got a hash"),
    Wrong("chain_hashes", "chain starts from 0", lambda t, bs: chain(t, bs, start=0), "pass None"),
    Wrong("chain_hashes", "hashes the whole prefix's tokens", lambda t, bs: chain(t, bs, whole_prefix=True),
          "whole prefix's tokens"),
    Wrong("chain_hashes", "python's hash of the tokens", lambda t, bs: [hash(tuple(t[: (i + 1) * bs]))
                                                                        for i in range(len(t) // bs)],
          "hashes differ from hash_block"),
    Wrong("chain_hashes", "skips the first block", lambda t, bs: chain(t, bs)[1:], "expected 2 hashes"),
    Wrong("chain_hashes", "hard-coded blocks of 4", lambda t, bs: chain(t, 4), "other lengths or block sizes"),
    Wrong("chain_hashes", "returns a tuple", lambda t, bs: tuple(chain(t, bs)), "return a list"),
    Wrong("chain_hashes", "imports the grader's reference", lambda t, bs: _reference_chain(t, bs),
          "`_reference_chain`", calls="labkit.grading.labs.lab09._reference_chain"),
    Wrong("cached_prefix_blocks", "keeps going after a miss", lambda *a: lookup(*a, stop_at_miss=False),
          "after a miss nothing may hit"),
    Wrong("cached_prefix_blocks", "trusts the hash without checking tokens", lambda *a: lookup(*a, check_tokens=False),
          "check the tokens"),
    Wrong("cached_prefix_blocks", "a fully cached prompt hits every block", lambda *a: lookup(
        *a, blocks_considered=lambda n, bs: n // bs), "leave at least its last token"),
    Wrong("cached_prefix_blocks", "stops one block early", lambda *a: lookup(
        *a, blocks_considered=lambda n, bs: n // bs - 1), "stopped one block early"),
    Wrong("cached_prefix_blocks", "looks blocks up by unchained hashes", lambda *a: lookup(*a, chained=False),
          "chained hash"),
    Wrong("cached_prefix_blocks", "returns the hashes", lambda *a: lookup(*a, answer="hashes"), "returned the hashes"),
    Wrong("cached_prefix_blocks", "returns Block objects", lambda *a: lookup(*a, answer="blocks"),
          "not Block objects"),
    Wrong("cached_prefix_blocks", "calls BlockManager.prefix_hits", labkit_prefix_hits,
          "`prefix_hits`",
          calls="labkit.cache.block_manager.BlockManager.prefix_hits"),
    Wrong("take_free_block", "evicts while never-cached blocks are free", lambda *a: take(*a, prefer_uncached=False),
          "never-cached block was free"),
    Wrong("take_free_block", "evicts the most recently freed", lambda *a: take(*a, lru=False), "most recently freed"),
    Wrong("take_free_block", "leaves a stale hash entry", lambda *a: take(*a, drop_entry=False), "stale entry"),
    Wrong("take_free_block", "leaves the block in the free list", lambda *a: take(*a, pop=False),
          "still in the free list"),
    Wrong("take_free_block", "keeps the old hash and tokens", lambda *a: take(*a, clear=False), "clear them"),
    Wrong("take_free_block", "forgets the ref_count", lambda *a: take(*a, ref=False), "ref_count should be 1"),
    Wrong("take_free_block", "takes the newest never-cached block", lambda *a: take(*a, lifo=True),
          "first never-cached free block"),
    Wrong("take_free_block", "clears the other cached blocks", greedy_take, "other cached blocks"),
    Wrong("take_free_block", "calls BlockManager._take_free_block", lambda u, c, t, b: _labkit_take(u, c, t, b),
          "`_take_free_block`",
          calls="labkit.cache.block_manager.BlockManager._take_free_block"),
]


def _labkit_take(free_uncached, free_cached, hash_to_block, blocks):
    manager = BlockManager(len(blocks), 2)
    manager.blocks, manager.hash_to_block = blocks, hash_to_block
    manager._free_uncached, manager._free_cached = free_uncached, free_cached
    return manager._take_free_block()
