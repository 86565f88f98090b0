"""Hypothesis drives the BlockManager through random interleavings of an engine's calls.

A model of the KV cache records, for every block, which token prefix its K/V was computed for.
After every step: the manager's invariants hold (reference counts equal table references, no
block both free and used, every hash entry points at matching content), every prefix hit serves
K/V computed for exactly that prefix, and no sequence ever writes into a block it shares: forked
sequences (parallel samples, beams) share their parent's blocks and copy a shared partial block
only when they write into it (copy-on-write), and the copy carries the parent's K/V.
"""

from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from labkit.cache.block_manager import BlockManager, KVCacheExhausted
from labkit.cache.sequence_blocks import BlockSequence

BLOCK_SIZE = 2
NUM_BLOCKS = 8
PREFIXES = [(), (1, 2, 3, 4), (1, 2, 5, 6), (3, 4, 1, 2)]  # shared "system prompts"


class FakeStorage:
    """Swap target over the content model: a block's "K/V" is the prefix it was computed for."""

    def __init__(self, content):
        self.content = content

    def read_blocks(self, block_ids):
        return [self.content.get(b) for b in block_ids]

    def write_blocks(self, block_ids, data):
        for b, c in zip(block_ids, data, strict=True):
            self.content[b] = c

    def copy_blocks(self, pairs):
        for source, destination in pairs:
            self.content[destination] = self.content.get(source)


class BlockManagerMachine(RuleBasedStateMachine):
    def __init__(self):
        super().__init__()
        self.bm = BlockManager(NUM_BLOCKS, BLOCK_SIZE)
        self.content = {}
        self.storage = FakeStorage(self.content)
        self.waiting, self.running, self.swapped = [], [], []
        self.next_id = 0

    def compute(self, seq):
        """The engine's forward step: write K/V for every token not yet cached, into owned blocks."""
        for p in range(seq.num_cached_tokens, len(seq.token_ids)):
            block = seq.block_table[p // BLOCK_SIZE]
            assert self.bm.blocks[block].ref_count == 1, "a sequence wrote into a shared block"
            self.content[block] = tuple(seq.token_ids[: p + 1])
        seq.num_cached_tokens = len(seq.token_ids)

    @rule(prefix=st.sampled_from(PREFIXES), suffix=st.lists(st.integers(1, 6), min_size=0, max_size=5))
    def arrive(self, prefix, suffix):
        tokens = list(prefix) + suffix or [1]
        self.waiting.append(BlockSequence(self.next_id, tokens))
        self.next_id += 1

    @precondition(lambda self: self.waiting)
    @rule(data=st.data())
    def schedule_prefill(self, data):
        seq = data.draw(st.sampled_from(self.waiting))
        if not self.bm.can_allocate(seq):
            try:
                self.bm.allocate(seq)
            except KVCacheExhausted:
                return
            raise AssertionError("allocate succeeded although can_allocate said no")
        self.bm.allocate(seq)
        hit = seq.num_cached_tokens
        assert hit % BLOCK_SIZE == 0 and hit < len(seq.token_ids)
        for i in range(hit // BLOCK_SIZE):  # every hit serves K/V of exactly this prefix
            assert self.content.get(seq.block_table[i]) == tuple(seq.token_ids[: (i + 1) * BLOCK_SIZE])
        self.compute(seq)
        self.waiting.remove(seq)
        self.running.append(seq)

    @precondition(lambda self: self.running)
    @rule(data=st.data(), token=st.integers(1, 6))
    def decode(self, data, token):
        seq = data.draw(st.sampled_from(self.running))
        seq.token_ids.append(token)
        if self.bm.can_append(seq):
            copies = self.bm.append(seq)
            assert len(copies) <= 1 and all(self.bm.blocks[d].ref_count == 1 for _, d in copies)
            self.storage.copy_blocks(copies)
            for i, block in enumerate(seq.block_table[:-1]):  # what is already there is this sequence's K/V
                if (i + 1) * BLOCK_SIZE <= seq.num_cached_tokens:
                    assert self.content[block][: (i + 1) * BLOCK_SIZE] == tuple(seq.token_ids[: (i + 1) * BLOCK_SIZE])
            self.compute(seq)
        else:  # preempt by recomputation, as a scheduler would
            self.bm.deallocate(seq)
            self.running.remove(seq)
            self.waiting.append(seq)

    @precondition(lambda self: self.running)
    @rule(data=st.data())
    def fork(self, data):
        """A parallel sample or a beam: a new sequence sharing every block of a running one."""
        parent = data.draw(st.sampled_from(self.running))
        child = BlockSequence(self.next_id, list(parent.token_ids))
        self.next_id += 1
        free_before = self.bm.num_free_blocks
        self.bm.fork(parent, child)
        assert self.bm.num_free_blocks == free_before, "a fork must not take blocks"
        assert child.block_table == parent.block_table and child.num_cached_tokens == parent.num_cached_tokens
        self.running.append(child)

    @precondition(lambda self: self.running)
    @rule(data=st.data(), preempt=st.booleans())
    def finish_or_preempt(self, data, preempt):
        seq = data.draw(st.sampled_from(self.running))
        self.bm.deallocate(seq)
        assert seq.block_table == [] and seq.num_cached_tokens == 0
        self.running.remove(seq)
        if preempt:
            self.waiting.append(seq)

    @precondition(lambda self: self.running)
    @rule(data=st.data())
    def swap_out(self, data):
        seq = data.draw(st.sampled_from(self.running))
        self.bm.swap_out(seq, self.storage)
        self.running.remove(seq)
        self.swapped.append(seq)

    @precondition(lambda self: self.swapped)
    @rule(data=st.data(), abort=st.booleans())
    def swap_in_or_abort(self, data, abort):
        seq = data.draw(st.sampled_from(self.swapped))
        if abort:
            self.bm.deallocate(seq)
            self.swapped.remove(seq)
        elif self.bm.can_swap_in(seq):
            self.bm.swap_in(seq, self.storage)
            for i, block in enumerate(seq.block_table):  # the K/V came back intact
                end = min((i + 1) * BLOCK_SIZE, seq.num_cached_tokens)
                assert self.content[block] == tuple(seq.token_ids[:end])
            self.swapped.remove(seq)
            self.running.append(seq)

    @invariant()
    def consistent(self):
        self.bm.check_invariants(self.running)
        used = sum(len(s.block_table) > 0 for s in self.running)
        assert used == len(self.running)
        assert all(s.block_table == [] for s in self.waiting + self.swapped)
        assert all(self.bm.is_swapped(s) for s in self.swapped)

    def teardown(self):
        for seq in self.running + self.swapped:
            self.bm.deallocate(seq)
        assert self.bm.num_free_blocks == NUM_BLOCKS, "blocks leaked"
        self.bm.check_invariants([])


TestBlockManagerStateful = BlockManagerMachine.TestCase
TestBlockManagerStateful.settings = settings(max_examples=60, stateful_step_count=40, deadline=None)
