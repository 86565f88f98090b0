"""Lab 10: the scheduler. The can_append rule, planning one continuous-batching step, choosing a
preemption victim and splitting a step's token budget between decodes and prefill chunks."""


from labkit.cache.block_manager import BlockManager
from labkit.cache.sequence_blocks import BlockSequence
from labkit_course.grading import ExerciseFailed, exercise, require
from labkit_course.grading.core import seeded_random
from labkit_course.grading.records import Active, Request, Running


@exercise("10", "can_append", forbidden=(
    "labkit.cache.block_manager.BlockManager.can_append", "labkit.cache.block_manager.BlockManager.missing_blocks",
    "labkit_course.grading.labs.lab10.reference_can_append", "labkit_course.engine_parts.labkit_can_append",
))
def can_append(ns):
    fn = require(ns, "can_append")
    rng = seeded_random(10)
    cases = [(17, 2, 8, 0), (16, 2, 8, 0), (9, 1, 8, 1), (9, 1, 8, 0), (8, 1, 8, 0), (33, 4, 8, 1), (2, 1, 8, 0),
             (5, 4, 1, 0), (5, 4, 1, 2), (2, 1, 1, 1)]  # blocks of 1 token: every token starts a block
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
    (lambda n, held, bs, free: free >= (n % bs == 1),
     "right for blocks of 2 or more tokens, wrong for blocks of 1: num_tokens % 1 is always 0, never 1, yet with "
     "block_size 1 every token starts a new block; test (num_tokens - 1) % block_size == 0, or count the blocks "
     "needed, ceil(num_tokens / block_size) - num_blocks_held"),
    (lambda n, held, bs, free: free >= (n % bs == 0),
     "a new block is needed when the new token starts one, at (num_tokens - 1) % block_size == 0, not at "
     "num_tokens % block_size == 0 (then it takes the last slot of a block already held)"),
    (lambda n, held, bs, free: free >= n // bs + 1 - held,
     "blocks needed = num_tokens // block_size + 1 counts one too many when num_tokens is a multiple of "
     "block_size (the new token fills the last slot of a block held): use ceil(num_tokens / block_size)"),
    (lambda n, held, bs, free: n // bs - held <= free,
     "counted blocks with floor division: num_tokens // block_size misses the partly filled last block; the "
     "blocks needed are ceil(num_tokens / block_size)"),
    (lambda n, held, bs, free: free > -(-n // bs) - held,
     "compared with <: when the free blocks are exactly as many as the blocks needed (0 needed, 0 free "
     "included), it can append; use needed <= num_free_blocks"),
    (lambda n, held, bs, free: True, "when the new token starts a new block ((num_tokens - 1) % block_size == 0) "
                                     "and no block is free, it cannot append"),
    (lambda n, held, bs, free: free > 0, "a free block is needed only when the new token starts a new block "
                                         "((num_tokens - 1) % block_size == 0); otherwise it fits in the last "
                                         "block held"),
    (lambda n, held, bs, free: (n - 1) % bs != 0, "when the new token starts a new block and a free block is "
                                                  "there to take, it can append: compare with num_free_blocks"),
)


def reference_can_append(num_tokens: int, num_blocks_held: int, block_size: int, num_free_blocks: int) -> bool:
    """The real BlockManager's answer: a sequence holding blocks for its first num_tokens - 1 tokens
    has just been given one more token."""
    bm = BlockManager(num_blocks_held + num_free_blocks, block_size, enable_prefix_caching=False)
    seq = BlockSequence(0, list(range(num_tokens - 1)))
    bm.allocate(seq)
    seq.token_ids.append(0)
    return bm.can_append(seq)



def reference_schedule_step(running, waiting, token_budget, max_num_seqs, free_blocks, *, order=None,
                            skip_misfits=False, chunked=True, subtract=True, exact_fit=True):
    """The policy of labkit's Scheduler, on plain records. The keyword arguments re-create typical
    mistakes, so a wrong plan can be named."""
    plan = [(rid, 1) for rid in running[:token_budget]]
    budget = token_budget - len(plan)
    for req in sorted(waiting, key=order or (lambda r: (-r.priority, r.arrival))):
        if budget == 0 or len(plan) >= max_num_seqs:
            break
        if req.blocks > free_blocks - (not exact_fit) or (not chunked and req.prompt_len > budget):
            if skip_misfits:
                continue
            break
        plan.append((req.id, min(req.prompt_len, budget)))
        budget -= plan[-1][1]
        free_blocks -= req.blocks if subtract else 0
    return plan


