"""Lab 10: the scheduler. The can_append rule, and planning one continuous-batching step."""

import random
from dataclasses import dataclass

from labkit.cache.block_manager import BlockManager
from labkit.cache.sequence_blocks import BlockSequence
from labkit.grading import ExerciseFailed, exercise, require


@exercise("10", "can_append", forbidden=(
    "labkit.cache.block_manager.BlockManager.can_append", "labkit.cache.block_manager.BlockManager._missing_blocks",
    "labkit.grading.labs.lab10.reference_can_append",
))
def can_append(ns):
    fn = require(ns, "can_append")
    rng = random.Random(10)
    cases = [(17, 2, 8, 0), (16, 2, 8, 0), (9, 1, 8, 1), (9, 1, 8, 0), (8, 1, 8, 0), (33, 4, 8, 1), (2, 1, 8, 0)]
    cases += [(n, -(-(n - 1) // bs), bs, rng.randint(0, 2))
              for bs in (8, 16, 32) for n in (rng.randint(2, 200) for _ in range(20))]
    answers = []
    for case in cases:
        got = fn(*case)
        if not isinstance(got, bool):
            raise ExerciseFailed(f"can_append must return True or False, got {got!r}")
        answers.append(got)
    wrong = [(case, got) for case, got in zip(cases, answers, strict=True) if got != reference_can_append(*case)]
    if wrong:
        for rule, why in _CAN_APPEND_MISTAKES:  # named only if the rule explains every case
            if all(got == rule(*case) for case, got in zip(cases, answers, strict=True)):
                raise ExerciseFailed(why)
        (num_tokens, held, block_size, free), got = wrong[0]
        raise ExerciseFailed(f"num_tokens={num_tokens}, num_blocks_held={held}, block_size={block_size}, "
                             f"num_free_blocks={free}: expected {not got}, got {got}")
    return "needs a free block exactly when the newest token starts a new block"


_CAN_APPEND_MISTAKES = (
    (lambda n, held, bs, free: free >= (n % bs == 0),
     "a new block is needed when the new token starts one, at num_tokens % block_size == 1, not == 0 (at 0 "
     "it is the last slot of a block already held)"),
    (lambda n, held, bs, free: True, "when the new token starts a new block (num_tokens % block_size == 1) and "
                                     "no block is free, it cannot append"),
    (lambda n, held, bs, free: free > 0, "a free block is needed only when the new token starts a new block "
                                         "(num_tokens % block_size == 1); otherwise it fits in the last block held"),
    (lambda n, held, bs, free: n % bs != 1, "when the new token starts a new block and a free block is there to "
                                            "take, it can append: compare with num_free_blocks"),
)


def reference_can_append(num_tokens: int, num_blocks_held: int, block_size: int, num_free_blocks: int) -> bool:
    """The real BlockManager's answer: a sequence holding blocks for its first num_tokens - 1 tokens
    has just been given one more token."""
    bm = BlockManager(num_blocks_held + num_free_blocks, block_size, enable_prefix_caching=False)
    seq = BlockSequence(0, list(range(num_tokens - 1)))
    bm.allocate(seq)
    seq.token_ids.append(0)
    return bm.can_append(seq)


@dataclass(frozen=True)
class Request:
    """A waiting request as the exercise sees it."""

    id: str
    priority: int  # higher runs first
    arrival: int  # earlier runs first among equal priorities
    prompt_len: int  # tokens still to prefill
    blocks: int  # KV blocks it needs to be admitted


def reference_schedule_step(running, waiting, token_budget, max_num_seqs, free_blocks, *, order=None,
                            skip_misfits=False, chunked=True):
    """The policy of labkit's Scheduler, on plain records. The keyword arguments re-create typical
    mistakes, so a wrong plan can be named."""
    plan = [(rid, 1) for rid in running[:token_budget]]
    budget = token_budget - len(plan)
    for req in sorted(waiting, key=order or (lambda r: (-r.priority, r.arrival))):
        if budget == 0 or len(plan) >= max_num_seqs:
            break
        if req.blocks > free_blocks or (not chunked and req.prompt_len > budget):
            if skip_misfits:
                continue
            break
        plan.append((req.id, min(req.prompt_len, budget)))
        budget -= plan[-1][1]
        free_blocks -= req.blocks
    return plan


MISTAKES = [
    (dict(skip_misfits=True), "a waiting request that does not fit stops admission; skipping it for a later "
                              "one starves it (seed 000's `continue`)"),
    (dict(order=lambda r: (r.prompt_len, r.arrival)), "admitted shortest prompt first (seed 000's sort), which "
                                                      "starves long prompts: highest priority first, then arrival"),
    (dict(order=lambda r: r.arrival), "ignored priorities: highest priority first, then earliest arrival"),
    (dict(order=lambda r: (r.priority, r.arrival)), "lowest priority first: higher priority values run first"),
    (dict(chunked=False), "a prompt longer than the budget left must be cut to it (chunked prefill), not held back"),
]


def _random_case(rng):
    running = [f"r{i}" for i in range(rng.randint(0, 4))]
    waiting = [Request(f"w{i}", rng.choice([-1, 0, 0, 2]), rng.randint(0, 50), rng.randint(1, 40), rng.randint(1, 4))
               for i in range(rng.randint(1, 6))]
    return running, waiting, rng.randint(len(running) + 1, 48), rng.randint(len(running) + 1, 8), rng.randint(0, 8)


@exercise("10", "schedule_step", forbidden=("labkit.grading.labs.lab10.reference_schedule_step",))
def schedule_step(ns):
    fn = require(ns, "schedule_step")
    rng = random.Random(1010)
    fixed = [
        # the head (priority 2) does not fit the free blocks: admission stops, nothing jumps ahead
        (["r0"], [Request("big", 2, 5, 10, 6), Request("cheap", 0, 9, 12, 1), Request("huge", -3, 3, 2, 9)], 32, 4, 4),
        # a long prompt is cut to the budget left after the decodes (chunked prefill)
        (["r0", "r1"], [Request("long", 0, 0, 40, 3)], 16, 4, 8),
        # priority before arrival; arrival breaks ties
        ([], [Request("late", 0, 9, 1, 1), Request("vip", 5, 10, 3, 1), Request("early", 0, 1, 2, 1),
              Request("low", -1, 5, 4, 1)], 32, 8, 8),
        # max_num_seqs counts the running ones too
        (["r0", "r1", "r2"], [Request("a", 0, 0, 2, 1), Request("b", 0, 1, 2, 1)], 32, 4, 8),
        # shortest-first would pick 'short'; first come first served picks 'long' (seed 000's sort)
        ([], [Request("long", 0, 0, 30, 2), Request("short", 0, 1, 3, 1)], 31, 1, 8),
    ]
    for case in fixed + [_random_case(rng) for _ in range(200)]:
        running, waiting, budget, max_seqs, free = case
        want = reference_schedule_step(list(running), list(waiting), budget, max_seqs, free)
        got = fn(list(running), list(waiting), budget, max_seqs, free)
        if not isinstance(got, list) or not all(isinstance(p, tuple) and len(p) == 2 for p in got):
            raise ExerciseFailed(f"return a list of (request id, number of tokens) pairs, got {got!r}")
        if got != want:
            raise ExerciseFailed(_diagnose(case, got, want))
    return "decodes first, then admission by priority and arrival, chunked to the budget, never skipping the head"


def _diagnose(case, got, want) -> str:
    running, waiting, budget, max_seqs, free = case
    where = (f"running={running}, waiting={[(r.id, r.priority, r.arrival, r.prompt_len, r.blocks) for r in waiting]} "
             f"(id, priority, arrival, prompt_len, blocks), token_budget={budget}, max_num_seqs={max_seqs}, "
             f"free_blocks={free}")
    if sum(n for _, n in got) > budget:
        return f"the plan uses {sum(n for _, n in got)} tokens, more than the budget of {budget}: {where}"
    if len(got) > max_seqs:
        return f"the plan runs {len(got)} requests, more than max_num_seqs={max_seqs}: {where}"
    if [p for p in got if p[0] in running] != [(r, 1) for r in running]:
        return f"every running request decodes one token, before anything is admitted: {where}"
    for mistake, message in MISTAKES:
        if got == reference_schedule_step(list(running), list(waiting), budget, max_seqs, free, **mistake):
            return f"got {got}, expected {want}: {message}. {where}"
    return f"expected {want}, got {got}: {where}"


@exercise("10", "knowledge_check")
def knowledge_check(ns):
    from labkit.cache.paged_storage import PagedKVStorage
    from labkit.engine import Scheduler, SchedulerConfig, Sequence
    from labkit.grading.quiz import Choice, Number, grade_answers
    from labkit.sampling import SamplingParams

    def scheduler(budget, num_blocks=6, block_size=8, max_seqs=4):
        config = SchedulerConfig(max_num_seqs=max_seqs, max_num_batched_tokens=budget, max_model_len=64)
        return Scheduler(config, BlockManager(num_blocks, block_size), PagedKVStorage(1, num_blocks, block_size, 1, 4))

    def request(first, prompt_len, max_tokens):
        return Sequence(list(range(first, first + prompt_len)), SamplingParams(max_tokens=max_tokens, ignore_eos=True))

    def step(s):
        """One step with the lab's stand-in model; returns {sequence: tokens computed}."""
        out = s.schedule()
        for seq, n in zip(out.seqs, out.num_new_tokens, strict=True):
            if seq.num_cached_tokens + n == seq.num_tokens:
                seq.append_token(0)
        s.postprocess(out)
        return dict(zip(out.seqs, out.num_new_tokens, strict=True))

    trace = scheduler(budget=16)
    arrivals = [request(1000, 20, 6), request(2000, 5, 12), request(3000, 12, 10), request(4000, 9, 4),
                request(5000, 3, 6)]  # created in arrival order: that order is first come, first served
    for seq in arrivals:
        trace.add(seq)
    c = arrivals[2]
    step(trace)
    c_in_step_2 = step(trace).get(c, 0)

    chunked = scheduler(budget=4)
    s = request(1000, 8, 3)
    chunked.add(s)
    steps = 0
    while not s.output_token_ids:
        step(chunked)
        steps += 1
    return grade_answers(ns, {
        1: Number(c_in_step_2, "the step-by-step trace, step 2"),
        2: Number(steps, "chunked prefill's token flow: the last chunk samples"),
        3: Choice("b", "'Priorities': the order that picks victims"),
        4: Choice("b", "'A request's life' and the trace's step 6"),
        5: Choice("c", "'No deadlock: impossible requests are refused at once'"),
    })
