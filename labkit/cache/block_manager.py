"""The BlockManager: which physical KV-cache blocks each sequence owns, with prefix caching.

A pool of `num_blocks` fixed-size blocks, each holding the K/V of `block_size` consecutive tokens.
A sequence's `block_table` lists its blocks in order (see `sequence_blocks.py` for the four
attributes read and written here). Blocks are shared between sequences with the same prefix:

- every full block whose K/V has been computed gets a *chained* hash, hash(previous block's hash,
  this block's tokens), so equal hashes mean equal whole prefixes, not just equal blocks;
- `hash_to_block` maps such hashes to block ids; a lookup is a hit only if the block's stored
  tokens equal the ones asked for (the token check), and hits stop at the first miss;
- a freed block keeps its hash and K/V and waits in an LRU list; it is revived by a later hit, or
  evicted (its hash entry removed, so no stale entry survives) when a fresh block is needed and no
  never-cached block is free;
- a prompt never hits on its own last token: the model must compute at least one token to produce
  logits, so the block holding the last prompt token is always computed, never shared.

Blocks are also shared on purpose, by `fork`: the n samples of one prompt (`SamplingParams.n`) and
the beams of a beam search start as copies of one sequence, and a fork copies only the block
table (every block's ref_count += 1), not the K/V. Full blocks stay shared for good: nobody writes
into them again. The last block is usually partial, and each child's next token goes into it, so
`append` applies *copy-on-write*: a sequence about to write into a block that others also hold
gets a fresh block, the K/V already there is copied into it (by `append` itself when given the
storage, as the scheduler does, before the table changes; else `append` returns the (source,
destination) pairs for the caller to copy before the forward step), and the shared block loses
one reference.

Errors: `KVCacheExhausted` when the pool cannot satisfy a request, `ValueError` for calls made in
the wrong order (allocate twice, append before allocate, free twice, ...). Nothing is asserted.
"""

import hashlib
from array import array
from collections import OrderedDict, deque
from dataclasses import dataclass
from typing import Protocol

from labkit.cache.sequence_blocks import SequenceBlocks


class KVCacheExhausted(RuntimeError):
    """The block pool has too few free blocks for the request."""


def hash_block(prev_hash: int | None, token_ids) -> int:
    """Chained hash of one full block: covers the block's tokens and (through prev_hash) its prefix.

    128-bit BLAKE2b, so two different prefixes colliding is not a practical concern; the token
    check on a hit guards the block's own tokens in any case.
    """
    h = hashlib.blake2b(digest_size=16)
    if prev_hash is not None:
        h.update(prev_hash.to_bytes(16, "little"))
    h.update(array("q", token_ids).tobytes())
    return int.from_bytes(h.digest(), "little")


@dataclass(eq=False)
class Block:
    block_id: int
    ref_count: int = 0
    hash: int | None = None  # set once the block is full and its K/V computed
    token_ids: tuple[int, ...] | None = None  # the tokens behind `hash`, for the token check


@dataclass
class PrefixCacheStats:
    queried_tokens: int = 0  # prompt tokens looked up by allocate
    hit_tokens: int = 0  # of those, tokens whose K/V was found in the cache
    evictions: int = 0  # cached blocks reused for new content


