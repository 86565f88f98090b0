"""The engine's plug-in parts (course/labkit_course/engine_parts.py): labkit's defaults and independently written
parts give the unmodified engine's tokens; wrong parts give other tokens or a PartError naming them;
a part that raises leaks no block and no request.

Most tests use a small random-weights model (fast); one uses SmolLM2 for a batch that preempts.
"""

import dataclasses
import re
import warnings

import pytest
import torch

from labkit.cache.block_manager import hash_block
from labkit.cache.paged_storage import PagedKVStorage
from labkit.cache.sequence_blocks import BlockSequence
from labkit.engine import LLM, FinishReason
from labkit.engine.components import EngineComponents
from labkit.model.random_weights import SMOLLM2_135M, random_model
from labkit.sampling import SamplingParams
from labkit.tokenizer import placeholder_tokenizer
from labkit_course.engine_parts import EngineParts, PartError

GREEDY = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
SEEDED = SamplingParams(temperature=1.0, top_k=40, top_p=0.9, seed=7, max_tokens=16, ignore_eos=True)
# The second prompt shares the first's first 16 tokens (prefix-cache hits once the first ran);
# 12 blocks of 8 cannot hold all four at full length, so the engine preempts.
PROMPTS = [list(range(1, 30)), list(range(1, 17)) + [7, 8, 9], [5] * 9, list(range(100, 140))]


# --- independently written parts: plain Python and torch, no labkit calls -----------------------
def plain_top_k(logits, k):
    kth = logits.sort(dim=-1, descending=True).values[:, k - 1:k]
    return torch.where(logits >= kth, logits, torch.full_like(logits, float("-inf")))


def plain_top_p(logits, top_p):
    probs, order = logits.softmax(-1).sort(dim=-1, descending=True)
    before = probs.cumsum(-1) - probs  # the mass of the tokens ranked above each one
    drop = torch.zeros_like(logits, dtype=torch.bool).scatter(-1, order, before >= top_p)
    return logits.masked_fill(drop, float("-inf"))


def plain_prefix(token_ids, block_size, hash_to_block, blocks):
    found, prev = [], None
    for start in range(0, len(token_ids) - 1 - block_size + 1, block_size):
        chunk = tuple(token_ids[start:start + block_size])
        prev = hash_block(prev, chunk)
        if prev not in hash_to_block or blocks[hash_to_block[prev]].token_ids != chunk:
            return found
        found.append(hash_to_block[prev])
    return found


def plain_take(free_uncached, free_cached, hash_to_block, blocks):
    if len(free_uncached):
        block_id = free_uncached.popleft()
    else:
        block_id = next(iter(free_cached))
        del free_cached[block_id]
        hash_to_block.pop(blocks[block_id].hash)
        blocks[block_id].hash = None
        blocks[block_id].token_ids = None
    blocks[block_id].ref_count = 1
    return block_id


def plain_can_append(num_tokens, num_blocks_held, block_size, num_free_blocks):
    blocks = (num_tokens + block_size - 1) // block_size
    return blocks <= num_blocks_held + num_free_blocks


def plain_schedule(running, waiting, token_budget, max_num_seqs, free_blocks):
    plan = [(r, 1) for r in running]
    left = token_budget - len(running)
    queue = sorted(waiting, key=lambda r: r.arrival)
    queue.sort(key=lambda r: r.priority, reverse=True)  # stable: arrival breaks ties
    for req in queue:
        if not left or len(plan) == max_num_seqs or req.blocks > free_blocks:
            break
        take = min(left, req.prompt_len)
        plan.append((req.id, take))
        left, free_blocks = left - take, free_blocks - req.blocks
    return plan


