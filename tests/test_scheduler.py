"""The scheduler's policy on the real BlockManager, with a fake model step (no weights needed)."""

import random

import pytest

from labkit.cache.block_manager import BlockManager
from labkit.cache.paged_storage import PagedKVStorage
from labkit.engine.scheduler import Scheduler, SchedulerConfig
from labkit.engine.sequence import FinishReason, Sequence, SequenceStatus
from labkit.sampling import SamplingParams


def make(num_blocks=16, block_size=8, swap=False, **config):
    config.setdefault("max_model_len", 256)
    bm = BlockManager(num_blocks, block_size)
    storage = PagedKVStorage(1, num_blocks, block_size, 1, 2) if swap else None
    return Scheduler(SchedulerConfig(preemption_mode="swap" if swap else "recompute", **config), bm, storage)


def seq(n_prompt, max_tokens=4, priority=0, first=1):
    return Sequence(list(range(first, first + n_prompt)), SamplingParams(max_tokens=max_tokens, ignore_eos=True),
                    priority=priority)


def fake_step(sched):
    """Schedule, 'run the model' (each sampled sequence gets token 7), postprocess. Returns the plan."""
    out = sched.schedule()
    for s, n in zip(out.seqs, out.num_new_tokens, strict=True):
        if s.num_cached_tokens + n == s.num_tokens:
            s.append_token(7)
            if s.num_output_tokens == s.params.max_tokens:
                s.finish(FinishReason.MAX_TOKENS)
    sched.postprocess(out)
    return out


def run_to_end(sched, max_steps=1000):
    trace = []
    while sched.has_unfinished:
        trace.append(fake_step(sched))
        assert len(trace) < max_steps, "scheduler made no progress"
    return trace


def assert_no_leak(sched):
    bm = sched.block_manager
    bm.check_invariants([])
    assert bm.num_used_blocks == 0


def test_batches_under_max_num_seqs_and_token_budget():
    sched = make(num_blocks=64, max_num_seqs=3, max_num_batched_tokens=20)
    seqs = [seq(6, first=10 * i + 1) for i in range(5)]
    for s in seqs:
        sched.add(s)
    out = sched.schedule()
    assert out.seqs == seqs[:3]  # three fit max_num_seqs; 18 tokens fit the budget of 20
    assert out.num_new_tokens == [6, 6, 6]
    assert [s.status for s in seqs] == [SequenceStatus.RUNNING] * 3 + [SequenceStatus.WAITING] * 2
    trace = [out] + (sched.postprocess(out) and []) + run_to_end(sched)
    assert all(len(o.seqs) <= 3 and o.num_batched_tokens <= 20 for o in trace)
    assert all(s.finish_reason is FinishReason.MAX_TOKENS and s.num_output_tokens == 4 for s in seqs)
    assert_no_leak(sched)


def test_chunked_prefill_shares_steps_with_decodes():
    sched = make(num_blocks=32, max_num_batched_tokens=8)
    short = seq(4, max_tokens=6)
    sched.add(short)
    fake_step(sched)  # short's prompt
    long = seq(20, max_tokens=2, first=50)
    sched.add(long)
    plans = [fake_step(sched) for _ in range(3)]
    # Each step: short decodes 1 token, long prefills a chunk of what the budget leaves.
    assert [dict(zip(p.seqs, p.num_new_tokens, strict=True)) for p in plans] == [
        {short: 1, long: 7}, {short: 1, long: 7}, {short: 1, long: 6}]
    assert long.num_output_tokens == 1  # sampled only when its last chunk ran
    run_to_end(sched)
    assert_no_leak(sched)


def test_chunked_prefill_off_waits_for_a_whole_prompt():
    sched = make(num_blocks=32, max_num_batched_tokens=64, max_model_len=64, enable_chunked_prefill=False)
    a, b = seq(40), seq(30, first=100)
    sched.add(a)
    sched.add(b)
    out = sched.schedule()
    assert out.seqs == [a] and out.num_new_tokens == [40]