MISTAKES = [
    (dict(skip_misfits=True), "a waiting request that does not fit stops admission; skipping it for a later "
                              "one starves it (seed 000's `continue`)"),
    (dict(order=lambda r: (r.prompt_len, r.arrival)), "admitted shortest prompt first (seed 000's sort), which "
                                                      "starves long prompts: highest priority first, then arrival"),
    (dict(order=lambda r: r.arrival), "ignored priorities: highest priority first, then earliest arrival"),
    (dict(order=lambda r: (r.priority, r.arrival)), "lowest priority first: higher priority values run first"),
    (dict(order=lambda r: -r.priority), "equal priorities kept the waiting list's order: sort by priority, then "
                                         "by arrival (earliest first), not by priority alone"),
    (dict(order=lambda r: (-r.priority, -r.arrival)), "among equal priorities the latest arrival went first: the "
                                                       "earliest arrival goes first (first come, first served)"),
    (dict(exact_fit=False), "a request needing exactly the free blocks was refused (>= on blocks): it fits; "
                            "stop only at one that needs more blocks than are free"),
    (dict(chunked=False), "a prompt longer than the budget left must be cut to it (chunked prefill), not held back"),
    (dict(subtract=False), "the blocks given to an admitted request are no longer free: subtract them before the "
                           "next request is checked"),
]


def _random_case(rng):
    """Running ids and waiting requests at distinct arrival times (a tie in priority and arrival has no order)."""
    running = [f"r{i}" for i in range(rng.randint(0, 4))]
    arrivals = rng.sample(range(51), rng.randint(1, 6))
    waiting = [Request(f"w{i}", rng.choice([-1, 0, 0, 2]), arrival, rng.randint(1, 40), rng.randint(1, 4))
               for i, arrival in enumerate(arrivals)]
    return running, waiting, rng.randint(len(running) + 1, 48), rng.randint(len(running) + 1, 8), rng.randint(0, 8)


@exercise("10", "schedule_step", forbidden=("labkit_course.grading.labs.lab10.reference_schedule_step",
                                            "labkit_course.engine_parts.labkit_schedule_step",
                                            "labkit.engine.scheduler.Scheduler.admit_waiting",
                                            "labkit.engine.scheduler.Scheduler.admit"))
def schedule_step(ns):
    fn = require(ns, "schedule_step")
    rng = seeded_random(1010)
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
    cases, answers = fixed + [_random_case(rng) for _ in range(200)], []
    for running, waiting, budget, max_seqs, free in cases:
        got = fn(list(running), list(waiting), budget, max_seqs, free)
        if not isinstance(got, list) or not all(isinstance(p, tuple) and len(p) == 2 for p in got):
            raise ExerciseFailed(f"return a list of (request id, number of tokens) pairs, got {got!r}")
        answers.append(got)
    explained = _explain(cases, answers, _schedule, MISTAKES)
    if explained:
        raise ExerciseFailed(_diagnose(*explained))
    return "decodes first, then admission by priority and arrival, chunked to the budget, never skipping the head"


def _schedule(case, **mistake):
    running, waiting, budget, max_seqs, free = case
    return reference_schedule_step(list(running), list(waiting), budget, max_seqs, free, **mistake)


def _diagnose(case, got, want, mistake: str | None) -> str:
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
    if mistake is None:  # no one mistake gives every plan: the first that gives this one, offered as a guess
        mistake = next((f"perhaps: {message}" for variant, message in MISTAKES if got == _schedule(case, **variant)),
                       None)
    return f"got {got}, expected {want}: {mistake}. {where}" if mistake else f"expected {want}, got {got}: {where}"


