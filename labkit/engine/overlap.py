"""Overlapped steps (vLLM's async scheduling): step n+1 is scheduled, prepared and launched while step
n still runs on the device.

A synchronous step ends by copying its sampled tokens to the host, and the GPU then idles while the
host appends them, checks the stop rules, schedules the next step and builds its inputs: on an H100
with 256 sequences that host work took longer than the step's GPU time (reports/gpu/).

So a decode step's sampled tokens stay on the device, and each sequence gets a *placeholder* token,
-1 - its row in that step's tokens, which gives the scheduler and the block manager its true length.
The next step's inputs are built from the placeholders and take, on the device, the tokens they stand
for (`model_runner.fill_placeholders`). Only after launching that next step does the host wait for
the tokens (copied to pinned memory meanwhile), put them in place of the placeholders and apply the
stop rules: the GPU has the next step to run while it does.

The price: a sequence that ends at a step's token by EOS or a stop was already scheduled in the next
step, whose row for it is thrown away (one that reaches max_tokens or max_model_len is known to end
and sits the next step out, `ends_at_its_placeholder`). Only plain decode steps overlap:
nothing waiting or swapped (admission changes the batch), no preemption possible, and no request
whose sampling reads its tokens or logits on the host (logprobs, penalties, logit processors).
Before any other step, and before an abort, the step in flight is resolved; a caller reading a request
meanwhile (`request_output`, a stream) sees its tokens up to the step before (`known_output_token_ids`).
Unseeded requests draw from torch's generator once per row, so the thrown-away rows make a run's
draws differ from a synchronous run's; seeded requests draw the same tokens either way.
"""

import dataclasses
import time
import warnings

import torch

from labkit.engine.output_processor import OutputProcessor
from labkit.engine.scheduler import Scheduler, SchedulerOutput
from labkit.engine.sequence import Sequence


def placeholder(row: int) -> int:
    """The token id that stands for row `row` of the step in flight's sampled tokens."""
    return -1 - row


class PendingTokens:
    """A launched step's sampled tokens (row i is `seqs[i]`'s), on their way to the host."""

    def __init__(self, seqs: list[Sequence], tokens: torch.Tensor):
        self.seqs, self.tokens = seqs, tokens
        if tokens.is_cuda:
            self._host = torch.empty(tokens.shape, dtype=tokens.dtype, pin_memory=True)
            self._host.copy_(tokens, non_blocking=True)
            self._ready = torch.cuda.Event()
            self._ready.record()
        else:
            self._host, self._ready = tokens, None

    def on_host(self) -> list[int]:
        """The tokens, once the step has computed them (waits for it)."""
        if self._ready is not None:
            self._ready.synchronize()
        return self._host.tolist()