def plain_prepare(token_ids, num_computed, num_new, block_tables, block_size):
    ids, positions, slots, cu_q, cu_k = [], [], [], [0], [0]
    for tokens, start, n, table in zip(token_ids, num_computed, num_new, block_tables, strict=True):
        for pos in range(start, start + n):
            ids.append(tokens[pos])
            positions.append(pos)
            slots.append(table[pos // block_size] * block_size + pos % block_size)
        cu_q.append(cu_q[-1] + n)
        cu_k.append(cu_k[-1] + start + n)
    width = max(len(t) for t in block_tables)
    tables = [t + [-1] * (width - len(t)) for t in block_tables]
    return {name: torch.tensor(value) for name, value in [
        ("input_ids", ids), ("positions", positions), ("cu_seqlens_q", cu_q), ("cu_seqlens_k", cu_k),
        ("slot_mapping", slots), ("block_tables", tables)]}


PLAIN = EngineParts(top_k_filter=plain_top_k, top_p_filter=plain_top_p, cached_prefix_blocks=plain_prefix,
                    take_free_block=plain_take, can_append=plain_can_append, schedule_step=plain_schedule,
                    prepare_step=plain_prepare)


@pytest.fixture(scope="module")
def small():
    config = dataclasses.replace(SMOLLM2_135M, num_layers=2, vocab_size=512, hidden_size=64, intermediate_size=128,
                                 num_heads=4, num_kv_heads=2, head_dim=16)
    return random_model(config, seed=1), placeholder_tokenizer(512)


def run(model_and_tokenizer, prompts=PROMPTS, params=GREEDY, parts=None, **kwargs):
    """Generate with labkit's own components, or with the adapters asking `parts`."""
    model, tokenizer = model_and_tokenizer
    kwargs = {"block_size": 8, "num_kvcache_blocks": 12, "max_num_batched_tokens": 32, "max_model_len": 96} | kwargs
    if parts is not None:
        kwargs["components"] = parts.components()
    llm = LLM(model, tokenizer=tokenizer, **kwargs)
    outputs = llm.generate(prompts, params)
    assert_no_leak(llm)
    return [o.token_ids for o in outputs], llm


def assert_no_leak(llm):
    assert not llm.has_unfinished_requests()
    assert not llm.scheduler.has_unfinished
    llm.block_manager.check_invariants([])
    assert llm.block_manager.num_used_blocks == 0


@pytest.mark.parametrize("params", [GREEDY, SEEDED], ids=["greedy", "seeded"])
@pytest.mark.parametrize("parts", [EngineParts(), PLAIN], ids=["labkit-defaults", "plain-python"])
def test_parts_give_the_unmodified_engines_tokens(small, parts, params):
    expected, reference = run(small, params=params)
    got, llm = run(small, params=params, components=parts.components())
    assert reference.metrics.num_preemptions > 0 and reference.block_manager.stats.hit_tokens > 0  # both paths ran
    assert got == expected
    assert llm.metrics.num_preemptions == reference.metrics.num_preemptions
    assert llm.block_manager.stats.hit_tokens == reference.block_manager.stats.hit_tokens


def test_parts_must_be_callables_in_an_engine_parts(small):
    with pytest.raises(TypeError, match="engine part `prepare_step` must be callable, or None for labkit's own"):
        EngineParts(prepare_step="prepare_step")
    with pytest.raises(TypeError, match="components must be an EngineComponents"):
        LLM(small[0], tokenizer=small[1], components=EngineParts())  # its .components() is the hook
    with pytest.raises(TypeError, match="EngineComponents.scheduler must be a class or callable"):
        EngineComponents(scheduler="Scheduler")


def test_off_by_one_slot_mapping_changes_the_tokens(small):
    def shifted(*args):
        step = plain_prepare(*args)
        step["slot_mapping"] = step["slot_mapping"] + 1
        return step

    expected, _ = run(small)
    with pytest.warns(UserWarning, match="slot_mapping .* outside the cache's"):  # the very last slot + 1
        got, _ = run(small, parts=EngineParts(prepare_step=shifted))
    assert got != expected
    assert sum(map(len, got)) > 0  # the others ran, with K/V in the wrong slots


def test_a_filter_keeping_one_token_too_many_changes_sampled_tokens(small):
    def one_too_many(logits, k):
        return plain_top_k(logits, k + 1)

    params = dataclasses.replace(SEEDED, top_k=2, top_p=1.0, max_tokens=24)
    expected, _ = run(small, params=params)
    got, _ = run(small, params=params, parts=EngineParts(top_k_filter=one_too_many))
    assert got != expected


@pytest.mark.parametrize(("name", "wrong", "message"), [
    ("prepare_step", lambda *a: {k: v for k, v in plain_prepare(*a).items() if k != "positions"},
     "must return a dict with keys"),
    ("prepare_step", lambda *a: plain_prepare(*a) | {"cu_seqlens_q": plain_prepare(*a)["cu_seqlens_k"]},
     "cu_seqlens_q .* must be the running sum of the new tokens"),
    ("can_append", lambda *a: True, "answered True"),
    ("schedule_step", lambda running, waiting, *a: [(r.id, r.prompt_len) for r in waiting],
     "tokens of budget are left|the plan must start"),
    ("cached_prefix_blocks", lambda token_ids, bs, table, blocks: list(range(len(token_ids) // bs)),
     "at most .* full blocks before the last token"),
    ("take_free_block", lambda uncached, cached, table, blocks: 0, "still in a free list|ref_count"),
    ("top_p_filter", lambda logits, p: torch.full_like(logits, float("-inf")), "removed every token"),
])
def test_a_wrong_part_is_named_and_leaks_nothing(small, name, wrong, message):
    model, tokenizer = small
    llm = LLM(model, tokenizer=tokenizer, block_size=8, num_kvcache_blocks=12, max_num_batched_tokens=32,
              max_model_len=96, components=dataclasses.replace(PLAIN, **{name: wrong}).components())
    assert re.search(f"engine part `{name}`: .*({message})", failure(llm, PROMPTS, SEEDED))
    assert_no_leak(llm)


@pytest.mark.parametrize(("name", "wrong", "message"), [
    # Each would leave the engine looping forever without a token: it stops, naming the part. (Without
    # the prefix cache, a prompt preempted after each chunk starts again from nothing.)
    ("prepare_step", lambda *a: plain_prepare(*a) | {"cu_seqlens_k": torch.tensor(
        [0, *torch.tensor(a[2]).cumsum(0).tolist()])}, "counts only the new tokens"),
    ("schedule_step", lambda running, waiting, *a: [(r, 1) for r in running], "planned nothing although nothing runs"),
    ("can_append", lambda *a: False, "answered False .* although the free blocks were enough"),
])
def test_a_part_that_stalls_the_engine_is_named(small, name, wrong, message):
    model, tokenizer = small
    llm = LLM(model, tokenizer=tokenizer, block_size=8, num_kvcache_blocks=12, max_num_batched_tokens=8,
              max_model_len=96, enable_prefix_caching=False,
              components=dataclasses.replace(PLAIN, **{name: wrong}).components())
    assert re.search(f"engine part `{name}`: .*({message})", failure(llm, PROMPTS, GREEDY))
    assert_no_leak(llm)


def test_can_append_decides_a_needless_false_preempts(small):
    """The part's answer is used: a False where the blocks were there preempts (and still finishes),
    a True where they were not stops the engine, naming the part."""
    expected, reference = run(small)
    strict = dataclasses.replace(PLAIN, can_append=lambda n, held, bs, free: -(-n // bs) - held < free)
    got, llm = run(small, parts=strict)
    assert llm.metrics.num_preemptions > reference.metrics.num_preemptions
    assert llm.block_manager.needless_preemptions > 0
    model, tokenizer = small
    llm = LLM(model, tokenizer=tokenizer, block_size=8, num_kvcache_blocks=12, max_num_batched_tokens=32,
              max_model_len=96, components=dataclasses.replace(PLAIN, can_append=lambda *a: True).components())
    assert re.search("engine part `can_append`: answered True .* the next token has no KV slot",
                     failure(llm, PROMPTS, GREEDY))
    assert_no_leak(llm)


def failure(llm, prompts, params) -> str:
    """What the engine says about a failing part: a PartError out of the batch, or (when it failed
    for each request on its own, as the engine isolates them) the requests' error finish."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        try:
            outputs = llm.generate(prompts, params)
        except PartError as error:
            return str(error)
    errors = [o.outputs[0].stop_reason for o in outputs if o.outputs[0].finish_reason is FinishReason.ERROR]
    assert errors, "a wrong part went unnoticed"
    return errors[0]


def test_a_part_raising_midway_leaves_no_block_or_request_behind(small):
    calls = {"take": 0, "prepare": 0}

    def flaky_take(*args):
        calls["take"] += 1
        if calls["take"] == 9:  # in the middle of some allocation
            raise RuntimeError("disk on fire")
        return plain_take(*args)

    def flaky_prepare(*args):
        calls["prepare"] += 1
        if calls["prepare"] >= 4:  # from the 4th step on: the engine's retry of each request alone fails too
            raise ValueError("bad step")
        return plain_prepare(*args)

    for parts, message in [(EngineParts(take_free_block=flaky_take), "`take_free_block`: raised RuntimeError"),
                           (EngineParts(prepare_step=flaky_prepare), "`prepare_step`: raised ValueError")]:
        model, tokenizer = small
        llm = LLM(model, tokenizer=tokenizer, block_size=8, num_kvcache_blocks=12, max_num_batched_tokens=32,
                  max_model_len=96, components=parts.components())
        assert message in failure(llm, PROMPTS, GREEDY)
        assert_no_leak(llm)


def test_a_take_free_block_failing_in_swap_in_keeps_the_swapped_kv():
    fail = {"now": False}

    def take(*args):
        if fail["now"]:
            raise RuntimeError("student bug")
        return plain_take(*args)

    manager = EngineParts(take_free_block=take).components().block_manager(8, 8)
    storage = PagedKVStorage(num_layers=1, num_blocks=8, block_size=8, num_kv_heads=1, head_dim=4)
    seq = BlockSequence("s", list(range(20)))
    manager.allocate(seq)
    manager.swap_out(seq, storage)
    fail["now"] = True
    with pytest.raises(PartError, match="take_free_block"):
        manager.swap_in(seq, storage)
    assert manager.is_swapped(seq) and seq.block_table == [] and manager.num_free_blocks == 8
    fail["now"] = False
    manager.swap_in(seq, storage)
    assert len(seq.block_table) == 3
    manager.check_invariants([seq])


def test_smollm2_with_plain_parts_matches_through_preemption():
    """SmolLM2 itself: four prompts, greedy and seeded, in 5 blocks of 16: the engine preempts, and the
    independently written parts give labkit's tokens."""
    from labkit_course.grading.labs.lab11 import smollm2_cpu  # one load per process, shared with the capstone's grader

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        model, tokenizer = smollm2_cpu()
        prompts = ["The capital of France is", "The capital of France is a city where",
                   "1, 2, 3, 4,", "Once upon a time, in a small village at the edge of a forest,"]
        params = [dataclasses.replace(GREEDY, max_tokens=8), dataclasses.replace(SEEDED, max_tokens=8)] * 2
        kwargs = {"block_size": 16, "num_kvcache_blocks": 5, "max_num_batched_tokens": 48, "max_model_len": 64}
        expected, reference = run((model, tokenizer), prompts, params, **kwargs)
        got, _ = run((model, tokenizer), prompts, params, parts=PLAIN, **kwargs)
        assert reference.metrics.num_preemptions > 0
        assert got == expected
    finally:
        torch.set_num_threads(threads)


def test_the_grading_codec_carries_what_the_parts_are_given():
    """The capstone calls a student's parts in their kernel: every argument the engine passes must
    cross the grading channel (the waiting requests, Blocks in an OrderedDict/deque pool, 128-bit
    hashes) and the pool's mutations must come back."""
    from collections import OrderedDict, deque

    from grading_support import write_back

    from labkit.cache.block_manager import Block
    from labkit_course.engine_parts import Request
    from labkit_course.grading.codec import Decoder, Encoder, dumps, loads

    blocks = [Block(0), Block(1, 0, 2**127 + 5, (1, 2))]
    value = [[Request("seq3", 2, 7, 40, 3)], deque([0]), OrderedDict([(1, None)]), {2**127 + 5: 1}, blocks]
    sender, receiver = Encoder(), Decoder(may_import=True)
    decoded = receiver.decode(loads(dumps(sender.encode(value))))
    assert decoded[0] == [Request("seq3", 2, 7, 40, 3)] and decoded[3] == {2**127 + 5: 1}
    plain_take(*decoded[1:4], decoded[4])  # the student's side takes block 0
    write_back(sender, receiver)
    assert list(value[1]) == [] and blocks[0].ref_count == 1