def _explain(cases, answers, reference, mistakes):
    """None if every answer is the reference's; else the first wrong case, its answer, the right one and why:
    a mistake is named only when re-creating it gives every answer the student gave."""
    expected = [reference(case) for case in cases]
    wrong = [i for i, (got, want) in enumerate(zip(answers, expected, strict=True)) if got != want]
    if not wrong:
        return None
    why = None
    for mistake, message in mistakes:
        if all(got == reference(case, **mistake) for case, got in zip(cases, answers, strict=True)):
            why = message
            break
    first = wrong[0]
    return cases[first], answers[first], expected[first], why



def reference_choose_victim(grower, running, ref_counts, write_block, *, order=None, from_top=False,
                            only_below=True, must_help=True, sibling_rule=True, sibling_needs_two=True,
                            fallback="grower"):
    """labkit's `Scheduler.choose_victim` on plain records; the keyword arguments re-create typical mistakes."""
    ranked = sorted(running, key=order or (lambda r: (-r.priority, r.arrival)))
    ids = [r.id for r in ranked]
    candidates = ranked[ids.index(grower) + 1:] if only_below else [r for r in ranked if r.id != grower]
    for seq in (candidates if from_top else reversed(candidates)):
        if not must_help or any(ref_counts[b] == 1 for b in seq.block_table):
            return seq.id
        if (sibling_rule and write_block is not None and write_block in seq.block_table
                and (ref_counts[write_block] == 2 or not sibling_needs_two)):
            return seq.id
    return grower if fallback == "grower" else None


VICTIM_MISTAKES = [
    (dict(order=lambda r: r.arrival), "ignored priorities (nano-vLLM's rule, the latest arrival): the victim is the "
                                      "lowest priority, and among equals the latest arrival"),
    (dict(from_top=True), "took the victim from the top of the order: preempt from the bottom, lowest priority and "
                          "latest arrival first"),
    (dict(order=lambda r: (-r.priority, -r.arrival)), "among equal priorities the victim is the latest arrival, "
                                                       "not the earliest"),
    (dict(order=lambda r: 0), "took the most recently added sequence (the end of `running`, nano-vLLM's rule): "
                              "`running`'s order is not the ranking; the victim is the lowest priority, among "
                              "equals the latest arrival"),
    (dict(order=lambda r: (r.priority, r.arrival)), "ranked by ascending priority, so a high priority became the "
                                                    "victim: the victim is the LOWEST priority value (higher "
                                                    "values run first)"),
    (dict(only_below=False), "preempted a sequence that ranks above the grower: only sequences ranking below it "
                             "may be preempted for it (else it preempts itself)"),
    (dict(must_help=False), "the victim frees no block (all its blocks are shared, ref_count > 1): skip it for "
                            "one whose release helps"),
    (dict(sibling_rule=False), "missed the sibling: a sequence that is the only other holder of the shared block "
                               "the grower writes into next helps too (ref_count 2: releasing it spares the copy)"),
    (dict(sibling_needs_two=False), "a holder of the shared write block helps only if it is the only other one "
                                    "(ref_count 2); with three holders the block stays shared and needs its copy"),
    (dict(fallback=None), "when no sequence below helps, the grower preempts itself: return its id, not None"),
]


def _random_running(rng):
    n = rng.randint(2, 6)
    arrivals = rng.sample(range(100), n)
    tables, next_block = [], 0
    for _ in range(n):
        table = []
        for _ in range(rng.randint(1, 3)):
            if tables and rng.random() < 0.45:  # shared with an earlier sequence (prefix cache or fork)
                other = rng.choice(tables)
                candidate = rng.choice(other)
                if candidate not in table:
                    table.append(candidate)
                    continue
            table.append(next_block)
            next_block += 1
        tables.append(table)
    running = [Running(f"s{i}", rng.choice([-1, 0, 0, 2]), arrivals[i], tuple(t)) for i, t in enumerate(tables)]
    ref_counts = {b: sum(b in t for t in tables) for b in range(next_block)}
    grower = rng.choice(running)
    shared = [b for b in grower.block_table if ref_counts[b] > 1]
    write_block = shared[-1] if shared and rng.random() < 0.5 else None
    return grower.id, running, ref_counts, write_block


