"""Lab 09 graders: the solution passes, a stub is "not implemented", each typical mistake is named."""

import pytest

from labkit.cache.block_manager import hash_block
from labkit.grading.core import get_exercise, run_exercise


def grade(name, fn):
    return run_exercise(get_exercise("09", name), {name: fn})


def chain(tokens, bs, chained=True, partial=False):
    out, prev = [], None
    n = -(-len(tokens) // bs) if partial else len(tokens) // bs
    for i in range(n):
        h = hash_block(prev if chained else None, tokens[i * bs:(i + 1) * bs])
        out.append(h)
        prev = h
    return out


def lookup(tokens, bs, table, blocks, stop_at_miss=True, check_tokens=True, keep_last=True):
    hits, prev = [], None
    n = (len(tokens) - 1) // bs if keep_last else len(tokens) // bs
    for i in range(n):
        chunk = tuple(tokens[i * bs:(i + 1) * bs])
        prev = hash_block(prev, chunk)
        bid = table.get(prev)
        if bid is None or (check_tokens and blocks[bid].token_ids != chunk):
            if stop_at_miss:
                break
            continue
        hits.append(bid)
    return hits


def take(uncached, cached, table, blocks, prefer_uncached=True, lru=True, drop_entry=True):
    if uncached and prefer_uncached:
        bid = uncached.popleft()
    else:
        bid, _ = cached.popitem(last=not lru)
        if drop_entry:
            del table[blocks[bid].hash]
        blocks[bid].hash = blocks[bid].token_ids = None
    blocks[bid].ref_count = 1
    return bid


def stub(*args):
    raise NotImplementedError()


@pytest.mark.parametrize("name, fn, message", [
    ("chain_hashes", chain, "one chained hash per full block"),
    ("chain_hashes", stub, "not implemented yet"),
    ("chain_hashes", lambda t, bs: chain(t, bs, chained=False), "each block is hashed on its own"),
    ("chain_hashes", lambda t, bs: chain(t, bs, partial=True), "partial last block got a hash"),
    ("cached_prefix_blocks", lookup, "hits stop at the first miss"),
    ("cached_prefix_blocks", stub, "not implemented yet"),
    ("cached_prefix_blocks", lambda *a: lookup(*a, stop_at_miss=False), "after a miss nothing may hit"),
    ("cached_prefix_blocks", lambda *a: lookup(*a, check_tokens=False), "check the tokens"),
    ("cached_prefix_blocks", lambda *a: lookup(*a, keep_last=False), "leave at least its last token"),
    ("take_free_block", take, "LRU eviction with its hash entry removed"),
    ("take_free_block", stub, "not implemented yet"),
    ("take_free_block", lambda *a: take(*a, prefer_uncached=False), "never-cached block was free"),
    ("take_free_block", lambda *a: take(*a, lru=False), "most recently freed"),
    ("take_free_block", lambda *a: take(*a, drop_entry=False), "stale entry"),
])
def test_lab09_graders(name, fn, message):
    outcome = grade(name, fn)
    assert message in outcome.message
    assert outcome.passed == (fn in (chain, lookup, take))


def test_lab09_take_free_block_leaves_other_entries_alone():
    def greedy(uncached, cached, table, blocks):
        bid = take(uncached, cached, table, blocks)
        cached.clear()
        return bid

    assert "other cached blocks" in grade("take_free_block", greedy).message
