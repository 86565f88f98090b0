"""Lab 09: prefix caching's hash chain, the prefix lookup, LRU eviction, allocating and releasing a table."""

from catalogue import Right, Wrong
from labkit.cache.block_manager import BlockManager, KVCacheExhausted, find_prefix_hits, hash_block, pop_free_block
from labkit.cache.sequence_blocks import BlockSequence
from labkit_course.grading.labs.lab09 import _reference_chain


def chain(tokens, bs, chained=True, partial=False, start=None, whole_prefix=False, to_first=False):
    out, prev = [], start
    n = -(-len(tokens) // bs) if partial else len(tokens) // bs
    for i in range(n):
        if whole_prefix:
            h = hash_block(None, tokens[: (i + 1) * bs])
        else:
            h = hash_block(prev if chained else start, tokens[i * bs:(i + 1) * bs])
        out.append(h)
        prev = out[0] if to_first else h
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
         ref=True, lifo=False, ref_on_evict_only=False):
    if uncached and prefer_uncached:
        bid = uncached.pop() if lifo else uncached.popleft()
        if ref_on_evict_only:
            return bid
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


def allocate(token_ids, block_size, hash_to_block, blocks, free_uncached, free_cached, revive_first=True,
             unlink=True, share=True, cost="fresh+revived", check_early=True, answer="tokens", floor_plus_one=False,
             count_uncached_only=False):
    hits = lookup(token_ids, block_size, hash_to_block, blocks)
    needed = len(token_ids) // block_size + 1 if floor_plus_one else -(-len(token_ids) // block_size)
    free = len(free_uncached) + (0 if count_uncached_only else len(free_cached))
    consumed = {"fresh+revived": needed - sum(blocks[b].ref_count > 0 for b in hits),
                "all": needed, "fresh": needed - len(hits)}[cost]
    if check_early and consumed > free:
        raise KVCacheExhausted(f"{needed} blocks needed, {free} free")

    def revive():
        for block_id in hits:
            if blocks[block_id].ref_count == 0 and unlink:
                del free_cached[block_id]
            blocks[block_id].ref_count = blocks[block_id].ref_count + 1 if share else 1

    if revive_first:
        revive()
    if not check_early and needed - len(hits) > len(free_uncached) + len(free_cached):
        raise KVCacheExhausted("too late")
    fresh = [take(free_uncached, free_cached, hash_to_block, blocks) for _ in range(needed - len(hits))]
    if not revive_first:
        revive()
    return hits + fresh, len(hits) * (block_size if answer == "tokens" else 1)