def test_priority_then_arrival_order():
    sched = make(num_blocks=64, max_num_seqs=1)
    low, normal1, vip, normal2 = seq(3, priority=-5), seq(3), seq(3, priority=10), seq(3)
    for s in (low, normal1, vip, normal2):
        sched.add(s)
    order = []
    for out in run_to_end(sched):
        if out.seqs and out.seqs[0] not in order:
            order.append(out.seqs[0])
    assert order == [vip, normal1, normal2, low]


@pytest.mark.parametrize("swap", [False, True])
def test_preemption_picks_the_lowest_priority_victim(swap):
    # 4 blocks of 8 tokens; three sequences of 8 prompt tokens each need a second block to decode.
    sched = make(num_blocks=4, block_size=8, swap=swap, max_model_len=32)
    hi, mid, lo = seq(8, 8, priority=2), seq(8, 8, priority=1, first=20), seq(8, 8, priority=0, first=40)
    for s in (lo, mid, hi):
        sched.add(s)
    fake_step(sched)  # all three prefill: 3 blocks used
    out = fake_step(sched)  # hi takes the 4th block; mid needs one: lo is the victim
    victims = out.swapped_out if swap else out.preempted
    assert victims == [lo] and lo.num_preemptions == 1
    assert lo.status is (SequenceStatus.SWAPPED if swap else SequenceStatus.WAITING)
    assert lo.block_table == [] and lo.num_output_tokens == 1
    run_to_end(sched)
    assert all(s.num_output_tokens == 8 and s.finish_reason is FinishReason.MAX_TOKENS for s in (hi, mid, lo))
    if not swap:  # recomputed: the prompt and the token it had generated were prefilled again
        assert lo.num_swaps == 0
    else:
        assert lo.num_swaps >= 1
    assert_no_leak(sched)


def test_swapped_kv_comes_back_intact():
    sched = make(num_blocks=4, block_size=8, swap=True, max_model_len=32)
    hi, lo = seq(8, 16, priority=1), seq(16, 8, first=30)
    sched.add(hi)
    sched.add(lo)
    fake_step(sched)  # hi: 1 block, lo: 2 blocks
    storage = sched.kv_storage
    for i, b in enumerate(lo.block_table):
        storage.kv[:, :, b] = float(i + 1)
    while lo.status is not SequenceStatus.SWAPPED:
        fake_step(sched)
    while lo.status is SequenceStatus.SWAPPED:
        fake_step(sched)
    assert [storage.kv[0, 0, b, 0, 0, 0].item() for b in lo.block_table[:2]] == [1.0, 2.0]
    run_to_end(sched)
    assert_no_leak(sched)


def test_impossible_requests_are_rejected_at_once():
    sched = make(num_blocks=4, block_size=8, max_model_len=64)
    with pytest.raises(ValueError, match="max_model_len"):
        sched.add(seq(64))
    with pytest.raises(ValueError, match="KV blocks"):
        sched.add(seq(20, max_tokens=20))  # 40 tokens need 5 blocks of 8; the cache has 4
    assert not sched.has_unfinished
    ok = seq(20, max_tokens=12)  # exactly 4 blocks: fits
    sched.add(ok)
    run_to_end(sched)
    assert ok.num_output_tokens == 12
    assert_no_leak(sched)


def test_prefix_cache_admits_what_would_not_fit_without_it():
    sched = make(num_blocks=5, block_size=8, max_model_len=64)
    first = seq(25, max_tokens=7)  # 32 tokens in all: 4 blocks
    sched.add(first)
    fake_step(sched)  # prefilled; its 3 full prompt blocks are now cached
    twin = Sequence(list(first.prompt_token_ids), SamplingParams(max_tokens=1, ignore_eos=True))
    # 1 block is free; the twin needs 4 blocks, 3 of them hits on blocks first holds.
    assert sched.block_manager.num_free_blocks == 1
    sched.add(twin)
    out = fake_step(sched)
    assert twin in out.seqs and twin.num_prefix_cached_tokens == 24
    assert dict(zip(out.seqs, out.num_new_tokens, strict=True))[twin] == 1
    run_to_end(sched)
    assert_no_leak(sched)


