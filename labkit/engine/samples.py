"""A request's n samples (`SamplingParams(n=...)`): forked off its sample 0 when its first token is drawn.

The new samples are drawn from sample 0's logits row in that step, then adopted: each shares the
prompt's KV blocks (copy on write for the partial last block) and is advanced by the scheduler like
its parent. With a seed, sample i uses seed + i (vLLM's rule), so every sample is reproducible and
none depends on what else runs in the batch.
"""

import dataclasses
import warnings
from collections.abc import Iterator

from labkit.engine.scheduler import SchedulerOutput
from labkit.engine.sequence import FinishReason, Sequence


def who_draws(sampled_seqs: list[Sequence], ids: Iterator[int]) -> tuple[list, list, list[int]]:
    """Who draws a token from which logits row of a step: each sampled sequence (row i is
    `sampled_seqs[i]`'s), and before it the new samples its request forks off it now, from the same row.
    Returns the drawers, the parent each new sample was forked off (None for the others), and the rows.
    New samples come before their parent, so the parent's append commits the fork: an interrupt before
    it leaves the parent to fork the missing samples again next step."""
    drawn, parents, rows = [], [], []
    for row, seq in enumerate(sampled_seqs):
        for sample in new_samples(seq, ids) + [seq]:
            drawn.append(sample)
            parents.append(seq if sample is not seq else None)
            rows.append(row)
    return drawn, parents, rows


def new_samples(seq: Sequence, ids: Iterator[int]) -> list[Sequence]:
    """The samples a request with n > 1 still has to fork off `seq`, its sample 0, which is about to get
    its first token (none otherwise), with their ids from `ids`. They join the request only in `adopt`."""
    children = []
    for index in range(len(seq.group), seq.params.n):
        seed = seq.params.seed
        params = seq.params if seed is None else dataclasses.replace(seq.params, seed=_wrap_int64(seed + index))
        children.append(seq.fork(next(ids), params, index))
    return children


def adopt(scheduler, parent: Sequence, child: Sequence, out: SchedulerOutput) -> None:
    """Make a new sample part of its request: it shares the parent's KV blocks (the prompt's) and,
    having computed what its parent computed, is advanced alike by postprocess. All or nothing: an
    interrupt halfway through undoes it."""
    num_new_tokens = out.num_new_tokens[out.seqs.index(parent)]
    try:
        scheduler.fork(parent, child)
        out.seqs.append(child)
        out.num_new_tokens.append(num_new_tokens)
        parent.group.append(child)
    except BaseException:
        scheduler.abort(child)  # releases the blocks it shares, if it got them
        if child in out.seqs:
            del out.num_new_tokens[out.seqs.index(child)]
            out.seqs.remove(child)
        raise


def fail(scheduler, seq: Sequence, reason: str) -> None:
    """Finish the request `seq` belongs to with reason ERROR (every unfinished sample of it, `reason`
    as stop_reason), release its samples' blocks, and warn (at the caller of LLM.step or generate)."""
    warnings.warn(f"request {seq.request_id} failed and was finished with reason 'error': {reason}", stacklevel=5)
    for sample in seq.group:
        if not sample.is_finished:
            sample.finish(FinishReason.ERROR, reason)
        scheduler.abort(sample)


def _wrap_int64(value: int) -> int:
    """A derived seed (seed + sample index) kept in the int64 range a seed must lie in."""
    return (value + 2**63) % 2**64 - 2**63


@dataclasses.dataclass(frozen=True)
class Draw:
    """One sampled token of one step: for `seq`, forked off `forked_from` in this step if not None."""

    seq: Sequence
    token: int
    logprobs: dict | None
    forked_from: Sequence | None
