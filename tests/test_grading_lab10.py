"""Lab 10's reference answers are labkit's scheduler: checked against the real `Scheduler` on random cases,
so the exercises teach what the engine does."""

import random
from types import SimpleNamespace

from labkit.cache.block_manager import Block, BlockManager
from labkit.engine import FinishReason, Scheduler, SchedulerConfig, Sequence
from labkit.sampling import SamplingParams
from labkit_course.grading.labs.lab10 import (
    Active,
    _random_running,
    reference_choose_victim,
    reference_plan_running,
)


def test_reference_victim_is_the_schedulers():
    rng = random.Random(7)
    for _ in range(500):
        grower, running, ref_counts, write_block = _random_running(rng)
        ranked = sorted(running, key=lambda r: (-r.priority, r.arrival))
        queue = ranked[[r.id for r in ranked].index(grower):]  # the grower and everything ranking below it
        blocks = [Block(b, ref_count=n) for b, n in sorted(ref_counts.items())]
        manager = SimpleNamespace(blocks=blocks, shared_write_block=lambda seq, w=write_block: w)
        real = Scheduler.choose_victim(SimpleNamespace(block_manager=manager), queue)
        assert reference_choose_victim(grower, running, ref_counts, write_block) == real.id


def _arrive(scheduler, i, rng):
    """Request i arrives; a higher-priority late arrival prefills ahead of decodes already running."""
    prompt = list(range(1000 * (i + 1), 1000 * (i + 1) + rng.randint(1, 40)))
    scheduler.add(Sequence(prompt, SamplingParams(max_tokens=rng.randint(1, 8), ignore_eos=True),
                           priority=rng.choice([0, 0, 1, 2])))


def test_reference_plan_is_the_schedulers_running_step():
    rng = random.Random(8)
    checked = 0
    for _ in range(40):
        threshold = rng.choice([0, 3, 8])
        config = SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=rng.randint(4, 24), max_model_len=256,
                                 long_prefill_token_threshold=threshold, priority_aging_steps=None)
        scheduler = Scheduler(config, BlockManager(256, 4))
        pending = list(range(rng.randint(3, 8)))
        _arrive(scheduler, pending.pop(0), rng)
        while scheduler.has_unfinished or pending:
            if pending and (rng.random() < 0.4 or not scheduler.has_unfinished):
                _arrive(scheduler, pending.pop(0), rng)
            ranked = sorted(scheduler.running, key=scheduler.order)
            before = [Active(s, s.num_uncomputed_tokens, s.is_prefill) for s in ranked]
            out = scheduler.schedule()
            running_part = [(s, n) for s, n in zip(out.seqs, out.num_new_tokens, strict=True) if s in ranked]
            assert running_part == reference_plan_running(before, config.max_num_batched_tokens, threshold)
            checked += len(running_part)
            for seq, n in zip(out.seqs, out.num_new_tokens, strict=True):
                if seq.num_cached_tokens + n == seq.num_tokens:
                    seq.append_token(0)
                    if seq.num_output_tokens == seq.params.max_tokens:
                        seq.finish(FinishReason.MAX_TOKENS)
            scheduler.postprocess(out)
    assert checked > 200
