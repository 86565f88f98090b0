"""Lab 09: block manager and prefix caching — hash chains, prefix lookup, LRU eviction."""

from collections import OrderedDict, deque

from labkit.cache.block_manager import Block, hash_block
from labkit.grading import ExerciseFailed, exercise, require


def _reference_chain(token_ids, block_size):
    hashes, prev = [], None
    for i in range(len(token_ids) // block_size):
        prev = hash_block(prev, token_ids[i * block_size:(i + 1) * block_size])
        hashes.append(prev)
    return hashes


_MANAGER = "labkit.cache.block_manager.BlockManager"


@exercise("09", "chain_hashes", forbidden=(f"{_MANAGER}.prefix_hits", f"{_MANAGER}.cache_computed_blocks",
                                           "labkit.grading.labs.lab09._reference_chain"))
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
    if fn([1, 2, 3], 4) != [] or fn(list(range(8)), 2) != _reference_chain(list(range(8)), 2):
        raise ExerciseFailed("wrong for other lengths or block sizes (3 tokens in blocks of 4 have no full block)")
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


@exercise("09", "cached_prefix_blocks", forbidden=(f"{_MANAGER}.prefix_hits",))
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
    return "hits stop at the first miss, tokens are checked, one token is always left to compute"


def _pool():
    blocks = [Block(i) for i in range(5)]
    table = {}
    for i, h in [(1, 111), (3, 333), (4, 444)]:
        blocks[i].hash, blocks[i].token_ids = h, (i, i)
        table[h] = i
    return blocks, table


@exercise("09", "take_free_block", forbidden=(f"{_MANAGER}._take_free_block",))
def take_free_block(ns):
    fn = require(ns, "take_free_block")
    blocks, table = _pool()
    free_cached = OrderedDict([(3, None), (1, None), (4, None)])  # 3 was freed longest ago
    got = fn(deque([2, 0]), OrderedDict(free_cached), dict(table), blocks)
    if got in (3, 1, 4):
        raise ExerciseFailed("evicted a cached block while a never-cached block was free: use those first")
    if got != 2:
        raise ExerciseFailed(f"expected the first never-cached free block (2), got {got}")
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
    return "never-cached blocks first, then LRU eviction with its hash entry removed"


@exercise("09", "knowledge_check")
def knowledge_check(ns):
    from labkit.cache.block_manager import BlockManager
    from labkit.cache.sequence_blocks import BlockSequence
    from labkit.grading.quiz import Choice, Number, grade_answers

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
        4: Choice("b", "bug 2 in section 5"),
        5: Choice("b", "bug 3 in section 5"),
    })