class OverlappedSteps:
    """Runs the plain decode steps of an engine one step ahead of their tokens (see the module's docstring)."""

    def __init__(self, scheduler: Scheduler, runner, output_processor: OutputProcessor, eos_token_id: int | None):
        self.scheduler, self.runner, self.output_processor = scheduler, runner, output_processor
        self.eos_token_id = eos_token_id
        self.pending: PendingTokens | None = None
        self.parked: list[Sequence] = []  # off the running queue: their placeholder's token is their last
        self._warned = False  # about a failed launch, once

    def can_overlap(self) -> bool:
        """Whether the next step will only decode running sequences that may overlap: nothing can be
        admitted or swapped in, and every running sequence's next block is free, so none is preempted."""
        scheduler, blocks = self.scheduler, self.scheduler.block_manager
        if scheduler.waiting or scheduler.swapped or not scheduler.running:
            return False
        needed = 0
        for seq in scheduler.running:
            if seq.is_finished or seq.is_prefill or not self.overlaps(seq):
                return False
            needed += blocks.missing_blocks(seq) + len(blocks.shared_write_indexes(seq))
        return needed <= blocks.num_free_blocks

    @staticmethod
    def overlaps(seq: Sequence) -> bool:
        """Whether `seq`'s step may run before its last token is on the host: its sampling reads neither
        its tokens nor its logits there, and it forks no samples."""
        params = seq.params
        return (params.logprobs is None and not params.changes_logits and not seq.needs_prompt_logprobs
                and Scheduler.seats(seq) == 1)

    def run(self, out: SchedulerOutput) -> int | None:
        """Launch `out` (from `schedule` after `can_overlap` said yes), then resolve the step before it,
        and leave a placeholder on each of `out`'s sequences that did not finish. Returns how many tokens
        the step before it added (`resolve`), or None if `out` was not launched (not a plain decode, or
        the launch failed): the caller then resolves and runs `unfinished(out)` synchronously, whose
        isolation of each request finds whose fault a failure was."""
        if out.preempted or out.swapped_out or out.swapped_in or any(n != 1 for n in out.num_new_tokens):
            return None
        try:
            forward = self.runner.forward(out.seqs, out.num_new_tokens,
                                          pending_tokens=None if self.pending is None else self.pending.tokens)
            tokens = self.runner.sample_on_device(forward.logits, forward.sampled_seqs, self.eos_token_id)
        except Exception as error:  # noqa: BLE001 - nothing changed yet: the synchronous step runs the same plan
            if not self._warned:
                self._warned = True
                warnings.warn(f"an overlapped step failed to launch ({type(error).__name__}: {error}); such "
                              "steps run synchronously instead", stacklevel=4)
            return None
        launched = PendingTokens(forward.sampled_seqs, tokens)
        added = self.resolve()
        self.pending = launched  # before any placeholder points at it
        for row, seq in enumerate(launched.seqs):
            if not seq.is_finished:
                seq.append_token(placeholder(row))
                if self.ends_at_its_placeholder(seq):
                    self._park(seq)
        if all(seq.is_finished for seq in launched.seqs):
            self.pending = None  # nothing stands for its tokens: keep none of its sequences
        return added

    def ends_at_its_placeholder(self, seq: Sequence) -> bool:
        """Whether `seq` finishes at its placeholder's token whatever it is: max_tokens or max_model_len."""
        return (seq.num_output_tokens >= seq.params.max_tokens
                or seq.num_tokens >= self.scheduler.config.max_model_len)

    def _park(self, seq: Sequence) -> None:
        """Take `seq` off the running queue until its last token is resolved: a step for it would be
        thrown away, and would make the batch differ from a synchronous run's."""
        self.parked.append(seq)
        self.scheduler.running.remove(seq)

    def resolve(self) -> int:
        """Wait for the step in flight and put its tokens in place of their placeholders, each with the
        stop rules, and release the sequences that finished; returns how many tokens. One sequence at a
        time, so an interrupted call can simply be made again (it counts only what it adds)."""
        added = 0
        if self.pending is not None:
            tokens, now = self.pending.on_host(), time.perf_counter()
            for row, (seq, token) in enumerate(zip(self.pending.seqs, tokens, strict=True)):
                if seq.token_ids[-1] != placeholder(row):  # resolved already, or finished before it got one
                    continue
                length = seq.num_tokens
                seq.token_ids.pop()
                try:
                    self.output_processor.append(seq, token, now)  # all or nothing
                except BaseException:
                    if seq.num_tokens < length:  # not appended: the placeholder stays for the next try
                        seq.token_ids.append(placeholder(row))
                    raise
                added += 1
            self.pending = None
        running = self.scheduler.running
        running.extend(seq for seq in self.parked if seq not in running)  # finished now: released below
        self.parked = []
        self.scheduler.release_finished()
        return added


def unfinished(out: SchedulerOutput) -> SchedulerOutput:
    """`out` without the sequences that finished after it was planned (their last token was resolved late)."""
    keep = [i for i, seq in enumerate(out.seqs) if not seq.is_finished]
    return dataclasses.replace(out, seqs=[out.seqs[i] for i in keep],
                               num_new_tokens=[out.num_new_tokens[i] for i in keep])