def test_abort_in_every_state_frees_everything():
    sched = make(num_blocks=4, block_size=8, swap=True, max_model_len=32)
    hi, lo, waiting = seq(8, 16, priority=1), seq(16, 8, first=30), seq(4, first=60)
    for s in (hi, lo):
        sched.add(s)
    while lo.status is not SequenceStatus.SWAPPED:
        fake_step(sched)
    sched.add(waiting)
    for s in (lo, waiting, hi):
        sched.abort(s)
        assert s.finish_reason is FinishReason.ABORTED
    assert not sched.has_unfinished
    assert_no_leak(sched)


@pytest.mark.parametrize("swap", [False, True])
def test_random_workload_finishes_without_deadlock_or_leak(swap):
    rng = random.Random(0)
    sched = make(num_blocks=12, block_size=8, swap=swap, max_num_seqs=6, max_num_batched_tokens=32,
                 max_model_len=96)
    seqs = []
    for i in range(30):
        s = seq(rng.randint(1, 60), max_tokens=rng.randint(1, 30), priority=rng.choice([0, 0, 1, -1]),
                first=rng.randint(1, 5) * 100 if i % 3 else 1)  # a third share a prefix
        sched.add(s)
        seqs.append(s)
        if i % 4 == 0:
            fake_step(sched)
            sched.block_manager.check_invariants(sched.running)
    trace = run_to_end(sched)
    assert all(s.num_output_tokens == s.params.max_tokens for s in seqs)
    assert sum(len(o.preempted) + len(o.swapped_out) for o in trace) > 0  # the cache really was tight
    assert_no_leak(sched)


def first_step_scheduled(trace, s):
    return next(i for i, out in enumerate(trace) if s in out.seqs)


@pytest.mark.parametrize("aging", [5, 20])
def test_aging_bounds_how_long_a_low_priority_request_waits(aging):
    """One sequence at a time and a new priority-3 request every step: strict priority would never
    run the priority-0 one. With aging it ranks ahead of every priority-3 request that arrived
    (3 - 0 + 1) * aging steps or more after it, so it runs within that many steps plus the
    service time (2 steps each) of the few that arrived before."""
    sched = make(num_blocks=64, max_num_seqs=1, priority_aging_steps=aging)
    low = seq(2, max_tokens=1)
    sched.add(low)
    trace = []
    while not low.is_finished:
        sched.add(seq(2, max_tokens=2, priority=3, first=10))
        trace.append(fake_step(sched))
        assert len(trace) <= 2 * (3 + 1) * aging + 2, "the low-priority request starved"
    assert first_step_scheduled(trace, low) >= 3 * aging  # before that it ranks below every new arrival
    for s in sched.waiting:
        sched.abort(s)
    run_to_end(sched)
    assert_no_leak(sched)


def test_without_aging_priority_is_strict_and_starves():
    sched = make(num_blocks=64, max_num_seqs=1, priority_aging_steps=None)
    low = seq(2, max_tokens=1)
    sched.add(low)
    for _ in range(300):
        sched.add(seq(2, max_tokens=2, priority=3, first=10))
        fake_step(sched)
    assert low.first_scheduled_time is None


def test_a_preempted_request_comes_back_despite_newer_higher_priority_work():
    # 4 blocks of 4 tokens. lo (priority 0) is preempted by higher-priority work that keeps arriving.
    sched = make(num_blocks=4, block_size=4, max_model_len=32, priority_aging_steps=8)
    lo = seq(4, max_tokens=8)
    sched.add(lo)
    fake_step(sched)
    steps = 0
    while not lo.is_finished:
        if len(sched.waiting) + len(sched.running) < 4:
            sched.add(seq(4, max_tokens=8, priority=2, first=50))
        fake_step(sched)
        steps += 1
        assert steps < 400, "the preempted request never came back"
    assert lo.num_preemptions >= 1 and lo.num_output_tokens == 8
    for s in sched.waiting + sched.running:
        sched.abort(s)
    assert_no_leak(sched)


