"""BlockManager: allocation, prefix hits, eviction, swap, error paths, and the three nano-vLLM bugs."""

import pytest
import torch

from labkit.cache.block_manager import BlockManager, KVCacheExhausted, hash_block
from labkit.cache.paged_storage import PagedKVStorage
from labkit.cache.sequence_blocks import BlockSequence


def computed(seq):
    """What the engine does after a forward step: every token's K/V is now stored."""
    seq.num_cached_tokens = len(seq.token_ids)
    return seq


def prefill(bm, seq):
    """Allocate, run the (pretend) prefill, and let the manager cache the computed full blocks."""
    bm.allocate(seq)
    hit = seq.num_cached_tokens
    bm.cache_computed_blocks(computed(seq))
    return hit


def test_allocate_counts_blocks_and_frees_everything():
    bm = BlockManager(num_blocks=8, block_size=4)
    seq = BlockSequence(0, list(range(10)))
    assert bm.can_allocate(seq)
    bm.allocate(seq)
    assert len(seq.block_table) == 3 and seq.num_cached_tokens == 0
    assert bm.num_free_blocks == 5
    bm.check_invariants([seq])
    bm.deallocate(seq)
    assert seq.block_table == [] and bm.num_free_blocks == 8
    bm.check_invariants([])


def test_hash_chain_covers_the_whole_prefix():
    assert hash_block(None, [1, 2]) != hash_block(hash_block(None, [9, 9]), [1, 2])
    assert hash_block(None, [1, 2]) == hash_block(None, (1, 2))


def test_shared_system_prompt_hits_and_counts():
    bm = BlockManager(num_blocks=16, block_size=4)
    system = list(range(100, 112))  # three full blocks
    a = BlockSequence("a", system + [1, 2])
    prefill(bm, a)
    b = BlockSequence("b", system + [7, 8, 9])
    bm.allocate(b)
    assert b.num_cached_tokens == 12
    assert b.block_table[:3] == a.block_table[:3] and b.block_table[3] != a.block_table[3]
    assert [bm.blocks[i].ref_count for i in a.block_table[:3]] == [2, 2, 2]
    assert bm.stats.hit_tokens == 12 and bm.stats.queried_tokens == 14 + 15
    bm.check_invariants([a, b])


def test_a_hit_stops_at_the_first_miss():
    bm = BlockManager(num_blocks=16, block_size=2)
    a = BlockSequence("a", [1, 2, 3, 4, 5, 6, 7])
    prefill(bm, a)
    b = BlockSequence("b", [1, 2, 9, 9, 5, 6, 7])  # block 2 equal to a's, but after a different block
    bm.allocate(b)
    assert b.num_cached_tokens == 2


def test_freed_blocks_stay_cached_until_evicted_lru_first():
    bm = BlockManager(num_blocks=4, block_size=2)
    a = BlockSequence("a", [1, 2, 3, 4, 5])
    prefill(bm, a)
    bm.deallocate(a)  # blocks [1,2] and [3,4] stay cached, the partial one does not
    assert bm.num_free_blocks == 4 and bm.num_cached_free_blocks == 2
    again = BlockSequence("again", [1, 2, 3, 4, 6])
    bm.allocate(again)
    assert again.num_cached_tokens == 4 and bm.stats.evictions == 0
    bm.deallocate(again)
    big = BlockSequence("big", [9] * 7)  # needs all four blocks: evicts both cached ones
    bm.allocate(big)
    assert bm.stats.evictions == 2 and bm.hash_to_block == {}
    bm.check_invariants([big])


def test_bug_stale_hash_after_reuse_is_never_a_hit():
    """nano-vLLM kept the hash entry of a block after handing the block to new content.

    Here the reused block gets the same tokens [3, 4] under a different prefix, so a stale entry
    would pass the block-level token check and serve K/V computed after [7, 8] to a prompt that
    starts [1, 2].
    """
    bm = BlockManager(num_blocks=3, block_size=2)
    a = BlockSequence("a", [1, 2, 3, 4])
    prefill(bm, a)
    first, second = a.block_table
    bm.deallocate(a)  # both blocks stay cached; [3, 4] (the tail) is the least recently freed
    b = BlockSequence("b", [7, 8, 3, 4])
    assert prefill(bm, b) == 0
    assert b.block_table[1] == second  # the [3, 4] block was evicted and refilled
    bm.check_invariants([b])
    bm.deallocate(b)
    c = BlockSequence("c", [1, 2, 3, 4, 5])
    bm.allocate(c)
    assert c.block_table[0] == first  # [1, 2] is still valid and hits
    assert c.num_cached_tokens == 2  # a stale [1, 2] + [3, 4] entry would make this 4


