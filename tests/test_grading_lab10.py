"""Lab 10 graders: the solution passes, a stub is "not implemented", each typical mistake is named."""

import pytest

from labkit.grading.core import get_exercise, run_exercise


def grade(name, fn):
    return run_exercise(get_exercise("10", name), {name: fn})


def stub(*args):
    raise NotImplementedError()


def can_append(num_tokens, num_blocks_held, block_size, num_free_blocks):
    return -(-num_tokens // block_size) - num_blocks_held <= num_free_blocks


def seed_001_rule(num_tokens, num_blocks_held, block_size, num_free_blocks):
    return num_free_blocks >= (num_tokens % block_size == 1)


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


@pytest.mark.parametrize("name, fn, message", [
    ("can_append", can_append, "exactly when the newest token starts a new block"),
    ("can_append", seed_001_rule, "exactly when the newest token starts a new block"),
    ("can_append", stub, "not implemented yet"),
    ("can_append", lambda n, h, bs, f: f >= (n % bs == 0), "num_tokens % block_size == 1"),
    ("can_append", lambda n, h, bs, f: True, "no block is free"),
    ("can_append", lambda n, h, bs, f: int(n // bs - h <= f), "must return True or False"),
    ("schedule_step", schedule, "never skipping the head"),
    ("schedule_step", stub, "not implemented yet"),
    ("schedule_step", lambda *a: schedule(*a, skip=True), "starves it"),
    ("schedule_step", lambda *a: schedule(*a, order=lambda r: (r.prompt_len, r.arrival)), "shortest prompt first"),
    ("schedule_step", lambda *a: schedule(*a, order=lambda r: r.arrival), "ignored priorities"),
    ("schedule_step", lambda *a: schedule(*a, order=lambda r: (r.priority, r.arrival)), "lowest priority first"),
    ("schedule_step", lambda *a: schedule(*a, decode_first=False), "decodes one token"),
    ("schedule_step", lambda *a: schedule(*a, chunk=False), "chunked prefill"),
])
def test_lab10_graders(name, fn, message):
    outcome = grade(name, fn)
    assert message in outcome.message, outcome.message
    assert outcome.passed == (fn in (can_append, seed_001_rule, schedule))


def test_lab10_schedule_step_names_a_budget_overrun():
    def no_budget(running, waiting, budget, max_seqs, free):
        return [(r, 1) for r in running] + [(w.id, w.prompt_len + budget) for w in waiting]

    assert "more than the budget" in grade("schedule_step", no_budget).message
