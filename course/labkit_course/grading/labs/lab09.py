"""Lab 09: block manager and prefix caching — hash chains, prefix lookup, LRU eviction, allocate and free."""

import copy
from collections import OrderedDict, deque

from labkit.cache.block_manager import (
    Block,
    BlockManager,
    KVCacheExhausted,
    find_prefix_hits,
    hash_block,
    pop_free_block,
)
from labkit.cache.sequence_blocks import BlockSequence
from labkit_course.grading import ExerciseFailed, exercise, raised_type, require
from labkit_course.grading.core import seeded_random


def _reference_chain(token_ids, block_size):
    hashes, prev = [], None
    for i in range(len(token_ids) // block_size):
        prev = hash_block(prev, token_ids[i * block_size:(i + 1) * block_size])
        hashes.append(prev)
    return hashes


_MANAGER = "labkit.cache.block_manager.BlockManager"
_LOOKUP, _POP = "labkit.cache.block_manager.find_prefix_hits", "labkit.cache.block_manager.pop_free_block"
_PARTS = "labkit_course.engine_parts"  # labkit's answers with the exercises' signatures (Lab 11's capstone)


@exercise("09", "chain_hashes", forbidden=(f"{_MANAGER}.prefix_hits", _LOOKUP, f"{_MANAGER}.cache_computed_blocks",
                                           "labkit_course.grading.labs.lab09._reference_chain"))
def chain_hashes(ns):
    fn = require(ns, "chain_hashes")
    tokens = [5, 9, 2, 7, 7, 1, 3, 8, 4, 6, 0]
    got = fn(list(tokens), 4)
    expected = _reference_chain(tokens, 4)
    if not isinstance(got, list):
        raise ExerciseFailed(f"return a list of ints, one per full block, got {type(got).__name__}")
    if got and got == [hash_block(0, tokens[:4]), hash_block(hash_block(0, tokens[:4]), tokens[4:8])]:
        raise ExerciseFailed("the chain started from 0: the first block has no previous block, so pass None")
    if len(got) == len(expected) + 1:
        raise ExerciseFailed("the partial last block got a hash: only full blocks are hashed (and shared)")
    if len(got) != len(expected):
        raise ExerciseFailed(f"expected {len(expected)} hashes for 11 tokens in blocks of 4, got {len(got)}")
    independent = [hash_block(None, tokens[i * 4:(i + 1) * 4]) for i in range(2)]
    if got == independent:
        raise ExerciseFailed("each block is hashed on its own: pass the previous block's hash, so a hash "
                             "covers the whole prefix")
    if got == [hash_block(None, tokens[:4]), hash_block(None, tokens[:8])]:
        raise ExerciseFailed("each hash covers the whole prefix's tokens: pass the previous block's hash and "
                             "only this block's tokens, hash_block(prev, block)")
    if got != expected:
        raise ExerciseFailed("hashes differ from hash_block(previous hash, block tokens), starting from None")
    if fn([1, 2, 3], 4) != []:
        raise ExerciseFailed("3 tokens in blocks of 4 have no full block: the result is []")
    got, want = fn(list(range(8)), 2), _reference_chain(list(range(8)), 2)
    if not isinstance(got, list) or len(got) != len(want):
        raise ExerciseFailed(f"wrong for other lengths or block sizes: 8 tokens in blocks of 2 are 4 full blocks, "
                             f"got {got!r}")
    if got != want:
        first = hash_block(None, [0, 1])
        if got == [first] + [hash_block(first, [i, i + 1]) for i in (2, 4, 6)]:
            raise ExerciseFailed("every block after the first was chained to the FIRST block's hash (prev = "
                                 "out[0]): chain each block to the one just before it, prev = out[-1]")
        raise ExerciseFailed("right for 2 full blocks, wrong for 4 (8 tokens in blocks of 2): each hash is "
                             "hash_block(previous block's hash, this block's tokens)")
    rng = seeded_random(901)
    for _ in range(40):
        tokens, bs = [rng.randint(0, 60) for _ in range(rng.randint(0, 30))], rng.randint(1, 7)
        got, want = fn(list(tokens), bs), _reference_chain(tokens, bs)
        if got != want:
            mine = got if isinstance(got, list) else []
            same = next((i for i, (a, b) in enumerate(zip(mine, want, strict=False)) if a != b),
                        min(len(mine), len(want)))
            raise ExerciseFailed(f"wrong for chain_hashes({tokens}, {bs}): expected {len(want)} hashes, got "
                                 f"{len(mine)}, the first {same} of them right")
    return "one chained hash per full block"


def _cache(entries, block_size):
    """A hash table and block list holding the given prompts' full blocks."""
    blocks, table = [], {}
    for tokens in entries:
        prev = None
        for i in range(len(tokens) // block_size):
            chunk = tuple(tokens[i * block_size:(i + 1) * block_size])
            prev = hash_block(prev, chunk)
            if prev not in table:
                table[prev] = len(blocks)
                blocks.append(Block(len(blocks), 0, prev, chunk))
    return table, blocks


@exercise("09", "cached_prefix_blocks", forbidden=(f"{_MANAGER}.prefix_hits", _LOOKUP,
                                                   f"{_PARTS}.labkit_cached_prefix_blocks"))
def cached_prefix_blocks(ns):
    fn = require(ns, "cached_prefix_blocks")
    bs = 2
    table, blocks = _cache([[1, 2, 3, 4, 5, 6], [1, 2, 9, 9, 5, 6]], bs)
    got = fn([1, 2, 3, 4, 8, 8, 1], bs, table, blocks)
    if not isinstance(got, list):
        raise ExerciseFailed(f"return the list of hit block ids, got {type(got).__name__}")
    if any(isinstance(b, Block) for b in got):
        raise ExerciseFailed("return block ids (ints), not Block objects: blocks[i].block_id, or the id the "
                             "hash table maps to")
    if got == [h for h, b in table.items() if b in (0, 1)]:
        raise ExerciseFailed("returned the hashes: return the block ids they map to (hash_to_block[h])")
    if got == [0]:
        raise ExerciseFailed("only the first block hit: look up each block by its chained hash, "
                             "hash_block(previous block's hash, its tokens), as the cache stored it")
    if got != [0, 1]:
        raise ExerciseFailed(f"prompt [1,2,3,4,8,8,1] should hit blocks [0, 1] of the cache, got {got}")
    evicted = {h: b for h, b in table.items() if b != 1}  # block [3, 4] was evicted, [5, 6] after it was not
    got = fn([1, 2, 3, 4, 5, 6, 1], bs, evicted, blocks)
    if got != [0]:
        raise ExerciseFailed(f"after a miss nothing may hit (a later block's K/V needs the missed one); got {got}")
    got = fn([1, 2, 3, 4, 5, 6], bs, table, blocks)
    if got == [0, 1, 2]:
        raise ExerciseFailed("a fully cached prompt hit every block: leave at least its last token to compute "
                             "(the model needs it to produce logits)")
    if got != [0, 1]:
        raise ExerciseFailed(f"prompt [1..6] in blocks of 2 should hit [0, 1], got {got}")
    got = fn([1, 2, 3, 4, 5, 6, 9], bs, table, blocks)
    if got == [0, 1]:
        raise ExerciseFailed("stopped one block early: [1..6, 9] can reuse all three full blocks, because token 9 "
                             "is left to compute; only full blocks before the last token count, "
                             "(len(token_ids) - 1) // block_size of them")
    if got != [0, 1, 2]:
        raise ExerciseFailed(f"prompt [1..6, 9] in blocks of 2 should hit [0, 1, 2], got {got}")
    stale = blocks[1]
    blocks[1] = Block(1, 0, stale.hash, (8, 8))  # the entry survived but the block now holds other tokens
    got = fn([1, 2, 3, 4, 5, 6, 7], bs, table, blocks)
    blocks[1] = stale
    if got != [0]:
        raise ExerciseFailed("a hash entry whose block holds other tokens was taken as a hit: check the tokens")
    rng = seeded_random(902)
    for _ in range(25):
        pool = _RandomPool(rng)
        m = pool.manager
        for prompt in (pool.prompt() for _ in range(3)):
            want = [b.block_id for b in find_prefix_hits(prompt, m.block_size, m.hash_to_block, m.blocks)]
            got = fn(list(prompt), m.block_size, dict(m.hash_to_block), m.blocks)
            if got != want:
                raise ExerciseFailed(f"prompt {prompt} should hit blocks {want}, got {got!r} [the cache: labkit's "
                                     f"{pool}]")
    return "hits stop at the first miss, tokens are checked, one token is always left to compute"


def _pool():
    blocks = [Block(i) for i in range(5)]
    table = {}
    for i, h in [(1, 111), (3, 333), (4, 444)]:
        blocks[i].hash, blocks[i].token_ids = h, (i, i)
        table[h] = i
    return blocks, table


@exercise("09", "take_free_block", forbidden=(f"{_MANAGER}.take_free_block", _POP, f"{_PARTS}.labkit_take_free_block"))
def take_free_block(ns):
    fn = require(ns, "take_free_block")
    blocks, table = _pool()
    free_cached = OrderedDict([(3, None), (1, None), (4, None)])  # 3 was freed longest ago
    uncached = deque([2, 0])
    got = fn(uncached, OrderedDict(free_cached), dict(table), blocks)
    if got in (3, 1, 4):
        raise ExerciseFailed("evicted a cached block while a never-cached block was free: use those first")
    if got != 2:
        raise ExerciseFailed(f"expected the first never-cached free block (2), got {got}")
    if 2 in uncached:
        raise ExerciseFailed("the taken never-cached block is still in free_uncached: take it out of the list")
    if blocks[2].ref_count != 1:
        raise ExerciseFailed(f"the never-cached block was handed out with ref_count {blocks[2].ref_count}: a taken "
                             "block's ref_count should be 1 (its new owner), whichever free list it came from; at 0 "
                             "the next release would drop it below zero")
    blocks, table = _pool()
    cached, uncached = OrderedDict(free_cached), deque()
    got = fn(uncached, cached, table, blocks)
    if got == 4:
        raise ExerciseFailed("evicted the most recently freed block: LRU evicts the least recently freed one")
    if got != 3:
        raise ExerciseFailed(f"expected the least recently freed cached block (3), got {got}")
    if 3 in cached:
        raise ExerciseFailed("the taken block is still in the free list")
    if 333 in table:
        raise ExerciseFailed("the evicted block's hash entry is still in the table: a stale entry")
    if blocks[3].hash is not None or blocks[3].token_ids is not None:
        raise ExerciseFailed("the evicted block still carries its old hash / tokens: clear them")
    if blocks[3].ref_count != 1:
        raise ExerciseFailed("the taken block's ref_count should be 1 (its new owner)")
    if list(cached) != [1, 4] or table != {111: 1, 444: 4}:
        raise ExerciseFailed("other cached blocks or hash entries were changed")
    rng = seeded_random(903)
    for _ in range(20):  # a few blocks taken in a row from a pool after random traffic
        pool = _RandomPool(rng)
        labkit, _ = pool.twin()
        for call in range(1, min(labkit.num_free_blocks, rng.randint(1, 5)) + 1):
            where = f"call {call} of take_free_block on labkit's {pool}"
            got, want = fn(*_free_lists(pool.manager)), pop_free_block(*_free_lists(labkit))
            if got != want:
                raise ExerciseFailed(f"took block {got!r}, expected {want} [{where}]")
            _expect_same_pool(pool.manager, labkit, where)
    return "never-cached blocks first, then LRU eviction with its hash entry removed"


def _free_lists(manager):
    """take_free_block's arguments over a manager's pool."""
    return manager.free_uncached, manager.free_cached, manager.hash_to_block, manager.blocks


def _raised(call) -> str | None:
    """The type name of what `call()` raised (a student's exception crosses as a RemoteError), or None."""
    try:
        call()
    except NotImplementedError:
        raise
    except ExerciseFailed:
        raise
    except Exception as error:  # noqa: BLE001 - whatever the student's code raised is the answer
        return raised_type(error)
    return None


def _expect_consistent(manager, sequences):
    """The pool after the student's change passes labkit's own check (free lists, each ref_count against the tables)."""
    try:
        manager.check_invariants(sequences)
    except RuntimeError as broken:
        raise ExerciseFailed(f"the pool is inconsistent afterwards ({broken})") from None


class _Pool:
    """A manager's four structures, built by the real BlockManager so that they are consistent."""

    def __init__(self, num_blocks, block_size, history):
        self.manager = BlockManager(num_blocks, block_size)
        self.live = []
        for name, tokens, keep in history:  # prefill each prompt; free it unless `keep`
            seq = BlockSequence(name, list(tokens))
            self.manager.allocate(seq)
            seq.num_cached_tokens = len(tokens)
            self.manager.cache_computed_blocks(seq)
            if keep:
                self.live.append(seq)
            else:
                self.manager.deallocate(seq)

    def args(self):
        m = self.manager
        return m.hash_to_block, m.blocks, m.free_uncached, m.free_cached

    def snapshot(self):
        return _state(self.manager)


def _state(manager):
    """A manager's pool as comparable values: each block's (ref_count, hash, token_ids), the table, the free lists."""
    return ([(b.ref_count, b.hash, b.token_ids) for b in manager.blocks], dict(manager.hash_to_block),
            list(manager.free_uncached), list(manager.free_cached))


class _RandomPool(_Pool):
    """A pool after a random history of labkit's own operations, prompts drawn from a few shared stems so
    that prefix-cache hits, shared blocks, forks, freed cached blocks and evictions all happen; `history`
    says how to rebuild it with labkit's BlockManager."""

    def __init__(self, rng):
        self.rng, bs = rng, rng.choice([1, 2, 3, 4])
        self.manager, self.live, self.seen = BlockManager(rng.randint(8, 20), bs), [], []
        self.stems = [[rng.randint(0, 9) for _ in range(rng.randint(0, 3 * bs))] for _ in range(3)]
        self.history = [f"BlockManager({self.manager.num_blocks}, block_size={bs})"]
        for _ in range(rng.randint(2, 8)):
            self.step()
        if rng.random() < 0.5:  # no never-cached block left: taking a block evicts
            taken = [self.manager.take_free_block() for _ in range(len(self.manager.free_uncached))]
            hog = BlockSequence("hog", [], taken)
            self.live.append(hog)
            self.history.append("every never-cached free block taken by a sequence 'hog'")

    def prompt(self):
        stem = self.rng.choice(self.stems + self.seen)
        tail = [self.rng.randint(0, 9) for _ in range(self.rng.randint(1, 6))]
        return list(stem[:self.rng.randint(0, len(stem))]) + tail

    def step(self):
        """One random operation: prefill a prompt, fork or extend a running sequence, or free one."""
        m, rng = self.manager, self.rng
        op = rng.choice(["prefill", "prefill", "fork", "extend", "free", "free"] if self.live else ["prefill"])
        if op == "prefill":
            seq = BlockSequence(f"s{len(self.history)}", self.prompt())
            if not m.can_allocate(seq):
                return
            m.allocate(seq)
            self.seen.append(seq.token_ids)
            self.history.append(f"prefill {seq.seq_id} = {seq.token_ids}")
        elif op == "fork":
            seq = self.fork(m, self.live, rng.randrange(len(self.live)))
        elif op == "extend":
            seq = rng.choice(self.live)
            seq.token_ids.extend(rng.randint(0, 3) for _ in range(rng.randint(1, 2 * m.block_size)))
            if not m.can_append(seq):
                del seq.token_ids[seq.num_cached_tokens:]
                return
            m.append(seq)
            self.history.append(f"append and compute {seq.token_ids[seq.num_cached_tokens:]} on {seq.seq_id}")
        else:
            seq = self.live.pop(rng.randrange(len(self.live)))
            m.deallocate(seq)
            self.history.append(f"free {seq.seq_id}")
            return
        if op != "extend":
            self.live.append(seq)
        _computed(m, seq)

    def fork(self, manager, live, i):
        """A new sample of live[i], sharing its blocks (on this pool or its twin: the same name on both)."""
        child = BlockSequence(f"s{len(self.history)}", list(live[i].token_ids))
        manager.fork(live[i], child)
        if manager is self.manager:
            self.history.append(f"fork {live[i].seq_id} into {child.seq_id}")
        return child

    def twin(self):
        """An identical copy, on which labkit's own operation gives the expected pool."""
        return copy.deepcopy((self.manager, self.live))

    def __str__(self):
        return "; ".join(self.history)


def _computed(manager, seq):
    """`seq`'s step ran: every token it holds is computed, and its full blocks hashed."""
    seq.num_cached_tokens = len(seq.token_ids)
    manager.cache_computed_blocks(seq)


def _expect_same_pool(manager, labkit, where):
    """The student's pool against labkit's after the same operations, naming the first difference."""
    for name, mine, theirs in zip(("blocks", "hash_to_block", "free_uncached", "free_cached"), _state(manager),
                                  _state(labkit), strict=True):
        if name == "blocks" and mine != theirs:
            i = next(i for i, (a, b) in enumerate(zip(mine, theirs, strict=True)) if a != b)
            show = [(refs, "hashed" if h is not None else "no hash", tokens) for refs, h, tokens in
                    (mine[i], theirs[i])]
            raise ExerciseFailed(f"block {i} afterwards is (ref_count, hash, token_ids) {show[0]}, labkit's "
                                 f"{show[1]} [{where}]")
        if name == "hash_to_block" and mine != theirs:
            raise ExerciseFailed(f"hash_to_block afterwards reaches blocks {sorted(mine.values())}, labkit's "
                                 f"{sorted(theirs.values())} [{where}]")
        if mine != theirs:
            raise ExerciseFailed(f"{name} afterwards is {mine}, labkit's {theirs} [{where}]")


@exercise("09", "allocate_blocks", forbidden=(f"{_MANAGER}.allocate", f"{_MANAGER}.can_allocate",
                                              f"{_MANAGER}.prefix_hits", f"{_MANAGER}.take_free_block",
                                              f"{_MANAGER}.blocks_to_take", _LOOKUP, _POP,
                                              f"{_PARTS}.labkit_cached_prefix_blocks",
                                              f"{_PARTS}.labkit_take_free_block"))
def allocate_blocks(ns):
    fn = require(ns, "allocate_blocks")
    bs = 2
    # 1. a running sequence holds [1,2][3,4][5]: the new prompt shares its two full blocks
    pool = _Pool(8, bs, [("a", [1, 2, 3, 4, 5], True)])
    got = fn([1, 2, 3, 4, 9, 9, 7], bs, *pool.args())
    if not (isinstance(got, tuple) and len(got) == 2 and isinstance(got[0], list)):
        raise ExerciseFailed(f"return (block_table, num_cached_tokens), a list and an int; got {got!r}")
    table, cached = got
    if table[:2] != [0, 1]:
        raise ExerciseFailed(f"[1,2,3,4,9,9,7] should start with the cached blocks [0, 1] of the running "
                             f"sequence; the table is {table}")
    if cached == 2:
        raise ExerciseFailed("num_cached_tokens counts tokens, not blocks: 2 hit blocks of 2 tokens are 4 tokens")
    if cached != 4:
        raise ExerciseFailed(f"two hit blocks of 2 tokens: num_cached_tokens should be 4, got {cached}")
    blocks = pool.manager.blocks
    if blocks[0].ref_count == 1:
        raise ExerciseFailed("a hit block kept ref_count 1 (or was set to 1): it now has two owners, so add one "
                             "reference (ref_count += 1)")
    if blocks[0].ref_count != 2 or blocks[1].ref_count != 2:
        raise ExerciseFailed(f"each shared block should have ref_count 2, got {blocks[0].ref_count} and "
                             f"{blocks[1].ref_count}")
    if len(table) != 4:
        raise ExerciseFailed(f"7 tokens in blocks of 2 need 4 blocks (2 hits + 2 fresh), the table has {len(table)}")
    _expect_consistent(pool.manager, pool.live + [BlockSequence("new", [], list(table))])

    # 1b. a prompt that fills its blocks exactly: no empty block after them
    pool = _Pool(8, bs, [])
    table, _ = fn([1, 2, 3, 4, 5, 6], bs, *pool.args())
    if len(table) == 4:
        raise ExerciseFailed("6 tokens in blocks of 2 got 4 blocks: they fill exactly 3. The count is "
                             "ceil(n / block_size) = -(-n // block_size); n // block_size + 1 adds an empty block "
                             "whenever n is a multiple of block_size")
    if len(table) != 3:
        raise ExerciseFailed(f"6 tokens in blocks of 2 need 3 blocks, the table has {len(table)}")

    # 2. the prompt's first block sits in a freed, still cached block that LRU would evict first, and
    # no never-cached block is left
    pool = _Pool(4, bs, [("old", [1, 2, 9], False), ("other", [50, 51, 52], False), ("hog", [20, 21, 22, 23], True)])
    try:
        table, cached = fn([1, 2, 6], bs, *pool.args())
    except (NotImplementedError, ExerciseFailed):
        raise
    except Exception as error:  # noqa: BLE001 - the student's code raised
        if raised_type(error) == "KVCacheExhausted":
            raise ExerciseFailed("raised KVCacheExhausted for [1, 2, 6], which revives its hit (block 0) and takes "
                                 "1 more while free_cached holds 2 freed blocks: the capacity check counted only "
                                 "free_uncached; "
                                 "a freed cached block is free too (take_free_block evicts it when no never-cached "
                                 "block is left), so count both lists") from None
        raise ExerciseFailed(f"raised {raised_type(error)} ({error}) where the "
                             "prompt hits a freed cached block: revive the hits (take them out of free_cached) "
                             "before taking fresh blocks, or LRU eviction takes the block just hit") from None
    if table.count(0) > 1 or hash_block(None, (1, 2)) not in pool.manager.hash_to_block:
        raise ExerciseFailed("the block the prompt just hit was evicted for a fresh block: a revived hit was "
                             "still in free_cached, where LRU eviction found it; revive the hits (delete them from "
                             "free_cached) before taking fresh blocks")
    if any(b in pool.manager.free_cached for b in table):
        raise ExerciseFailed("a revived hit is still in free_cached: a block with an owner is not free (delete "
                             "it from the free list)")
    if (table, cached) != ([0, 2], 2):
        raise ExerciseFailed(f"[1, 2, 6] should revive the freed cached block 0 and evict block 2 for its second "
                             f"block: expected ([0, 2], 2), got ({table}, {cached})")
    _expect_consistent(pool.manager, pool.live + [BlockSequence("new", [], list(table))])

    # 3. fits only because the hits are held by a running sequence (they cost no free block)
    pool = _Pool(4, bs, [("a", [1, 2, 3, 4, 5], True)])
    raised = _raised(lambda: fn([1, 2, 3, 4, 8], bs, *pool.args()))
    if raised is not None:
        raise ExerciseFailed(f"raised {raised} although the prompt fits: its two hit blocks are already held by a "
                             "running sequence and cost no free block, so it needs 1 of the 1 free")

    # 4. does not fit: a hit on a *free* cached block still takes that block out of the free pool
    pool = _Pool(3, bs, [("old", [1, 2, 3, 4], False)])
    before = pool.snapshot()
    raised = _raised(lambda: fn([1, 2, 3, 4, 5, 6, 7], bs, *pool.args()))
    if raised is None:
        raise ExerciseFailed("7 tokens need 4 blocks and the pool has 3: raise KVCacheExhausted")
    if raised != "KVCacheExhausted":
        raise ExerciseFailed(f"raised {raised} where the pool is too small: check first and raise "
                             "KVCacheExhausted (hits on free cached blocks still consume free blocks)")
    if pool.snapshot() != before:
        raise ExerciseFailed("the pool changed before KVCacheExhausted was raised: check that everything fits "
                             "before reviving or taking any block")
    rng = seeded_random(904)
    for _ in range(20):  # prompts sharing prefixes with a pool after random traffic, prefilled one after another
        pool = _RandomPool(rng)
        labkit, _ = pool.twin()
        bs = labkit.block_size
        for prompt in (pool.prompt() for _ in range(rng.randint(1, 3))):
            where = f"allocate_blocks({prompt}, {bs}, ...) on labkit's {pool}"
            seq = BlockSequence(f"s{len(pool.history)}", list(prompt))
            try:
                labkit.allocate(seq)
                want = (seq.block_table, seq.num_cached_tokens)
            except KVCacheExhausted:
                want = "KVCacheExhausted"
            try:
                got = fn(list(prompt), bs, *pool.args())
            except (NotImplementedError, ExerciseFailed):
                raise
            except Exception as error:  # noqa: BLE001 - the student's code raised
                got = raised_type(error)
            if got != want:
                raise ExerciseFailed(f"expected {want}, got {got!r} [{where}]")
            _expect_same_pool(pool.manager, labkit, where)
            if got != "KVCacheExhausted":
                _computed(labkit, seq)
                _computed(pool.manager, BlockSequence(seq.seq_id, list(prompt), list(got[0])))
                pool.history.append(f"prefill {seq.seq_id} = {prompt}")
    return "hits shared with one more reference, free ones revived first, fresh blocks after, all or nothing"


def _release_case():
    """Sequence s holds [shared 0][shared 1][own full 2][own duplicate 3][own partial 4]."""
    blocks = [Block(i) for i in range(6)]
    chain = [hash_block(None, (1, 2))]
    chain.append(hash_block(chain[0], (3, 4)))
    chain.append(hash_block(chain[1], (5, 6)))
    chain.append(hash_block(chain[2], (7, 8)))
    for i, tokens in enumerate([(1, 2), (3, 4), (5, 6), (7, 8)]):
        blocks[i].hash, blocks[i].token_ids = chain[i], tokens
    blocks[5].hash, blocks[5].token_ids, blocks[5].ref_count = chain[3], (7, 8), 1  # the cached twin of block 3
    table = {chain[0]: 0, chain[1]: 1, chain[2]: 2, chain[3]: 5}
    for i, refs in enumerate([2, 2, 1, 1, 1]):
        blocks[i].ref_count = refs
    return [0, 1, 2, 3, 4], table, blocks, deque(), OrderedDict([(9, None)])  # 9: an earlier freed block


@exercise("09", "release_blocks", forbidden=(f"{_MANAGER}.deallocate", f"{_MANAGER}.release_table",
                                             f"{_MANAGER}.truncate"))
def release_blocks(ns):
    fn = require(ns, "release_blocks")
    table, entries, blocks, free_uncached, free_cached = _release_case()
    blocks.extend(Block(i) for i in range(6, 10))
    blocks[9].hash, blocks[9].token_ids = 999, (0, 0)
    entries[999] = 9
    original_entries = dict(entries)
    fn(list(table), entries, blocks, free_uncached, free_cached)
    if blocks[0].ref_count == 0 or 0 in free_cached or 0 in free_uncached:
        raise ExerciseFailed("a shared block was freed: another sequence still reads it; drop one reference "
                             "(ref_count -= 1) and free a block only at zero")
    if blocks[0].ref_count != 1 or blocks[1].ref_count != 1:
        raise ExerciseFailed(f"each shared block should keep ref_count 1, got {blocks[0].ref_count} and "
                             f"{blocks[1].ref_count}")
    if 4 in free_cached:
        raise ExerciseFailed("the partial block (no hash) went to free_cached: nothing in it can be hit, it is a "
                             "plain free block (free_uncached)")
    if 3 in free_cached:
        raise ExerciseFailed("block 3 has a hash, but the hash entry points at its twin, block 5: a block the "
                             "table cannot reach is not cached; free it as uncached")
    if 2 in free_uncached:
        raise ExerciseFailed("a full, computed block (with its hash entry) was freed as uncached: keep it in "
                             "free_cached, so a later prompt with the same prefix can revive it")
    if sorted(free_uncached) != [3, 4] or sorted(free_cached) != [2, 9]:
        raise ExerciseFailed(f"expected free_uncached [4, 3] and free_cached [9, 2], got {list(free_uncached)} "
                             f"and {list(free_cached)}")
    if blocks[3].hash is not None or blocks[3].token_ids is not None or blocks[4].token_ids is not None:
        raise ExerciseFailed("a block freed as uncached still carries its old hash / tokens: clear them (both "
                             "hash and token_ids; stale token_ids let a later lookup take other content for a hit)")
    if list(free_cached) != [9, 2] or entries != original_entries:
        raise ExerciseFailed("free_cached must keep its earlier blocks first (LRU order) and the hash entries "
                             "stay as they are")
    # order: a sequence with three cached blocks, freed tail first, so LRU evicts its tail first
    blocks = [Block(i) for i in range(3)]
    prev, entries = None, {}
    for i in range(3):
        prev = hash_block(prev, (i, i))
        blocks[i].hash, blocks[i].token_ids, blocks[i].ref_count = prev, (i, i), 1
        entries[prev] = i
    free_cached = OrderedDict()
    fn([0, 1, 2], entries, blocks, deque(), free_cached)
    if list(free_cached) == [0, 1, 2]:
        raise ExerciseFailed("released head first: LRU would evict the prefix's first block first, which "
                             "makes every later block unreachable; release the tail first ([2, 1, 0])")
    if list(free_cached) != [2, 1, 0]:
        raise ExerciseFailed(f"expected free_cached in the order [2, 1, 0], got {list(free_cached)}")
    rng = seeded_random(905)
    for _ in range(20):  # the running sequences of a pool after random traffic, released in a random order
        pool = _RandomPool(rng)
        labkit, twins = pool.twin()
        for i in rng.sample(range(len(pool.live)), rng.randint(1, len(pool.live)) if pool.live else 0):
            seq = pool.live[i]
            where = f"release_blocks({seq.block_table}, ...) of {seq.seq_id} on labkit's {pool}"
            fn(list(seq.block_table), *pool.args())
            labkit.release_table(twins[i])
            _expect_same_pool(pool.manager, labkit, where)
            pool.history.append(f"free {seq.seq_id}")
    return "one reference per block, tail first; hashed blocks stay cached, others are cleared"


def _forked(num_blocks, block_size, prompt_len, num_children, extra=()):
    """A prefilled prompt forked into `num_children` samples, and `extra` prompts running beside them."""
    bm = BlockManager(num_blocks, block_size)
    parent = BlockSequence("parent", list(range(prompt_len)))
    bm.allocate(parent)
    parent.num_cached_tokens = prompt_len
    family = [parent]
    for i in range(num_children):
        child = BlockSequence(f"sample {i + 1}", list(range(prompt_len)))
        bm.fork(parent, child)
        family.append(child)
    for i, length in enumerate(extra):
        seq = BlockSequence(f"other {i}", list(range(100 * (i + 1), 100 * (i + 1) + length)))
        bm.allocate(seq)
        family.append(seq)
    return bm, family


def _append_case(fn, bm, seq, new_tokens):
    """Give `seq` new tokens and call the student's append on the manager's structures; the twin's
    answer comes from labkit's own BlockManager.append on an identical copy."""
    seq.token_ids.extend(new_tokens)
    table = list(seq.block_table)
    try:
        copies = fn(table, len(seq.token_ids), seq.num_cached_tokens, bm.block_size, bm.hash_to_block, bm.blocks,
                    bm.free_uncached, bm.free_cached)
    except (NotImplementedError, ExerciseFailed):
        raise
    except Exception as error:  # noqa: BLE001 - the student's code raised
        return raised_type(error), table
    return copies, table


@exercise("09", "append_blocks", forbidden=(f"{_MANAGER}.shared_write_index", f"{_MANAGER}.shared_write_indexes",
                                            f"{_MANAGER}.shared_write_block",
                                            f"{_MANAGER}.missing_blocks", f"{_MANAGER}.append",
                                            f"{_MANAGER}.can_append", f"{_PARTS}.labkit_can_append"))
def append_blocks(ns):
    fn = require(ns, "append_blocks")
    # 1. four samples of a 12-token prompt (blocks of 8): each one's 13th token lands in the shared partial block
    bm, family = _forked(8, 8, 12, 3)
    ref_before = [bm.blocks[b].ref_count for b in family[0].block_table]
    copies, table = _append_case(fn, bm, family[1], [7])
    if isinstance(copies, str):
        raise ExerciseFailed(f"raised {copies} for a sample writing into its shared partial block, with 6 blocks free")
    if not isinstance(copies, list):
        raise ExerciseFailed(f"return the list of (source, destination) copies, got {copies!r}")
    if copies == []:
        raise ExerciseFailed("the sample's next token lands in a block three other samples share (ref_count 4), "
                             "and no copy was made: it would overwrite their K/V; copy it first (copy-on-write)")
    if copies == [(table[1], 1)]:
        raise ExerciseFailed("a copy goes from the shared block (source) to the fresh one (destination): "
                             "return (source, destination)")
    if table[0] != 0:
        raise ExerciseFailed("the full first block was copied too: full blocks are never written again, they stay "
                             "shared; only the block the next token is written into is copied")
    if len(copies) != 1 or copies[0][0] != 1 or table[1] != copies[0][1] or table[1] == 1:
        raise ExerciseFailed(f"expected one copy of block 1 into a fresh block that replaces it in the table; got "
                             f"copies {copies}, table {table}")
    if bm.blocks[1].ref_count == ref_before[1]:
        raise ExerciseFailed("the shared block kept its reference count: the copying sample no longer holds it, "
                             "so it loses one reference (ref_count -= 1)")
    family[1].block_table = table
    _expect_consistent(bm, family)
    # 2. the last holder of a block that others copied away from writes into it: no copy needed
    bm, family = _forked(8, 8, 12, 1)
    family[1].block_table[1] = bm.take_free_block()  # sample 1 already took its copy
    bm.blocks[1].ref_count -= 1
    copies, table = _append_case(fn, bm, family[0], [5])
    if copies != []:
        raise ExerciseFailed(f"copied a block that only this sequence holds (ref_count 1): got {copies}; copy only "
                             "when ref_count > 1")
    # 3. a chunk that fills the shared partial block and starts two more: one copy, then two new blocks
    bm, family = _forked(8, 4, 6, 1)  # blocks of 4: [0..3] full and shared, [4, 5] partial and shared
    copies, table = _append_case(fn, bm, family[1], list(range(50, 57)))  # 13 tokens, computed 6
    if isinstance(copies, str):
        raise ExerciseFailed(f"raised {copies} for a sequence that needs 1 copy and 2 new blocks with 6 free")
    if len(table) < 4:
        raise ExerciseFailed(f"13 tokens in blocks of 4 need 4 blocks, the table has {len(table)}: add the missing "
                             "blocks after the copy")
    if len(copies) != 1 or copies[0][0] != 1 or table[1] != copies[0][1] or len(table) != 4:
        raise ExerciseFailed(f"the write position (num_computed = 6) is in block index 1, which is shared: copy it "
                             f"and add 2 new blocks; got copies {copies}, table {table}")
    family[1].block_table = table
    _expect_consistent(bm, family)
    # 4. one free block: enough for the copy, not also for the new block the three new tokens need
    bm, family = _forked(3, 4, 6, 1)
    before = ([(b.ref_count, b.hash) for b in bm.blocks], list(bm.free_uncached), list(bm.free_cached))
    copies, table = _append_case(fn, bm, family[1], [60, 61, 62])  # 9 tokens: a copy and one more block
    after = ([(b.ref_count, b.hash) for b in bm.blocks], list(bm.free_uncached), list(bm.free_cached))
    if not isinstance(copies, str):
        raise ExerciseFailed("the sequence needs a copy and a new block, 2 free blocks, and 1 is free: raise "
                             "KVCacheExhausted (count the copy too)")
    if copies != "KVCacheExhausted":
        raise ExerciseFailed(f"raised {copies} where the pool is too small: check first, and count the copy-on-write "
                             "block with the missing ones; then raise KVCacheExhausted")
    if after != before:
        raise ExerciseFailed("the pool changed before KVCacheExhausted was raised: check that the copy and the new "
                             "blocks fit before taking any block")
    # 5. a prompt that fills its two blocks exactly, forked: the next token starts a new block, and the
    # full shared blocks stay shared (the block written next is num_computed // block_size, not the last one)
    bm, family = _forked(8, 4, 8, 1)
    copies, table = _append_case(fn, bm, family[1], [70])
    if isinstance(copies, str):
        raise ExerciseFailed(f"raised {copies} for a sample whose 9th token starts a new block, with 6 blocks free")
    if copies:
        raise ExerciseFailed(f"copied {copies} although the next token (position 8, blocks of 4) lands in a new "
                             "block: the block to copy is the one the next write lands in, block_table[num_computed "
                             "// block_size], not the table's last block, and only when it is shared")
    if len(table) != 3:
        raise ExerciseFailed(f"9 tokens in blocks of 4 need 3 blocks, the table has {len(table)}")
    # 6. two tokens that fill the last block exactly: no block is missing
    bm, family = _forked(8, 4, 6, 0)
    copies, table = _append_case(fn, bm, family[0], [71, 72])
    if copies != [] or len(table) != 2:
        raise ExerciseFailed(f"8 tokens in blocks of 4 fill exactly the 2 blocks held, got copies {copies} and table "
                             f"{table}: the count is ceil(n / block_size) = -(-n // block_size); n // block_size + 1 "
                             "adds an empty block whenever n is a multiple of block_size")
    # 7. an interrupted step left tokens uncomputed and a block past the write block: the write block (index 1,
    # num_computed 6) is shared, the table's last block is the sample's own. Expected: what labkit's append does
    bm, family = _forked(8, 4, 6, 1)
    family[1].block_table.append(bm.take_free_block())
    family[1].token_ids.extend([80, 81, 82])
    labkit, twin = copy.deepcopy((bm, family[1]))
    twin.token_ids.append(83)
    want = labkit.append(twin)
    copies, table = _append_case(fn, bm, family[1], [83])
    if (copies, table) != (want, twin.block_table):
        raise ExerciseFailed(f"a sample with 10 tokens, 6 computed, table [0, 1, 2] (blocks of 4; block 1 shared, "
                             f"block 2 its own): the next write lands in block index num_computed // block_size = "
                             f"1, which is shared, so copy that one, not the table's last block; expected copies "
                             f"{want} and table {twin.block_table}, got {copies!r} and {table}")
    family[1].block_table = table
    _expect_consistent(bm, family)
    rng = seeded_random(906)
    for _ in range(20):  # running sequences of a pool after random traffic (forks among them) given new tokens
        pool = _RandomPool(rng)
        labkit, twins = pool.twin()
        bs = labkit.block_size
        for _ in range(rng.randint(1, 3)):
            holders = [i for i, seq in enumerate(pool.live) if seq.token_ids]
            if not holders:
                break
            i = rng.choice(holders)
            if rng.random() < 0.5:  # a new sample of it first: the two share its partial block
                twins.append(pool.fork(labkit, twins, i))
                pool.live.append(pool.fork(pool.manager, pool.live, i))
                i = rng.choice([i, len(twins) - 1])
            seq, twin, new = pool.live[i], twins[i], [rng.randint(0, 3) for _ in range(rng.randint(1, 2 * bs))]
            where = f"{seq.seq_id} ({len(seq.token_ids)} tokens, all computed, table {seq.block_table}) given " \
                    f"the new tokens {new}, on labkit's {pool}"
            twin.token_ids.extend(new)
            try:
                want = labkit.append(twin)
            except KVCacheExhausted:
                want = "KVCacheExhausted"
            copies, table = _append_case(fn, pool.manager, seq, new)
            if copies != want or (copies != "KVCacheExhausted" and table != twin.block_table):
                raise ExerciseFailed(f"expected copies {want} and table {twin.block_table}, got {copies!r} and "
                                     f"{table} [{where}]")
            _expect_same_pool(pool.manager, labkit, where)
            if copies == "KVCacheExhausted":
                del seq.token_ids[seq.num_cached_tokens:], twin.token_ids[twin.num_cached_tokens:]
                continue
            seq.block_table = table
            _computed(pool.manager, seq)
            _computed(labkit, twin)
            pool.history.append(f"append and compute {new} on {seq.seq_id}")
    return "copies only a shared write block, source to destination, adds missing blocks, all or nothing"


@exercise("09", "knowledge_check")
def knowledge_check(ns):
    from labkit_course.grading.quiz import Choice, Number, grade_answers

    def served(system, questions, block_size):
        """Prompt tokens the prefix cache serves when the requests arrive one after another."""
        bm = BlockManager(num_blocks=64, block_size=block_size)
        for i, question in enumerate(questions):
            seq = BlockSequence(i, system + question)
            bm.allocate(seq)
            seq.num_cached_tokens = len(seq.token_ids)  # its prefill ran
            bm.cache_computed_blocks(seq)
        return bm.stats.hit_tokens, bm

    system = list(range(100, 140))
    hits, _ = served(system, [list(range(1000 * i, 1000 * i + 6)) for i in range(1, 9)], block_size=16)
    _, pair = served(system[:16], [[1, 2, 3, 4, 5, 6], [7, 8, 9, 10, 11, 12]], block_size=8)
    return grade_answers(ns, {
        1: Choice("b", "section 1, hash chains"),
        2: Number(hits, "section 3: only whole blocks inside the shared prompt are hits"),
        3: Number(pair.blocks[0].ref_count, "the diagram at the top: one reference per sequence that holds the block"),
        4: Choice("b", "bug 2 in section 6"),
        5: Choice("b", "bug 3 in section 6"),
    })