def allocate_all_or_nothing(token_ids, block_size, hash_to_block, blocks, free_uncached, free_cached):
    """Plans first (which hits revive a free block, how many fresh blocks), then commits."""
    hits = lookup_while(token_ids, block_size, hash_to_block, blocks)
    revived = [b for b in hits if blocks[b].ref_count == 0]
    fresh_count = -(-len(token_ids) // block_size) - len(hits)
    if len(revived) + fresh_count > len(free_uncached) + len(free_cached):
        raise KVCacheExhausted(f"needs {len(revived) + fresh_count} free blocks")
    for block_id in revived:
        free_cached.pop(block_id)
    for block_id in hits:
        blocks[block_id].ref_count += 1
    table = list(hits)
    while len(table) * block_size < len(token_ids):
        table.append(take_explicit(free_uncached, free_cached, hash_to_block, blocks))
    return table, len(hits) * block_size


def labkit_allocate(token_ids, block_size, hash_to_block, blocks, free_uncached, free_cached):
    manager = BlockManager(len(blocks), block_size)
    manager.blocks, manager.hash_to_block = blocks, hash_to_block
    manager.free_uncached, manager.free_cached = free_uncached, free_cached
    seq = BlockSequence("s", list(token_ids))
    manager.allocate(seq)
    return seq.block_table, seq.num_cached_tokens


def release(block_table, hash_to_block, blocks, free_uncached, free_cached, *, reverse=True, shared_aware=True,
            keep_cache=True, cache_partial=False, check_entry=True, clear=True, clear_tokens=True):
    for block_id in (reversed(block_table) if reverse else block_table):
        block = blocks[block_id]
        block.ref_count = block.ref_count - 1 if shared_aware else 0
        if block.ref_count > 0:
            continue
        cacheable = block.hash is not None and (not check_entry or hash_to_block.get(block.hash) == block_id)
        if keep_cache and (cacheable or cache_partial):
            free_cached[block_id] = None
        else:
            if clear:
                block.hash = None
                block.token_ids = None if clear_tokens else block.token_ids
            free_uncached.append(block_id)


def release_by_index(block_table, hash_to_block, blocks, free_uncached, free_cached):
    for i in range(len(block_table) - 1, -1, -1):
        block = blocks[block_table[i]]
        block.ref_count -= 1
        if block.ref_count == 0:
            reachable = block.hash in hash_to_block and hash_to_block[block.hash] == block.block_id
            if reachable:
                free_cached[block.block_id] = None
            else:
                block.hash, block.token_ids = None, None
                free_uncached.append(block.block_id)


def labkit_release(block_table, hash_to_block, blocks, free_uncached, free_cached):
    manager = BlockManager(len(blocks), 2)
    manager.blocks, manager.hash_to_block = blocks, hash_to_block
    manager.free_uncached, manager.free_cached = free_uncached, free_cached
    seq = BlockSequence("s", [], list(block_table))
    manager.deallocate(seq)


def append(block_table, num_tokens, num_computed, block_size, hash_to_block, blocks, free_uncached, free_cached,
           cow=True, only_shared=True, direction="forward", every_shared=False, unref=True, add_missing=True,
           count_copy=True, check_early=True, copy_last=False, floor_plus_one=False):
    index = len(block_table) - 1 if copy_last else num_computed // block_size
    shared = index < len(block_table) and (blocks[block_table[index]].ref_count > 1 or not only_shared)
    needed = num_tokens // block_size + 1 if floor_plus_one else -(-num_tokens // block_size)
    missing = needed - len(block_table)
    free = len(free_uncached) + len(free_cached)
    if check_early and missing + (shared and count_copy) > free:
        raise KVCacheExhausted(f"{missing + shared} blocks needed, {free} free")
    copies = []
    targets = [i for i in range(index + 1) if blocks[block_table[i]].ref_count > 1] if every_shared else [index]
    for i in (targets if cow and shared else []):
        source, destination = block_table[i], take(free_uncached, free_cached, hash_to_block, blocks)
        if unref:
            blocks[source].ref_count -= 1
        block_table[i] = destination
        copies.append((source, destination) if direction == "forward" else (destination, source))
    if not check_early and missing > len(free_uncached) + len(free_cached):
        raise KVCacheExhausted("too late")
    if add_missing:
        block_table.extend(take(free_uncached, free_cached, hash_to_block, blocks) for _ in range(missing))
    return copies


def append_last_when_partial(block_table, num_tokens, num_computed, block_size, hash_to_block, blocks,
                             free_uncached, free_cached):
    """Copies the table's last block when the write starts mid-block: right whenever every held token is computed."""
    cow = num_computed % block_size != 0 and blocks[block_table[-1]].ref_count > 1
    missing = max(0, -(-num_tokens // block_size) - len(block_table))
    if cow + missing > len(free_uncached) + len(free_cached):
        raise KVCacheExhausted("not enough free blocks")
    copies = []
    if cow:
        source, block_table[-1] = block_table[-1], take(free_uncached, free_cached, hash_to_block, blocks)
        blocks[source].ref_count -= 1
        copies.append((source, block_table[-1]))
    block_table.extend(take(free_uncached, free_cached, hash_to_block, blocks) for _ in range(missing))
    return copies


def append_planned(block_table, num_tokens, num_computed, block_size, hash_to_block, blocks, free_uncached,
                   free_cached):
    """Works out the whole plan (which block to copy, how many to add) before touching the pool."""
    write = num_computed // block_size
    copy_needed = write < len(block_table) and blocks[block_table[write]].ref_count >= 2
    new_blocks = max(0, -(-num_tokens // block_size) - len(block_table))
    if new_blocks + int(copy_needed) > len(free_uncached) + len(free_cached):
        raise KVCacheExhausted("the pool cannot take the copy and the new blocks")
    copies = []
    if copy_needed:
        fresh = take_explicit(free_uncached, free_cached, hash_to_block, blocks)
        blocks[block_table[write]].ref_count -= 1
        copies.append((block_table[write], fresh))
        block_table[write] = fresh
    for _ in range(new_blocks):
        block_table.append(take_explicit(free_uncached, free_cached, hash_to_block, blocks))
    return copies


def labkit_append(block_table, num_tokens, num_computed, block_size, hash_to_block, blocks, free_uncached,
                  free_cached):
    manager = BlockManager(len(blocks), block_size)
    manager.blocks, manager.hash_to_block = blocks, hash_to_block
    manager.free_uncached, manager.free_cached = free_uncached, free_cached
    seq = BlockSequence("s", list(range(num_tokens)), block_table, num_computed)
    return manager.append(seq)


RIGHT = [
    Right("chain_hashes", "index loop carrying the previous hash", chain),
    Right("chain_hashes", "slices of the full part, chained through the list", chain_by_slices),
    Right("cached_prefix_blocks", "for loop over (len - 1) // block_size blocks", lookup),
    Right("cached_prefix_blocks", "while loop with an early return", lookup_while),
    Right("take_free_block", "popitem(last=False)", take),
    Right("take_free_block", "explicit branches on the Block object", take_explicit),
    Right("allocate_blocks", "lookup, count, revive, take", allocate),
    Right("allocate_blocks", "plan the revived and fresh blocks, then commit", allocate_all_or_nothing),
    Right("release_blocks", "reversed() with flags", release),
    Right("release_blocks", "index loop from the tail", release_by_index),
    Right("append_blocks", "flags over one copy and the missing blocks", append),
    Right("append_blocks", "plan the copy and the new blocks, then commit", append_planned),
]

WRONG = [
    Wrong("chain_hashes", "each block hashed on its own", lambda t, bs: chain(t, bs, chained=False),
          "each block is hashed on its own"),
    Wrong("chain_hashes", "hashes the partial last block", lambda t, bs: chain(t, bs, partial=True),
          "partial last block got a hash"),
    Wrong("chain_hashes", "every block chained to the first block's hash (prev = out[0])",
          lambda t, bs: chain(t, bs, to_first=True), "prev = out[0]"),
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
          "`_reference_chain`", calls="labkit_course.grading.labs.lab09._reference_chain"),
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
    Wrong("cached_prefix_blocks", "calls labkit's find_prefix_hits", lambda t, bs, table, blocks: [
        b.block_id for b in find_prefix_hits(t, bs, table, blocks)], "`find_prefix_hits`",
          calls="labkit.cache.block_manager.find_prefix_hits"),
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
    Wrong("take_free_block", "hands out a never-cached block with ref_count 0",
          lambda *a: take(*a, ref_on_evict_only=True), "handed out with ref_count 0"),
    Wrong("take_free_block", "calls BlockManager.take_free_block", lambda u, c, t, b: _labkit_take(u, c, t, b),
          "`take_free_block`",
          calls="labkit.cache.block_manager.BlockManager.take_free_block"),
    Wrong("take_free_block", "calls labkit's pop_free_block", lambda u, c, t, b: pop_free_block(u, c, t, b),
          "`pop_free_block`", calls="labkit.cache.block_manager.pop_free_block"),
    Wrong("allocate_blocks", "takes fresh blocks before reviving the hits", lambda *a: allocate(*a, revive_first=False),
          "revive the hits"),
    Wrong("allocate_blocks", "leaves a revived hit in free_cached", lambda *a: allocate(*a, unlink=False),
          "still in free_cached"),
    Wrong("allocate_blocks", "sets a hit's ref_count to 1", lambda *a: allocate(*a, share=False),
          "ref_count += 1"),
    Wrong("allocate_blocks", "counts held hits as needing free blocks", lambda *a: allocate(*a, cost="all"),
          "cost no free block"),
    Wrong("allocate_blocks", "counts revived hits as costing nothing", lambda *a: allocate(*a, cost="fresh"),
          "hits on free cached blocks still consume free blocks"),
    Wrong("allocate_blocks", "checks the pool after reviving the hits", lambda *a: allocate(*a, check_early=False),
          "the pool changed before KVCacheExhausted"),
    Wrong("allocate_blocks", "counts cached blocks, not tokens", lambda *a: allocate(*a, answer="blocks"),
          "counts tokens, not blocks"),
    Wrong("allocate_blocks", "capacity counts only free_uncached", lambda *a: allocate(*a, count_uncached_only=True),
          "counted only free_uncached"),
    Wrong("allocate_blocks", "returns only the table", lambda *a: allocate(*a)[0], "return (block_table"),
    Wrong("allocate_blocks", "counts blocks as n // block_size + 1", lambda *a: allocate(*a, floor_plus_one=True),
          "adds an empty block whenever n is a multiple"),
    Wrong("allocate_blocks", "calls BlockManager.allocate", labkit_allocate, "`allocate`",
          calls="labkit.cache.block_manager.BlockManager.allocate"),
    Wrong("release_blocks", "releases head first", lambda *a: release(*a, reverse=False),
          "release the tail first"),
    Wrong("release_blocks", "frees shared blocks outright", lambda *a: release(*a, shared_aware=False),
          "a shared block was freed"),
    Wrong("release_blocks", "drops every cached prefix", lambda *a: release(*a, keep_cache=False),
          "keep it in free_cached"),
    Wrong("release_blocks", "caches the partial block", lambda *a: release(*a, cache_partial=True),
          "the partial block"),
    Wrong("release_blocks", "caches a block its hash entry does not reach", lambda *a: release(*a, check_entry=False),
          "cannot reach is not cached"),
    Wrong("release_blocks", "keeps the old hash on an uncached block", lambda *a: release(*a, clear=False),
          "clear them"),
    Wrong("release_blocks", "clears the hash but leaves token_ids", lambda *a: release(*a, clear_tokens=False),
          "stale token_ids"),
    Wrong("release_blocks", "calls BlockManager.deallocate", labkit_release, "`deallocate`",
          calls="labkit.cache.block_manager.BlockManager.deallocate"),
    Wrong("append_blocks", "no copy-on-write", lambda *a: append(*a, cow=False), "no copy was made"),
    Wrong("append_blocks", "returns (destination, source)", lambda *a: append(*a, direction="backward"),
          "return (source, destination)"),
    Wrong("append_blocks", "copies every shared block", lambda *a: append(*a, every_shared=True),
          "full first block was copied"),
    Wrong("append_blocks", "the shared block keeps its reference", lambda *a: append(*a, unref=False),
          "kept its reference count"),
    Wrong("append_blocks", "copies a block nobody else holds", lambda *a: append(*a, only_shared=False),
          "copy only when ref_count > 1"),
    Wrong("append_blocks", "forgets the missing blocks", lambda *a: append(*a, add_missing=False),
          "add the missing blocks"),
    Wrong("append_blocks", "does not count the copy", lambda *a: append(*a, count_copy=False), "count the copy"),
    Wrong("append_blocks", "checks after copying", lambda *a: append(*a, check_early=False), "pool changed"),
    Wrong("append_blocks", "copies the table's last block", lambda *a: append(*a, copy_last=True),
          "not the table's last block"),
    Wrong("append_blocks", "copies the last block when the write starts mid-block", append_last_when_partial,
          "not the table's last block"),
    Wrong("append_blocks", "counts blocks as n // block_size + 1", lambda *a: append(*a, floor_plus_one=True),
          "adds an empty block whenever n is a multiple"),
    Wrong("append_blocks", "calls BlockManager.append", labkit_append, "`append`",
          calls="labkit.cache.block_manager.BlockManager.append"),
]


def _labkit_take(free_uncached, free_cached, hash_to_block, blocks):
    manager = BlockManager(len(blocks), 2)
    manager.blocks, manager.hash_to_block = blocks, hash_to_block
    manager.free_uncached, manager.free_cached = free_uncached, free_cached
    return manager.take_free_block()