@exercise("10", "choose_victim", forbidden=("labkit.engine.scheduler.Scheduler.choose_victim",
                                            "labkit_course.grading.labs.lab10.reference_choose_victim"))
def choose_victim(ns):
    fn = require(ns, "choose_victim")
    rng = seeded_random(1011)
    fixed = [
        # priorities first: the low-priority early arrival goes before the normal late one
        ("a", [Running("a", 5, 0, (0,)), Running("low", -1, 1, (1,)), Running("late", 0, 9, (2,))],
         {0: 1, 1: 1, 2: 1}, None),
        # among equal priorities, the latest arrival
        ("a", [Running("a", 0, 0, (0,)), Running("b", 0, 1, (1,)), Running("c", 0, 2, (2,))], {0: 1, 1: 1, 2: 1}, None),
        # the lowest one holds only shared blocks: it would free nothing
        ("a", [Running("a", 0, 0, (0, 1)), Running("b", 0, 1, (2,)), Running("c", 0, 2, (0,))],
         {0: 2, 1: 1, 2: 1}, None),
        # nobody below the grower: it preempts itself, never the higher-ranked one
        ("b", [Running("a", 3, 0, (0,)), Running("b", 0, 1, (1,))], {0: 1, 1: 1}, None),
        # a sibling sample, the only other holder of the grower's shared write block (2 holders)
        ("a", [Running("a", 0, 0, (0, 1)), Running("sib", 0, 1, (0, 1))], {0: 2, 1: 2}, 1),
        # three holders of the write block: releasing one sibling still leaves it shared
        ("a", [Running("a", 0, 0, (0, 1)), Running("s1", 0, 1, (0, 1)), Running("s2", 0, 2, (0, 1))],
         {0: 3, 1: 3}, 1),
    ]
    cases = fixed + [_random_running(rng) for _ in range(300)]
    answers = [fn(grower, list(running), dict(refs), write) for grower, running, refs, write in cases]
    wrong = _explain(cases, answers, lambda case, **m: reference_choose_victim(case[0], list(case[1]), dict(case[2]),
                                                                               case[3], **m), VICTIM_MISTAKES)
    if wrong:
        (grower, running, ref_counts, write_block), got, want, message = wrong
        raise ExerciseFailed(f"got {got!r}, expected {want!r}{': ' + message if message else ''}. grower={grower!r}, "
                             "running="
                             f"{[(r.id, r.priority, r.arrival, list(r.block_table)) for r in running]} (id, priority, "
                             f"arrival, block_table), ref_counts={ref_counts}, write_block={write_block}")
    return "lowest priority and latest arrival first, below the grower, only a victim whose release helps"



def reference_plan_running(running, token_budget, long_prefill_token_threshold, *, reserve="decodes", cap=True,
                           zero_cap_is_zero=False, keep_empty=False, stop_at_empty=False, clip=True):
    """Step 1 of labkit's `Scheduler.schedule` without preemption; keywords re-create typical mistakes."""
    plan, budget = [], token_budget
    for i, seq in enumerate(running):
        if budget == 0:
            break
        if not seq.is_prefill:
            plan.append((seq.id, 1))
            budget -= 1
            continue
        behind = running[i + 1:]
        held_back = {"decodes": sum(not s.is_prefill for s in behind), "all": len(behind), "none": 0}[reserve]
        n = max(budget - held_back, 0)
        if clip:
            n = min(n, seq.uncomputed)
        if cap and (long_prefill_token_threshold > 0 or zero_cap_is_zero):
            n = min(n, long_prefill_token_threshold)
        if n == 0 and not keep_empty:
            if stop_at_empty:
                break
            continue
        plan.append((seq.id, n))
        budget -= n
    return plan