def test_a_long_prompt_leaves_a_token_to_every_decode_and_respects_the_prefill_cap():
    sched = make(num_blocks=64, max_num_batched_tokens=16, long_prefill_token_threshold=6)
    decoders = [seq(3, max_tokens=30, first=10 * i + 1) for i in range(3)]
    for s in decoders:
        sched.add(s)
    fake_step(sched)  # their prompts
    vip = seq(60, max_tokens=2, priority=9, first=200)
    sched.add(vip)
    chunks = []
    while vip.num_output_tokens == 0:
        out = fake_step(sched)
        plan = dict(zip(out.seqs, out.num_new_tokens, strict=True))
        assert all(plan.get(s) == 1 for s in decoders)  # every decode advanced in every step
        chunks.append(plan[vip])
    assert max(chunks) == 6 and sum(chunks) == 60
    run_to_end(sched)
    assert_no_leak(sched)


def test_without_a_cap_a_high_priority_prompt_still_leaves_the_decodes_their_tokens():
    sched = make(num_blocks=64, max_num_batched_tokens=16)
    decoders = [seq(3, max_tokens=30, first=10 * i + 1) for i in range(3)]
    for s in decoders:
        sched.add(s)
    fake_step(sched)
    vip = seq(60, max_tokens=2, priority=9, first=200)
    sched.add(vip)
    while vip.num_output_tokens == 0:
        remaining = vip.num_uncomputed_tokens
        out = fake_step(sched)
        plan = dict(zip(out.seqs, out.num_new_tokens, strict=True))
        assert all(plan.get(s) == 1 for s in decoders) and plan[vip] == min(13, remaining)
    run_to_end(sched)
    assert_no_leak(sched)


def share_all_blocks(sched, parent, child):
    """What a copy-on-write fork (n > 1, beam search) leaves: the child lists every block of its parent."""
    child.block_table = list(parent.block_table)
    for b in child.block_table:
        sched.block_manager.blocks[b].ref_count += 1
    child.num_cached_tokens = parent.num_cached_tokens
    child.status = SequenceStatus.RUNNING
    sched.running.append(child)


def test_preemption_skips_victims_whose_release_frees_no_block():
    # 5 blocks of 4 tokens; every prompt fills one block, so each sequence's next token needs a new one.
    # fork (lowest priority) shares mid's only block: releasing it frees nothing and gives own nothing.
    sched = make(num_blocks=5, block_size=4, max_model_len=32)
    hi, mid, own = seq(4, 8, priority=3), seq(4, 8, priority=2, first=20), seq(4, 8, priority=1, first=40)
    for s in (hi, mid, own):
        sched.add(s)
    fake_step(sched)  # hi, mid, own: one block each; two are free
    fork = Sequence(list(mid.prompt_token_ids), mid.params, priority=0)
    fork.append_token(mid.output_token_ids[0])
    share_all_blocks(sched, mid, fork)
    sched.block_manager.check_invariants(sched.running)
    out = fake_step(sched)  # hi and mid take the free blocks; own needs one: fork would free nothing
    assert out.preempted == [own]
    assert fork in out.seqs and fork.block_table[0] == mid.block_table[0]
    sched.block_manager.check_invariants(sched.running)
    run_to_end(sched)
    assert_no_leak(sched)


def test_preempting_the_only_other_holder_of_a_shared_partial_block_spares_its_copy():
    # 5 blocks of 4 tokens. fork shares both of mid's blocks, the partial one mid writes into next:
    # mid needs a copy-on-write block, and releasing fork (the lowest) makes the block mid's alone.
    sched = make(num_blocks=5, block_size=4, max_model_len=32)
    hi, mid, own = seq(4, 8, priority=3), seq(6, 8, priority=2, first=20), seq(4, 8, priority=1, first=40)
    for s in (hi, mid, own):
        sched.add(s)
    fake_step(sched)  # hi: 1 block, mid: 2, own: 1; one block is free
    fork = Sequence(list(mid.prompt_token_ids), mid.params, priority=0)
    fork.append_token(mid.output_token_ids[0])
    share_all_blocks(sched, mid, fork)
    mid_table = list(mid.block_table)
    out = fake_step(sched)  # hi takes the free block; mid's copy-on-write needs one more
    assert out.preempted[0] is fork  # not own, which ranks above it
    assert mid in out.seqs and mid.block_table == mid_table  # no copy was needed
    sched.block_manager.check_invariants(sched.running)
    run_to_end(sched)
    assert_no_leak(sched)
