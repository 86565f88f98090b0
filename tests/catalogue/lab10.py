"""Lab 10: the scheduler's can_append rule, one continuous-batching step, the preemption victim and the
token budget of the running sequences."""

import math
from collections import deque

from catalogue import Right, Wrong
from labkit.cache.block_manager import BlockManager
from labkit.cache.sequence_blocks import BlockSequence
from labkit_course.grading.labs.lab10 import reference_schedule_step


def can_append_by_blocks(num_tokens, num_blocks_held, block_size, num_free_blocks):
    return -(-num_tokens // block_size) - num_blocks_held <= num_free_blocks


def can_append_by_remainder(num_tokens, num_blocks_held, block_size, num_free_blocks):
    """Seed 001's rule, written for every block size: a block is needed exactly when the newest token is the
    first of a block."""
    return num_free_blocks >= ((num_tokens - 1) % block_size == 0)


def can_append_math_ceil(num_tokens, num_blocks_held, block_size, num_free_blocks):
    return bool(math.ceil(num_tokens / block_size) <= num_blocks_held + num_free_blocks)


def labkit_can_append(num_tokens, num_blocks_held, block_size, num_free_blocks):
    manager = BlockManager(num_blocks_held + num_free_blocks, block_size, enable_prefix_caching=False)
    seq = BlockSequence(0, list(range(num_tokens - 1)))
    manager.allocate(seq)
    seq.token_ids.append(0)
    return manager.can_append(seq)


def schedule(running, waiting, budget, max_seqs, free, order=None, skip=False, chunk=True, decode_first=True,
             subtract=True, seats=True, exact_fit=True):
    """The waiting requests admitted in priority order while tokens, seats and blocks last, after a token for
    each running sequence; the keywords make the usual mistakes."""
    admitted, left = [], budget - (len(running) if decode_first else 0)
    for req in sorted(waiting, key=order or (lambda r: (-r.priority, r.arrival))):
        if not left or (seats and len(running) + len(admitted) >= max_seqs):  # the running hold seats too
            break
        fits = (req.blocks <= free if exact_fit else req.blocks < free) and (chunk or req.prompt_len <= left)
        if not fits:
            if skip:
                continue
            break
        tokens = min(req.prompt_len, left)
        admitted.append((req.id, tokens))
        left -= tokens
        if subtract:
            free -= req.blocks
    return [(r, 1) for r in running] + admitted if decode_first else admitted


def schedule_queue(running, waiting, token_budget, max_num_seqs, free_blocks):
    plan = [(request_id, 1) for request_id in running]
    budget = token_budget - len(plan)
    queue = deque(sorted(waiting, key=lambda r: r.arrival))
    queue = deque(sorted(queue, key=lambda r: r.priority, reverse=True))  # stable: arrival breaks ties
    while queue and budget > 0 and len(plan) < max_num_seqs:
        head = queue.popleft()
        if head.blocks > free_blocks:
            break
        tokens = min(head.prompt_len, budget)
        plan.append((head.id, tokens))
        budget, free_blocks = budget - tokens, free_blocks - head.blocks
    return plan


def no_budget(running, waiting, budget, max_seqs, free):
    return [(r, 1) for r in running] + [(w.id, w.prompt_len + budget) for w in waiting]


def victim(grower, running, ref_counts, write_block, order=None, from_top=False, only_below=True, must_help=True,
           sibling_rule=True, sibling_needs_two=True, fallback="grower"):
    ranked = sorted(running, key=order or (lambda r: (-r.priority, r.arrival)))
    position = [r.id for r in ranked].index(grower)
    candidates = ranked[position + 1:] if only_below else ranked[:position] + ranked[position + 1:]
    for seq in (candidates if from_top else candidates[::-1]):
        if not must_help or min(ref_counts[b] for b in seq.block_table) == 1:
            return seq.id
        if sibling_rule and write_block in seq.block_table and (ref_counts[write_block] == 2 or not sibling_needs_two):
            return seq.id
    return grower if fallback == "grower" else None


def victim_by_scan(grower, running, ref_counts, write_block):
    """Walks the whole order from the bottom and stops when it reaches the grower."""
    for seq in sorted(running, key=lambda r: (r.priority, -r.arrival)):  # bottom first
        if seq.id == grower:
            return grower
        frees_a_block = any(ref_counts[b] == 1 for b in seq.block_table)
        spares_the_copy = write_block in seq.block_table and ref_counts.get(write_block) == 2
        if frees_a_block or spares_the_copy:
            return seq.id
    raise ValueError("the grower is not running")


def labkit_victim(grower, running, ref_counts, write_block):
    from labkit.engine.scheduler import Scheduler
    return Scheduler.choose_victim(None, running)


def plan(running, token_budget, threshold, reserve="decodes", cap=True, zero_cap_is_zero=False, keep_empty=False,
         stop_at_empty=False, clip=True):
    """A decode takes 1 token; a prefill the smallest of its limits: what the budget leaves after a token for each
    decode behind it, its uncomputed tokens, the threshold. The keywords make the usual mistakes."""
    out, left = [], token_budget
    for i, seq in enumerate(running):
        if not left:
            break
        if seq.is_prefill:
            behind = running[i + 1:]
            reserved = {"decodes": [s for s in behind if not s.is_prefill], "all": behind, "none": []}[reserve]
            limits = [max(left - len(reserved), 0)]
            limits += [seq.uncomputed] if clip else []
            limits += [threshold] if cap and (threshold or zero_cap_is_zero) else []
            tokens = min(limits)
        else:
            tokens = 1
        if tokens or keep_empty:
            out.append((seq.id, tokens))
            left -= tokens
        elif stop_at_empty:
            break
    return out


def plan_with_counter(running, token_budget, long_prefill_token_threshold):
    """Counts the decodes still to come once, and decrements as it passes them."""
    decodes_left = sum(not s.is_prefill for s in running)
    plan, budget = [], token_budget
    for seq in running:
        if budget <= 0:
            break
        if not seq.is_prefill:
            decodes_left -= 1
            plan.append((seq.id, 1))
            budget -= 1
            continue
        chunk = min(seq.uncomputed, budget - decodes_left)
        if long_prefill_token_threshold:
            chunk = min(chunk, long_prefill_token_threshold)
        if chunk > 0:
            plan.append((seq.id, chunk))
            budget -= chunk
    return plan


def labkit_plan(running, token_budget, threshold):
    from labkit.engine.scheduler import Scheduler
    return [(s.id, Scheduler.chunk_size(None, s, token_budget)) for s in running]


RIGHT = [
    Right("can_append", "blocks needed for all tokens vs held + free", can_append_by_blocks),
    Right("can_append", "seed 001's remainder rule, (num_tokens - 1) % block_size == 0", can_append_by_remainder),
    Right("can_append", "math.ceil over held plus free", can_append_math_ceil),
    Right("schedule_step", "sorted loop with a break", schedule),
    Right("schedule_step", "two stable sorts and a deque", schedule_queue),
    Right("choose_victim", "ranked list, reversed tail below the grower", victim),
    Right("choose_victim", "ascending scan from the bottom that stops at the grower", victim_by_scan),
    Right("plan_running", "enumerate and count the decodes behind", plan),
    Right("plan_running", "a running count of the decodes still to come", plan_with_counter),
]

WRONG = [
    Wrong("can_append", "a new block at num_tokens % block_size == 0", lambda n, h, bs, f: f >= (n % bs == 0),
          "not at num_tokens % block_size == 0"),
    Wrong("can_append", "always True", lambda n, h, bs, f: True, "no block is free"),
    Wrong("can_append", "floor division of the token count", lambda n, h, bs, f: n // bs - h <= f, "floor"),
    Wrong("can_append", "always wants a free block", lambda n, h, bs, f: f > 0, "a free block is needed only when"),
    Wrong("can_append", "ignores the free blocks", lambda n, h, bs, f: (n - 1) % bs != 0,
          "compare with num_free_blocks"),
    Wrong("can_append", "seed 001's num_tokens % block_size == 1 (never true for blocks of 1)",
          lambda n, h, bs, f: f >= (n % bs == 1), "wrong for blocks of 1"),
    Wrong("can_append", "blocks needed as num_tokens // block_size + 1", lambda n, h, bs, f: n // bs + 1 - h <= f,
          "counts one too many"),
    Wrong("can_append", "needed < free instead of <=", lambda n, h, bs, f: -(-n // bs) - h < f, "compared with <"),
    Wrong("can_append", "counts one token too many", lambda n, h, bs, f: -(-(n + 1) // bs) - h <= f,
          "counts one too many"),
    Wrong("can_append", "returns an int", lambda n, h, bs, f: int(n // bs - h <= f), "must return True or False"),
    Wrong("can_append", "calls BlockManager.can_append", labkit_can_append,
          "`can_append`",
          calls="labkit.cache.block_manager.BlockManager.can_append"),
    Wrong("schedule_step", "skips a head that does not fit", lambda *a: schedule(*a, skip=True), "starves it"),
    Wrong("schedule_step", "shortest prompt first", lambda *a: schedule(*a, order=lambda r: (r.prompt_len, r.arrival)),
          "shortest prompt first"),
    Wrong("schedule_step", "first come first served, no priorities", lambda *a: schedule(*a, order=lambda r: r.arrival),
          "ignored priorities"),
    Wrong("schedule_step", "lowest priority first", lambda *a: schedule(*a, order=lambda r: (r.priority, r.arrival)),
          "lowest priority first"),
    Wrong("schedule_step", "admits before decoding", lambda *a: schedule(*a, decode_first=False), "decodes one token"),
    Wrong("schedule_step", "holds back a prompt longer than the budget", lambda *a: schedule(*a, chunk=False),
          "chunked prefill"),
    Wrong("schedule_step", "ignores the token budget", no_budget, "more than the budget"),
    Wrong("schedule_step", "forgets to subtract the blocks it gave", lambda *a: schedule(*a, subtract=False),
          "subtract them before the next request"),
    Wrong("schedule_step", "sorted by priority alone, ties left in the waiting list's order",
          lambda *a: schedule(*a, order=lambda r: -r.priority), "not by priority alone"),
    Wrong("schedule_step", "latest arrival first among equal priorities",
          lambda *a: schedule(*a, order=lambda r: (-r.priority, -r.arrival)), "the earliest arrival goes first"),
    Wrong("schedule_step", "refuses a request needing exactly the free blocks (>=)",
          lambda *a: schedule(*a, exact_fit=False), "needing exactly the free blocks"),
    Wrong("schedule_step", "ignores max_num_seqs", lambda *a: schedule(*a, seats=False), "more than max_num_seqs"),
    Wrong("schedule_step", "imports the grader's reference", lambda *a: reference_schedule_step(*a),
          "`reference_schedule_step`",
          calls="labkit_course.grading.labs.lab10.reference_schedule_step"),
    Wrong("choose_victim", "nano-vLLM's latest arrival, whatever its priority", lambda *a: victim(
        *a, order=lambda r: r.arrival), "ignored priorities"),
    Wrong("choose_victim", "nano-vLLM's most recently added (the end of running)", lambda *a: victim(
        *a, order=lambda r: 0), "most recently added"),
    Wrong("choose_victim", "ranks by ascending priority", lambda *a: victim(
        *a, order=lambda r: (r.priority, r.arrival)), "ascending priority"),
    Wrong("choose_victim", "takes the victim from the top", lambda *a: victim(*a, from_top=True), "from the top"),
    Wrong("choose_victim", "earliest arrival among equals", lambda *a: victim(
        *a, order=lambda r: (-r.priority, -r.arrival)), "not the earliest"),
    Wrong("choose_victim", "preempts a higher-ranked sequence", lambda *a: victim(*a, only_below=False),
          "ranks above the grower"),
    Wrong("choose_victim", "a victim whose blocks are all shared", lambda *a: victim(*a, must_help=False),
          "frees no block"),
    Wrong("choose_victim", "misses the sibling holding the write block", lambda *a: victim(*a, sibling_rule=False),
          "missed the sibling"),
    Wrong("choose_victim", "any holder of the shared write block", lambda *a: victim(*a, sibling_needs_two=False),
          "only if it is the only other one"),
    Wrong("choose_victim", "returns None when nobody helps", lambda *a: victim(*a, fallback=None),
          "preempts itself"),
    Wrong("choose_victim", "calls Scheduler.choose_victim", labkit_victim, "`choose_victim`",
          calls="labkit.engine.scheduler.Scheduler.choose_victim"),
    Wrong("plan_running", "a prefill starves the decodes behind it", lambda *a: plan(*a, reserve="none"),
          "leave one token to every decode"),
    Wrong("plan_running", "reserves a token for prefills behind too", lambda *a: plan(*a, reserve="all"),
          "only decodes need one each"),
    Wrong("plan_running", "ignores long_prefill_token_threshold", lambda *a: plan(*a, cap=False),
          "caps each prompt's chunk"),
    Wrong("plan_running", "a threshold of 0 caps chunks at 0", lambda *a: plan(*a, zero_cap_is_zero=True),
          "0 means no cap"),
    Wrong("plan_running", "keeps a 0-token prefill in the plan", lambda *a: plan(*a, keep_empty=True),
          "is not in the plan"),
    Wrong("plan_running", "stops at a prefill left with nothing", lambda *a: plan(*a, stop_at_empty=True),
          "the decodes behind it still run"),
    Wrong("plan_running", "a chunk longer than the prompt's rest", lambda *a: plan(*a, clip=False),
          "cannot be longer than the tokens it has left"),
    Wrong("plan_running", "calls Scheduler.chunk_size", labkit_plan, "`chunk_size`",
          calls="labkit.engine.scheduler.Scheduler.chunk_size"),
]