def find_prefix_hits(token_ids: list[int], block_size: int, hash_to_block: dict[int, int],
                     blocks: list[Block]) -> list[Block]:
    """The cached blocks a prompt can reuse: full blocks from the start, stopping at the first miss.

    Only blocks that lie wholly before the last token count, so at least one token is left
    to compute (the logits of the last prompt token are what the step is for).
    """
    hits: list[Block] = []
    prev = None
    for i in range((len(token_ids) - 1) // block_size):
        tokens = tuple(token_ids[i * block_size : (i + 1) * block_size])
        h = hash_block(prev, tokens)
        block_id = hash_to_block.get(h)
        if block_id is None or blocks[block_id].token_ids != tokens:
            break
        hits.append(blocks[block_id])
        prev = h
    return hits


def pop_free_block(free_uncached: deque[int], free_cached: OrderedDict[int, None], hash_to_block: dict[int, int],
                   blocks: list[Block]) -> int:
    """Take a free block for new content and give it ref_count 1: a never-cached one if there is one,
    else the least recently freed cached one, evicted (its hash entry removed, so no stale entry
    points at reused content)."""
    if free_uncached:
        block_id = free_uncached.popleft()
    else:
        block_id, _ = free_cached.popitem(last=False)
        block = blocks[block_id]
        del hash_to_block[block.hash]
        block.hash = block.token_ids = None
    blocks[block_id].ref_count = 1
    return block_id


class BlockStorage(Protocol):
    """Where swap_out / swap_in copy a sequence's K/V, and copy-on-write copies blocks (PagedKVStorage)."""

    def read_blocks(self, block_ids: list[int]) -> object: ...

    def write_blocks(self, block_ids: list[int], data: object) -> None: ...

    def copy_blocks(self, pairs: list[tuple[int, int]]) -> None: ...


@dataclass
class _SwappedKV:
    data: object  # a CPU copy of the sequence's blocks, as read_blocks returned it (opaque here)
    num_blocks: int


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int, *, enable_prefix_caching: bool = True):
        if not isinstance(num_blocks, int) or num_blocks < 1:
            raise ValueError(f"num_blocks must be a positive int, got {num_blocks!r}")
        if not isinstance(block_size, int) or block_size < 1:
            raise ValueError(f"block_size must be a positive int, got {block_size!r}")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.blocks = [Block(i) for i in range(num_blocks)]
        self.hash_to_block: dict[int, int] = {}
        self.free_uncached: deque[int] = deque(range(num_blocks))  # hold nothing reusable
        self.free_cached: OrderedDict[int, None] = OrderedDict()  # hold a cached prefix; LRU first
        self._swapped: dict[object, _SwappedKV] = {}
        self.stats = PrefixCacheStats()

    # ---- queries -------------------------------------------------------------------------
    @property
    def num_free_blocks(self) -> int:
        return len(self.free_uncached) + len(self.free_cached)

    @property
    def num_cached_free_blocks(self) -> int:
        """Free blocks that still hold a cached prefix (evicted last, least recently freed first)."""
        return len(self.free_cached)

    @property
    def num_used_blocks(self) -> int:
        return self.num_blocks - self.num_free_blocks

    def blocks_needed(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def is_swapped(self, seq: SequenceBlocks) -> bool:
        return seq.seq_id in self._swapped

    def prefix_hits(self, token_ids: list[int]) -> list[Block]:
        """The cached blocks a prompt can reuse (`find_prefix_hits` over this pool)."""
        if not self.enable_prefix_caching:
            return []
        return find_prefix_hits(token_ids, self.block_size, self.hash_to_block, self.blocks)

    def blocks_to_take(self, token_ids: list[int], hits: list[Block]) -> int:
        """Free blocks that allocating these tokens consumes (hits on free cached blocks included)."""
        return self.blocks_needed(len(token_ids)) - sum(b.ref_count > 0 for b in hits)

    # ---- prefill -------------------------------------------------------------------------
    def can_allocate(self, seq: SequenceBlocks, use_prefix_cache: bool = True) -> bool:
        hits = self.prefix_hits(seq.token_ids) if use_prefix_cache else []
        return self.blocks_to_take(seq.token_ids, hits) <= self.num_free_blocks

    def allocate(self, seq: SequenceBlocks, use_prefix_cache: bool = True) -> None:
        """Give a waiting sequence blocks for all its tokens, reusing cached prefix blocks.

        Sets `seq.block_table` and `seq.num_cached_tokens` (the prefix hit, a multiple of block_size).
        `use_prefix_cache=False` computes every token (a request that wants each prompt position's logprobs).
        """
        if seq.block_table:
            raise ValueError(f"sequence {seq.seq_id!r} already holds blocks; deallocate it first")
        if seq.seq_id in self._swapped:
            raise ValueError(f"sequence {seq.seq_id!r} is swapped out; use swap_in, not allocate")
        if not seq.token_ids:
            raise ValueError(f"sequence {seq.seq_id!r} has no tokens to allocate blocks for")
        hits = self.prefix_hits(seq.token_ids) if use_prefix_cache else []
        need = self.blocks_to_take(seq.token_ids, hits)
        if need > self.num_free_blocks:
            raise KVCacheExhausted(
                f"sequence {seq.seq_id!r} ({len(seq.token_ids)} tokens) needs {need} free blocks, "
                f"{self.num_free_blocks} of {self.num_blocks} are free"
            )
        table = []
        for block in hits:
            if block.ref_count == 0:
                del self.free_cached[block.block_id]  # revive a freed block that kept its prefix
            block.ref_count += 1
            table.append(block.block_id)
        for _ in range(self.blocks_needed(len(seq.token_ids)) - len(hits)):
            table.append(self.take_free_block())
        seq.block_table = table
        seq.num_cached_tokens = len(hits) * self.block_size
        self.stats.queried_tokens += len(seq.token_ids)
        self.stats.hit_tokens += seq.num_cached_tokens

    # ---- decode ----------------------------------------------------------------------------
    def missing_blocks(self, seq: SequenceBlocks) -> int:
        """Blocks `seq` still needs for the tokens it holds; an error if it holds none or lost tokens."""
        if not seq.block_table:
            raise ValueError(f"sequence {seq.seq_id!r} holds no blocks; allocate (or swap_in) it first")
        missing = self.blocks_needed(len(seq.token_ids)) - len(seq.block_table)
        if missing < 0:
            raise ValueError(
                f"sequence {seq.seq_id!r} has {len(seq.token_ids)} tokens but {len(seq.block_table)} "
                "blocks: tokens were removed after allocation"
            )
        return missing

    def shared_write_indexes(self, seq: SequenceBlocks) -> list[int]:
        """Indexes in seq.block_table of the shared blocks the next step writes K/V into (copy-on-write):
        the blocks from its first uncomputed token's to its last token's that another sequence holds.
        At most one in a normal step, the partial block a fork shares; more only when a step recomputes
        several tokens of forked samples (after an interrupted step), whose different tokens would
        otherwise overwrite each other's K/V in a block they still share."""
        bs, table = self.block_size, seq.block_table
        last = min((len(seq.token_ids) - 1) // bs, len(table) - 1)
        return [i for i in range(seq.num_cached_tokens // bs, last + 1) if self.blocks[table[i]].ref_count > 1]

    def shared_write_index(self, seq: SequenceBlocks) -> int | None:
        """The first of `shared_write_indexes`, if any: the shared block `seq`'s next token is written into."""
        shared = self.shared_write_indexes(seq)
        return shared[0] if shared else None

    def shared_write_block(self, seq: SequenceBlocks) -> int | None:
        """The id of the shared block `seq`'s next token is written into, if any: `append` will copy it."""
        index = self.shared_write_index(seq)
        return None if index is None else seq.block_table[index]

    def can_append(self, seq: SequenceBlocks) -> bool:
        """Whether the free blocks cover what `append` will take for `seq`'s tokens: the blocks its
        new tokens start, plus a copy-on-write copy of each shared block its step writes into."""
        return self.missing_blocks(seq) + len(self.shared_write_indexes(seq)) <= self.num_free_blocks

    def append(self, seq: SequenceBlocks, storage: BlockStorage | None = None) -> list[tuple[int, int]]:
        """After tokens were appended to `seq`: add blocks for them and cache newly computed full blocks.

        Returns the copy-on-write copies to make before the step writes K/V, as (source block,
        destination block) pairs: one per shared block the step writes into (`shared_write_indexes`;
        normally at most one, the partial block a fork shares). Given `storage`, the copies are made
        here, before the block table changes, so an interrupted copy leaves the sequence as it was;
        without it the caller copies the pairs.
        """
        missing = self.missing_blocks(seq)
        shared = self.shared_write_indexes(seq)
        if missing + len(shared) > self.num_free_blocks:
            raise KVCacheExhausted(
                f"sequence {seq.seq_id!r} needs {missing + len(shared)} more block(s), "
                f"{self.num_free_blocks} are free"
            )
        self.cache_computed_blocks(seq)
        copies = []
        if shared:
            destinations = [self.take_free_block() for _ in shared]
            copies = [(seq.block_table[i], destination) for i, destination in zip(shared, destinations, strict=True)]
            if storage is not None:
                try:
                    storage.copy_blocks(copies)
                except BaseException:
                    self._untake(destinations)
                    raise
            for i, (source, destination) in zip(shared, copies, strict=True):
                self.blocks[source].ref_count -= 1  # still > 0: the other owners keep it
                seq.block_table[i] = destination
        seq.block_table.extend(self.take_free_block() for _ in range(missing))
        return copies

    def fork(self, parent: SequenceBlocks, child: SequenceBlocks) -> None:
        """Let `child` share every block of `parent` (ref_count += 1 each); no K/V is copied.

        The child must start with every token of the parent: the blocks it shares hold (or are about
        to hold, for a parent forked in the step that computes its prompt) the K/V of those tokens. It
        starts with the parent's block table and cached-token count. Later writes into a shared block go
        through copy-on-write in `append` (`shared_write_indexes`): normally the partial block the next
        token lands in.
        """
        if not parent.block_table:
            raise ValueError(f"sequence {parent.seq_id!r} holds no blocks to fork")
        if child.block_table or child.seq_id in self._swapped:
            raise ValueError(f"sequence {child.seq_id!r} already holds blocks; a fork target must hold none")
        if child.seq_id == parent.seq_id:
            raise ValueError(f"a sequence cannot fork into itself (seq_id {parent.seq_id!r})")
        if list(child.token_ids[:len(parent.token_ids)]) != list(parent.token_ids):
            raise ValueError(f"sequence {child.seq_id!r} does not start with the tokens of {parent.seq_id!r}")
        for block_id in parent.block_table:
            self.blocks[block_id].ref_count += 1
        child.block_table = list(parent.block_table)
        child.num_cached_tokens = parent.num_cached_tokens

    def cache_computed_blocks(self, seq: SequenceBlocks) -> None:
        """Give every full block whose K/V is computed (below seq.num_cached_tokens) its chained hash.

        Called by append, deallocate and swap_out; the engine may call it after any step. The
        blocks of a sequence that carry a hash always form a prefix of its table, so the work
        starts after the last one that has it.
        """
        if not self.enable_prefix_caching:
            return
        bs, table = self.block_size, seq.block_table
        num_full = min(seq.num_cached_tokens, len(seq.token_ids)) // bs
        num_full = min(num_full, len(table))
        start = num_full
        while start > 0 and self.blocks[table[start - 1]].hash is None:
            start -= 1
        prev = self.blocks[table[start - 1]].hash if start > 0 else None
        for i in range(start, num_full):
            block = self.blocks[table[i]]
            tokens = tuple(seq.token_ids[i * bs : (i + 1) * bs])
            block.hash, block.token_ids = hash_block(prev, tokens), tokens
            self.hash_to_block.setdefault(block.hash, block.block_id)  # an equal block may already be cached
            prev = block.hash

    # ---- release ---------------------------------------------------------------------------
    def truncate(self, seq: SequenceBlocks, num_tokens: int) -> None:
        """Free the tail blocks `seq` needs no more once it holds `num_tokens` tokens: speculative
        decoding's rollback of rejected draft tokens. Computed tokens cannot be cut."""
        if num_tokens < seq.num_cached_tokens:
            raise ValueError(f"cannot truncate sequence {seq.seq_id!r} to {num_tokens} tokens: "
                             f"{seq.num_cached_tokens} are computed already")
        keep = self.blocks_needed(num_tokens)
        for block_id in reversed(seq.block_table[keep:]):
            block = self.blocks[block_id]
            block.ref_count -= 1
            if block.ref_count == 0:  # never computed: no hash to keep
                block.hash = block.token_ids = None
                self.free_uncached.append(block_id)
        del seq.block_table[keep:]

    def deallocate(self, seq: SequenceBlocks) -> None:
        """Free everything a sequence holds (finish, abort, preemption by recomputation).

        Shared blocks only lose one reference. Computed full blocks stay cached after the free,
        so a preempted or repeated prompt hits them later. Also drops a swapped-out CPU copy.
        """
        swapped = self._swapped.pop(seq.seq_id, None)
        if not seq.block_table and swapped is None:
            raise ValueError(f"sequence {seq.seq_id!r} holds no blocks (never allocated, or freed already)")
        self.release_table(seq)
        seq.num_cached_tokens = 0

    def release_table(self, seq: SequenceBlocks) -> None:
        """Drop `seq`'s reference to each block it holds; a block no one holds is freed, into
        `free_cached` if its hash entry still reaches it, else cleared into `free_uncached`."""
        self.cache_computed_blocks(seq)
        for block_id in reversed(seq.block_table):  # the tail first, so LRU evicts tails before heads
            block = self.blocks[block_id]
            block.ref_count -= 1
            if block.ref_count > 0:
                continue
            if block.hash is not None and self.hash_to_block.get(block.hash) == block_id:
                self.free_cached[block_id] = None
            else:  # partial, not yet computed, or a duplicate of a block cached elsewhere
                block.hash = block.token_ids = None
                self.free_uncached.append(block_id)
        seq.block_table = []

    def take_free_block(self) -> int:
        """A free block for new content, owned by the caller (ref_count 1): the eviction policy,
        `pop_free_block`, over this pool. Subclasses may choose otherwise (the course's engine parts do)."""
        evicting = not self.free_uncached
        block_id = pop_free_block(self.free_uncached, self.free_cached, self.hash_to_block, self.blocks)
        self.stats.evictions += evicting
        return block_id

    def _untake(self, block_ids: list[int]) -> None:
        """Put blocks just taken, and written into no table, back at the front of the free pool."""
        for block_id in reversed(block_ids):
            self.blocks[block_id].ref_count = 0
            self.free_uncached.appendleft(block_id)

    # ---- swapping (the sequence design note's Swapped state) -----------------------------------
    def swap_out(self, seq: SequenceBlocks, storage: BlockStorage) -> None:
        """Copy a running sequence's K/V to CPU memory and free its blocks; num_cached_tokens is kept."""
        if not seq.block_table:
            raise ValueError(f"sequence {seq.seq_id!r} holds no blocks to swap out")
        if seq.seq_id in self._swapped:
            raise ValueError(f"sequence {seq.seq_id!r} is already swapped out")
        data = storage.read_blocks(seq.block_table)
        self._swapped[seq.seq_id] = _SwappedKV(data, len(seq.block_table))
        self.release_table(seq)

    def can_swap_in(self, seq: SequenceBlocks) -> bool:
        swapped = self._swapped.get(seq.seq_id)
        if swapped is None:
            raise ValueError(f"sequence {seq.seq_id!r} is not swapped out")
        return swapped.num_blocks <= self.num_free_blocks

    def swap_in(self, seq: SequenceBlocks, storage: BlockStorage) -> None:
        """Bring a swapped-out sequence back into fresh blocks, copying its K/V from CPU memory."""
        if seq.block_table:
            raise ValueError(f"sequence {seq.seq_id!r} already holds blocks")
        if not self.can_swap_in(seq):
            raise KVCacheExhausted(
                f"sequence {seq.seq_id!r} needs {self._swapped[seq.seq_id].num_blocks} free blocks to "
                f"swap in, {self.num_free_blocks} are free"
            )
        swapped = self._swapped[seq.seq_id]
        table: list[int] = []
        try:  # all or nothing: a failed copy (or a subclass's failing take_free_block) keeps the CPU copy
            table.extend(self.take_free_block() for _ in range(swapped.num_blocks))
            storage.write_blocks(table, swapped.data)
        except BaseException:
            self._untake(table)
            raise
        del self._swapped[seq.seq_id]
        seq.block_table = table

    # ---- consistency -------------------------------------------------------------------------
    def check_invariants(self, sequences=None) -> None:
        """Raise RuntimeError naming the first broken invariant; with `sequences` (every live one),
        also check that each block's reference count equals the number of tables listing it."""
        free_uncached, free_cached = set(self.free_uncached), set(self.free_cached)
        problems = []
        if len(free_uncached) != len(self.free_uncached):
            problems.append("a block is listed twice in the free pool")
        if free_uncached & free_cached:
            problems.append(f"blocks {sorted(free_uncached & free_cached)} are in both free lists")
        for block in self.blocks:
            free = block.block_id in free_uncached or block.block_id in free_cached
            if block.ref_count < 0:
                problems.append(f"block {block.block_id} has ref_count {block.ref_count}")
            if free != (block.ref_count == 0):
                problems.append(f"block {block.block_id}: ref_count {block.ref_count} but free={free}")
            if block.block_id in free_uncached and block.hash is not None:
                problems.append(f"free uncached block {block.block_id} still has a hash")
            if block.block_id in free_cached and self.hash_to_block.get(block.hash) != block.block_id:
                problems.append(f"free cached block {block.block_id} is not reachable from its hash")
        for h, block_id in self.hash_to_block.items():
            block = self.blocks[block_id]
            if block.hash != h or block.token_ids is None:
                problems.append(f"hash entry points at block {block_id}, which holds other content")
        if sequences is not None:
            counts = [0] * self.num_blocks
            for seq in sequences:
                if len(set(seq.block_table)) != len(seq.block_table):
                    problems.append(f"sequence {seq.seq_id!r} lists a block twice")
                for block_id in seq.block_table:
                    counts[block_id] += 1
            for block in self.blocks:
                if counts[block.block_id] != block.ref_count:
                    problems.append(
                        f"block {block.block_id}: ref_count {block.ref_count}, "
                        f"referenced by {counts[block.block_id]} tables"
                    )
        if problems:
            raise RuntimeError("BlockManager invariant broken: " + "; ".join(problems[:5]))