def test_bug_fully_cached_prompt_leaves_a_token_to_compute():
    bm = BlockManager(num_blocks=8, block_size=4)
    a = BlockSequence("a", list(range(8)))
    prefill(bm, a)
    b = BlockSequence("b", list(range(8)))  # every block of b is cached
    bm.allocate(b)
    assert b.num_cached_tokens == 4 < len(b.token_ids)
    assert b.block_table[0] == a.block_table[0] and b.block_table[1] != a.block_table[1]
    assert bm.blocks[b.block_table[1]].ref_count == 1  # the block b will write into is its own
    bm.check_invariants([a, b])


def test_bug_preempting_a_sequence_with_shared_blocks_keeps_the_other_intact():
    bm = BlockManager(num_blocks=6, block_size=2)
    a = BlockSequence("a", [1, 2, 3, 4, 5])
    prefill(bm, a)
    b = BlockSequence("b", [1, 2, 3, 4, 6])
    bm.allocate(b)
    shared = a.block_table[:2]
    b.token_ids.append(10)  # b decodes a token, then is preempted (recompute)
    computed(b)
    bm.append(b)
    bm.deallocate(b)
    assert [bm.blocks[i].ref_count for i in shared] == [1, 1]
    assert a.block_table[:2] == shared and all(bm.hash_to_block[bm.blocks[i].hash] == i for i in shared)
    bm.check_invariants([a])
    bm.allocate(b)  # re-admitted: its prompt plus output, prefix hits again
    assert b.block_table[:2] == shared and b.num_cached_tokens == 4
    bm.deallocate(a)
    bm.deallocate(b)
    assert bm.num_free_blocks == 6
    bm.check_invariants([])


def test_append_adds_a_block_only_at_a_boundary_and_caches_full_ones():
    bm = BlockManager(num_blocks=4, block_size=2)
    seq = BlockSequence("s", [1, 2, 3])
    bm.allocate(seq)
    computed(seq)
    seq.token_ids.append(4)
    assert bm.can_append(seq)
    bm.append(seq)
    assert len(seq.block_table) == 2
    computed(seq)
    seq.token_ids.append(5)
    bm.append(seq)
    assert len(seq.block_table) == 3
    assert bm.blocks[seq.block_table[1]].hash is not None and bm.blocks[seq.block_table[2]].hash is None


def test_pool_exhaustion_is_a_clear_error_and_nothing_changes():
    bm = BlockManager(num_blocks=2, block_size=4)
    seq = BlockSequence("long", list(range(9)))
    assert not bm.can_allocate(seq)
    with pytest.raises(KVCacheExhausted, match="needs 3 free blocks, 2 of 2 are free"):
        bm.allocate(seq)
    assert seq.block_table == [] and bm.num_free_blocks == 2
    full = BlockSequence("full", list(range(8)))
    bm.allocate(full)
    full.token_ids.append(8)
    assert not bm.can_append(full)
    with pytest.raises(KVCacheExhausted, match="needs 1 more block"):
        bm.append(full)
    assert len(full.block_table) == 2
    bm.check_invariants([full])


@pytest.mark.parametrize("call, message", [
    ("allocate_twice", "already holds blocks"),
    ("append_first", "holds no blocks; allocate"),
    ("free_twice", "holds no blocks \\(never allocated, or freed already\\)"),
    ("empty", "has no tokens"),
    ("shrink", "tokens were removed"),
])
def test_out_of_order_calls_raise_value_errors(call, message):
    bm = BlockManager(num_blocks=4, block_size=2)
    seq = BlockSequence("s", [1, 2, 3])
    with pytest.raises(ValueError, match=message):
        if call == "allocate_twice":
            bm.allocate(seq)
            bm.allocate(seq)
        elif call == "append_first":
            bm.append(seq)
        elif call == "free_twice":
            bm.allocate(seq)
            bm.deallocate(seq)
            bm.deallocate(seq)
        elif call == "empty":
            bm.allocate(BlockSequence("e", []))
        else:
            bm.allocate(seq)
            seq.token_ids[:] = [1]
            bm.append(seq)


@pytest.mark.parametrize("kwargs, name", [({"num_blocks": 0, "block_size": 4}, "num_blocks"),
                                          ({"num_blocks": 4, "block_size": 0}, "block_size")])
def test_bad_sizes_name_the_parameter(kwargs, name):
    with pytest.raises(ValueError, match=name):
        BlockManager(**kwargs)


def swapped_out():
    """A pool of 4 blocks of 8 with random K/V, and a 12-token sequence swapped out of it: (manager,
    storage, the sequence, its K/V as it was)."""
    storage = PagedKVStorage(num_layers=2, num_blocks=4, block_size=8, num_kv_heads=1, head_dim=4)
    storage.kv.copy_(torch.randn(storage.kv.shape))
    bm = BlockManager(num_blocks=4, block_size=8)
    seq = BlockSequence("s", list(range(12)))
    bm.allocate(seq)
    computed(seq)
    before = storage.read_blocks(seq.block_table)
    bm.swap_out(seq, storage)
    return bm, storage, seq, before


