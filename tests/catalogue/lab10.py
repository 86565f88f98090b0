"""Lab 10: the scheduler's can_append rule and one continuous-batching step."""

import math
from collections import deque

from catalogue import Right, Wrong
from labkit.cache.block_manager import BlockManager
from labkit.cache.sequence_blocks import BlockSequence
from labkit.grading.labs.lab10 import reference_schedule_step


def can_append_by_blocks(num_tokens, num_blocks_held, block_size, num_free_blocks):
    return -(-num_tokens // block_size) - num_blocks_held <= num_free_blocks


def can_append_by_remainder(num_tokens, num_blocks_held, block_size, num_free_blocks):
    """Seed 001's rule: a block is needed exactly when the newest token is the first of a block."""
    return num_free_blocks >= (num_tokens % block_size == 1)


def can_append_math_ceil(num_tokens, num_blocks_held, block_size, num_free_blocks):
    return bool(math.ceil(num_tokens / block_size) <= num_blocks_held + num_free_blocks)


def labkit_can_append(num_tokens, num_blocks_held, block_size, num_free_blocks):
    manager = BlockManager(num_blocks_held + num_free_blocks, block_size, enable_prefix_caching=False)
    seq = BlockSequence(0, list(range(num_tokens - 1)))
    manager.allocate(seq)
    seq.token_ids.append(0)
    return manager.can_append(seq)


def schedule(running, waiting, budget, max_seqs, free, order=None, skip=False, chunk=True, decode_first=True):
    plan = [(r, 1) for r in running] if decode_first else []
    left = budget - len(plan)
    for req in sorted(waiting, key=order or (lambda r: (-r.priority, r.arrival))):
        if left == 0 or len(plan) + (0 if decode_first else len(running)) >= max_seqs:
            break
        if req.blocks > free or (not chunk and req.prompt_len > left):
            if skip:
                continue
            break
        plan.append((req.id, min(req.prompt_len, left)))
        left -= plan[-1][1]
        free -= req.blocks
    return plan


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


RIGHT = [
    Right("can_append", "blocks needed for all tokens vs held + free", can_append_by_blocks),
    Right("can_append", "seed 001's remainder rule", can_append_by_remainder),
    Right("can_append", "math.ceil over held plus free", can_append_math_ceil),
    Right("schedule_step", "sorted loop with a break", schedule),
    Right("schedule_step", "two stable sorts and a deque", schedule_queue),
]

WRONG = [
    Wrong("can_append", "a new block at num_tokens % block_size == 0", lambda n, h, bs, f: f >= (n % bs == 0),
          "not == 0"),
    Wrong("can_append", "always True", lambda n, h, bs, f: True, "no block is free"),
    Wrong("can_append", "floor division of the token count", lambda n, h, bs, f: n // bs - h <= f, "no block is free"),
    Wrong("can_append", "always wants a free block", lambda n, h, bs, f: f > 0, "a free block is needed only when"),
    Wrong("can_append", "ignores the free blocks", lambda n, h, bs, f: n % bs != 1, "compare with num_free_blocks"),
    Wrong("can_append", "counts one token too many", lambda n, h, bs, f: -(-(n + 1) // bs) - h <= f, "expected"),
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
    Wrong("schedule_step", "imports the grader's reference", lambda *a: reference_schedule_step(*a),
          "`reference_schedule_step`",
          calls="labkit.grading.labs.lab10.reference_schedule_step"),
]