PLAN_MISTAKES = [
    (dict(reserve="none"), "a prefill took the budget the decodes behind it need: leave one token to every "
                           "decode still to come"),
    (dict(reserve="all"), "held back a token for every sequence behind, prefills included: only decodes need "
                          "one each, a prefill behind takes what is left"),
    (dict(cap=False), "long_prefill_token_threshold caps each prompt's chunk (0 means no cap)"),
    (dict(zero_cap_is_zero=True), "long_prefill_token_threshold = 0 means no cap, not chunks of 0 tokens"),
    (dict(keep_empty=True), "a prefill left with 0 tokens this step is not in the plan (it stays running)"),
    (dict(stop_at_empty=True), "stopped at a prefill left with 0 tokens: the decodes behind it still run"),
    (dict(clip=False), "a prefill chunk cannot be longer than the tokens it has left to compute"),
]


def _random_active(rng):
    running = [Active(f"s{i}", rng.randint(1, 40) if prefill else 1, prefill)
               for i, prefill in enumerate(rng.random() < 0.35 for _ in range(rng.randint(1, 7)))]
    return running, rng.randint(1, 48), rng.choice([0, 0, 4, 8, 16])


@exercise("10", "plan_running", forbidden=("labkit.engine.scheduler.Scheduler.schedule",
                                           "labkit.engine.scheduler.Scheduler.chunk_size",
                                           "labkit.engine.scheduler.Scheduler.capped_prefill",
                                           "labkit_course.grading.labs.lab10.reference_plan_running"))
def plan_running(ns):
    fn = require(ns, "plan_running")
    rng = seeded_random(1012)
    d = lambda i: Active(i, 1, False)  # noqa: E731 - a decode
    fixed = [
        ([Active("long", 100, True), d("d1"), d("d2")], 16, 0),  # the prefill leaves 2 tokens to the decodes
        ([Active("long", 100, True), d("d1")], 16, 6),  # capped at 6
        ([Active("p1", 30, True), Active("p2", 30, True), d("d1")], 20, 0),  # p2 gets the rest minus one
        ([d("d0"), Active("p", 5, True), d("d1"), d("d2")], 3, 0),  # p is left with 0: skipped, d1 and d2 run
        ([Active("short", 3, True), d("d1")], 16, 0),  # the last chunk of a prompt: only 3 tokens left
        ([d("a"), d("b"), d("c")], 2, 0),  # the budget runs out: c waits
    ]
    cases = fixed + [_random_active(rng) for _ in range(300)]
    answers = [fn(list(running), budget, threshold) for running, budget, threshold in cases]
    for got in answers:
        if not isinstance(got, list) or not all(isinstance(p, tuple) and len(p) == 2 for p in got):
            raise ExerciseFailed(f"return a list of (id, number of tokens) pairs, got {got!r}")
    wrong = _explain(cases, answers, lambda case, **m: reference_plan_running(list(case[0]), case[1], case[2], **m),
                     PLAN_MISTAKES)
    if wrong:
        (running, budget, threshold), got, want, message = wrong
        if message is None and sum(n for _, n in got) > budget:
            message = f"the plan uses more than the budget of {budget}"
        raise ExerciseFailed(f"got {got}, expected {want}{': ' + message if message else ''}. running="
                             f"{[(s.id, s.uncomputed, s.is_prefill) for s in running]} (id, uncomputed, is_prefill), "
                             f"token_budget={budget}, long_prefill_token_threshold={threshold}")
    return "decodes keep their token, each prefill chunk takes what is left, capped per request"


@exercise("10", "knowledge_check")
def knowledge_check(ns):
    import torch

    from labkit.cache.paged_storage import PagedKVStorage
    from labkit.engine import Scheduler, SchedulerConfig, Sequence
    from labkit.engine.memory import num_blocks_for_memory
    from labkit.model.random_weights import SMOLLM2_135M  # the GGUF's shape, which the tests compare
    from labkit.sampling import SamplingParams
    from labkit_course.grading.quiz import Choice, Number, grade_answers

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
        3: Number(num_blocks_for_memory(SMOLLM2_135M, 16, torch.bfloat16),
                  "'How big is the cache?': 2 x layers x KV heads x head_dim x 2 bytes per token"),
        4: Choice("b", "'A request's life' and the trace's step 6"),
        5: Choice("c", "'No deadlock: impossible requests are refused at once'"),
    })