def test_swap_out_and_in_restores_the_kv_and_frees_the_blocks():
    bm, storage, seq, before = swapped_out()
    assert bm.is_swapped(seq) and seq.block_table == [] and seq.num_cached_tokens == 12
    filler = BlockSequence("filler", list(range(100, 132)))  # takes every block, overwriting the K/V
    bm.allocate(filler)
    storage.kv.zero_()
    assert not bm.can_swap_in(seq)
    with pytest.raises(KVCacheExhausted, match="to swap in"):
        bm.swap_in(seq, storage)
    bm.deallocate(filler)
    bm.swap_in(seq, storage)
    assert not bm.is_swapped(seq)
    torch.testing.assert_close(storage.read_blocks(seq.block_table), before, rtol=0, atol=0)
    with pytest.raises(ValueError, match="already holds blocks"):
        bm.swap_in(seq, storage)
    bm.check_invariants([seq])


def test_a_failed_swap_in_keeps_the_cpu_copy_and_takes_no_block():
    bm, storage, seq, before = swapped_out()

    class BrokenCopy:
        def write_blocks(self, block_ids, data):
            raise RuntimeError("copy failed")

    with pytest.raises(RuntimeError, match="copy failed"):
        bm.swap_in(seq, BrokenCopy())
    assert bm.is_swapped(seq) and seq.block_table == [] and bm.num_free_blocks == 4
    bm.check_invariants([seq])
    bm.swap_in(seq, storage)  # the retry finds the CPU copy
    torch.testing.assert_close(storage.read_blocks(seq.block_table), before, rtol=0, atol=0)


def test_aborting_a_swapped_sequence_drops_its_cpu_copy():
    storage = PagedKVStorage(num_layers=1, num_blocks=2, block_size=8, num_kv_heads=1, head_dim=4)
    bm = BlockManager(num_blocks=2, block_size=8)
    seq = BlockSequence("s", [1, 2, 3])
    bm.allocate(seq)
    bm.swap_out(seq, storage)
    bm.deallocate(seq)
    assert not bm.is_swapped(seq) and bm.num_free_blocks == 2
    with pytest.raises(ValueError, match="not swapped out"):
        bm.can_swap_in(seq)


def test_without_prefix_caching_nothing_is_shared():
    bm = BlockManager(num_blocks=8, block_size=2, enable_prefix_caching=False)
    a = BlockSequence("a", [1, 2, 3])
    prefill(bm, a)
    bm.deallocate(a)
    b = BlockSequence("b", [1, 2, 3])
    bm.allocate(b)
    assert b.num_cached_tokens == 0 and bm.hash_to_block == {}


@pytest.mark.parametrize("block_size, hit_tokens", [(8, 7 * 40), (16, 7 * 32), (32, 7 * 32), (256, 0)])
def test_lab09_claim_shared_system_prompt_hits_whole_blocks_only(block_size, hit_tokens):
    """Lab 09 §3: a 40-token system prompt shared by 8 requests; only whole blocks inside it are reused."""
    g = torch.Generator().manual_seed(9)
    system = torch.randint(100, 1000, (40,), generator=g).tolist()
    bm = BlockManager(num_blocks=128, block_size=block_size)
    for i in range(8):
        prefill(bm, BlockSequence(i, system + torch.randint(100, 1000, (6,), generator=g).tolist()))
    assert bm.stats.hit_tokens == hit_tokens and bm.stats.queried_tokens == 8 * 46


def test_fork_shares_every_block_and_copy_on_write_copies_only_the_written_partial_block():
    storage = PagedKVStorage(num_layers=2, num_blocks=8, block_size=8, num_kv_heads=1, head_dim=4)
    storage.kv.copy_(torch.randn(storage.kv.shape))
    bm = BlockManager(num_blocks=8, block_size=8)
    parent = BlockSequence("p", list(range(12)))  # one full block, one partial (4 of 8 tokens)
    prefill(bm, parent)
    children = [BlockSequence(f"c{i}", list(range(12))) for i in range(3)]
    for child in children:
        bm.fork(parent, child)
    assert bm.num_free_blocks == 6, "a fork takes no block"
    assert [bm.blocks[b].ref_count for b in parent.block_table] == [4, 4]
    bm.check_invariants([parent, *children])
    full, partial = parent.block_table
    before = storage.read_blocks([partial])

    child = children[0]
    child.token_ids.append(100)  # its first own token lands in the shared partial block
    assert bm.can_append(child)
    copies = bm.append(child)
    assert copies == [(partial, child.block_table[1])] and child.block_table[0] == full
    storage.copy_blocks(copies)
    torch.testing.assert_close(storage.read_blocks(child.block_table[1:]), before, rtol=0, atol=0)
    assert bm.blocks[partial].ref_count == 3 and bm.blocks[child.block_table[1]].ref_count == 1
    child.token_ids.append(101)  # the next token writes into its own copy: nothing more to copy
    computed(child)
    assert bm.append(child) == [] and bm.num_free_blocks == 5
    bm.check_invariants([parent, *children])

    boundary = BlockSequence("b", list(range(16)))  # a fork at a block boundary: nothing to copy, ever
    prefill(bm, boundary)
    twin = BlockSequence("t", list(range(16)))
    bm.fork(boundary, twin)
    twin.token_ids.append(7)
    assert bm.append(twin) == [] and twin.block_table[:2] == boundary.block_table
    for seq in [parent, *children, boundary, twin]:
        bm.deallocate(seq)
    assert bm.num_free_blocks == 8, "blocks leaked"
    bm.check_invariants([])


def test_a_fork_recomputed_from_the_start_copies_every_shared_block_it_writes():
    """After an interrupted step, forked samples recompute their prompt and first tokens together: each
    writes its own token into the partial block they share, so that block (and the full one the same
    step rewrites) is copied, not only the block of the first token the step computes."""
    bm = BlockManager(num_blocks=8, block_size=4)
    parent = BlockSequence("p", list(range(6)))  # a full block and a partial one
    prefill(bm, parent)
    child = BlockSequence("c", list(range(6)))
    bm.fork(parent, child)
    child.token_ids.append(50)
    child.num_cached_tokens = 0  # the step that computed the prompt was interrupted before postprocess
    assert bm.shared_write_indexes(child) == [0, 1] and bm.can_append(child)
    copies = bm.append(child)
    assert [source for source, _ in copies] == parent.block_table
    assert not set(child.block_table) & set(parent.block_table)
    assert [bm.blocks[b].ref_count for b in parent.block_table] == [1, 1]
    bm.check_invariants([parent, child])


def test_copy_on_write_counts_the_copy_when_the_pool_is_short():
    bm = BlockManager(num_blocks=2, block_size=8)
    parent = BlockSequence("p", [1, 2, 3])
    prefill(bm, parent)
    child = BlockSequence("c", [1, 2, 3])
    bm.fork(parent, child)
    filler = BlockSequence("f", [9])
    bm.allocate(filler)  # the last free block
    child.token_ids.append(4)
    assert not bm.can_append(child)
    with pytest.raises(KVCacheExhausted, match="needs 1 more block"):
        bm.append(child)
    assert child.block_table == parent.block_table and bm.blocks[parent.block_table[0]].ref_count == 2
    bm.check_invariants([parent, child, filler])


def test_fork_errors_name_the_problem():
    bm = BlockManager(num_blocks=4, block_size=8)
    parent = BlockSequence("p", [1, 2, 3])
    with pytest.raises(ValueError, match="holds no blocks to fork"):
        bm.fork(parent, BlockSequence("c", [1, 2, 3]))
    prefill(bm, parent)
    with pytest.raises(ValueError, match="cannot fork into itself"):
        bm.fork(parent, BlockSequence("p", [1, 2, 3]))
    with pytest.raises(ValueError, match="does not start with the tokens"):
        bm.fork(parent, BlockSequence("c", [1, 2, 4]))
    child = BlockSequence("c", [1, 2, 3])
    bm.fork(parent, child)
    with pytest.raises(ValueError, match="already holds blocks"):
        bm.fork(parent, child)
    bm.check_invariants([parent, child])
    # a prompt of 12 tokens (2 blocks) with 6 computed: a child whose tokens 6.. differ would write its own
    # into the second block, still shared, which one copy-on-write copy cannot prevent (a student reviewer's case)
    half = BlockSequence("half", list(range(12)))
    bm.allocate(half)
    half.num_cached_tokens = 6
    with pytest.raises(ValueError, match="does not start with the tokens of 'half'"):
        bm.fork(half, BlockSequence("c2", list(range(6)) + [99] * 6))
    bm.check_invariants([parent, child, half])


def test_storage_copy_blocks_copies_every_layer_and_checks_ids():
    storage = PagedKVStorage(num_layers=3, num_blocks=4, block_size=8, num_kv_heads=2, head_dim=4)
    storage.kv.copy_(torch.randn(storage.kv.shape))
    source = storage.read_blocks([1, 2])
    storage.copy_blocks([(1, 0), (2, 3)])
    torch.testing.assert_close(storage.read_blocks([0, 3]), source, rtol=0, atol=0)
    with pytest.raises(ValueError, match="block id 4 is outside 0..3"):
        storage.copy_blocks([(4, 0)])
