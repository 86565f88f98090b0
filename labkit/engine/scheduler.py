"""Continuous batching: which sequences run in the next forward step, and how many tokens each.

Every step has a token budget (`max_num_batched_tokens`) and a sequence budget (`max_num_seqs`).
The scheduler fills it in a fixed order, highest priority first and, within a priority, first come
first served (the sequence design note):

1. RUNNING sequences: a decode costs one token; a prompt being prefilled in chunks takes what is
   left of the budget. A decode whose next token needs a new KV block and finds none preempts the
   lowest-priority running sequence (the last in that order; possibly itself): by *swap* (its
   blocks are copied to CPU memory and come back later) when `preemption_mode="swap"`, else by
   *recompute* (its blocks are freed; it re-enters the waiting queue and is prefilled again,
   generated tokens included).
2. SWAPPED sequences come back when their blocks fit again, in priority order.
3. WAITING sequences are admitted while blocks and budget last. A prompt longer than the budget
   that remains is prefilled in chunks over several steps (chunked prefill), so one long prompt
   never stalls the decodes of the others, and prefills and decodes share a step.
   Admission asks the block manager, which counts prefix-cache hits: cached blocks cost nothing.

No new work is admitted in a step that preempted (it would only be preempted back), and the head
of a queue is never skipped for a later, smaller request, so a high-priority request cannot starve.
Waiting never deadlocks: a request that could not run even in an empty cache is rejected by
`check_fits` when it is added, so the head of the queue always fits once running work finishes.
"""

import time
from dataclasses import dataclass, field

from labkit.engine.sequence import FinishReason, Sequence, SequenceStatus


@dataclass
class SchedulerConfig:
    max_num_seqs: int = 32
    max_num_batched_tokens: int = 512
    max_model_len: int = 2048
    enable_chunked_prefill: bool = True
    preemption_mode: str = "recompute"  # or "swap": copy a victim's blocks to CPU memory

    def __post_init__(self):
        for name in ("max_num_seqs", "max_num_batched_tokens", "max_model_len"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be a positive integer, got {value!r}")
        if self.preemption_mode not in ("recompute", "swap"):
            raise ValueError(f"preemption_mode must be 'recompute' or 'swap', got {self.preemption_mode!r}")
        if not self.enable_chunked_prefill and self.max_num_batched_tokens < self.max_model_len:
            raise ValueError(
                f"without chunked prefill a whole prompt must fit in one step: max_num_batched_tokens "
                f"({self.max_num_batched_tokens}) must be at least max_model_len ({self.max_model_len})"
            )


@dataclass
class SchedulerOutput:
    """One step's plan: `seqs[i]` computes its next `num_new_tokens[i]` tokens."""

    seqs: list[Sequence] = field(default_factory=list)
    num_new_tokens: list[int] = field(default_factory=list)
    preempted: list[Sequence] = field(default_factory=list)  # by recompute, back to WAITING
    swapped_out: list[Sequence] = field(default_factory=list)
    swapped_in: list[Sequence] = field(default_factory=list)
    blocks_to_copy: list[tuple[int, int]] = field(default_factory=list)  # copy-on-write, before the forward

    @property
    def num_batched_tokens(self) -> int:
        return sum(self.num_new_tokens)

    @property
    def is_empty(self) -> bool:
        return not self.seqs


def priority_order(seq: Sequence) -> tuple[int, int]:
    """Sort key: higher priority first, then earlier arrival."""
    return (-seq.priority, seq.arrival_order)


class Scheduler:
    def __init__(self, config: SchedulerConfig, block_manager, kv_storage=None):
        """`kv_storage` (read_blocks / write_blocks) is where swapping copies K/V from and back to."""
        if config.preemption_mode == "swap" and kv_storage is None:
            raise ValueError("preemption_mode='swap' needs the kv_storage that swapping copies from")
        self.config = config
        self.block_manager = block_manager
        self.kv_storage = kv_storage
        self.waiting: list[Sequence] = []
        self.running: list[Sequence] = []
        self.swapped: list[Sequence] = []

    # --- requests ----------------------------------------------------------------------------
    def max_total_tokens(self, seq: Sequence) -> int:
        """The most tokens this sequence can ever hold: prompt + max_tokens, capped at max_model_len."""
        return min(seq.num_prompt_tokens + seq.params.max_tokens, self.config.max_model_len)

    def check_fits(self, seq: Sequence) -> None:
        """Reject at once a request that could never complete, instead of waiting for it forever."""
        if seq.num_prompt_tokens >= self.config.max_model_len:
            raise ValueError(
                f"prompt has {seq.num_prompt_tokens} tokens but max_model_len is {self.config.max_model_len}: "
                "it leaves no room to generate a token; shorten the prompt or raise max_model_len"
            )
        bm = self.block_manager
        needed = -(-self.max_total_tokens(seq) // bm.block_size)
        if needed > bm.num_blocks:
            raise ValueError(
                f"request needs up to {needed} KV blocks ({self.max_total_tokens(seq)} tokens of "
                f"{bm.block_size}) but the whole cache has {bm.num_blocks}: lower max_tokens or give "
                "the engine more KV-cache blocks"
            )

    def add(self, seq: Sequence) -> None:
        self.check_fits(seq)
        seq.status = SequenceStatus.WAITING
        self.waiting.append(seq)

    def abort(self, seq: Sequence) -> None:
        """Cancel a sequence wherever it is, returning its blocks (GPU or CPU) to the pool."""
        if seq.is_finished:
            return
        if seq in self.running:
            self.running.remove(seq)
            self.block_manager.deallocate(seq)
        elif seq in self.swapped:
            self.swapped.remove(seq)
            self.block_manager.deallocate(seq)  # drops the CPU copy
        elif seq in self.waiting:
            self.waiting.remove(seq)
        seq.finish(FinishReason.ABORTED)

    def fork(self, parent: Sequence, child: Sequence) -> None:
        """Run `child` (a new sample of a running `parent`) from now on, sharing the parent's KV blocks."""
        if parent not in self.running:
            raise ValueError(f"only a running sequence can be forked, {parent!r} is not running")
        self.block_manager.fork(parent, child)
        child.status = SequenceStatus.RUNNING
        self.running.append(child)

    @property
    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running or self.swapped)

    # --- one step ----------------------------------------------------------------------------
    def schedule(self) -> SchedulerOutput:
        out = SchedulerOutput()
        budget = self.config.max_num_batched_tokens
        bm = self.block_manager

        # 1. Running sequences, highest priority first; the tail is where victims come from.
        queue = sorted(self.running, key=priority_order)
        self.running = []
        while queue:
            seq = queue.pop(0)
            if budget == 0:
                self.running.append(seq)  # stays running, just not in this step
                continue
            while not bm.can_append(seq):
                victim = queue.pop() if queue else seq
                self._preempt(victim, out)
                if victim is seq:
                    break
            else:
                out.blocks_to_copy.extend(bm.append(seq))
                n = min(seq.num_uncomputed_tokens, budget)
                self._take(seq, n, out)
                budget -= n

        # 2. and 3.: nothing new enters a step that had to preempt.
        if out.preempted or out.swapped_out:
            return out
        self.swapped.sort(key=priority_order)
        while self.swapped and budget > 0 and len(self.running) < self.config.max_num_seqs:
            seq = self.swapped[0]
            # Its blocks come back, plus the block its pending token may need.
            if bm.blocks_needed(seq.num_tokens) > bm.num_free_blocks:
                break
            self.swapped.pop(0)
            bm.swap_in(seq, self.kv_storage)
            out.blocks_to_copy.extend(bm.append(seq))
            seq.status = SequenceStatus.RUNNING
            out.swapped_in.append(seq)
            n = min(seq.num_uncomputed_tokens, budget)
            self._take(seq, n, out)
            budget -= n

        if self.swapped:  # the swapped come back before anything new starts
            return out
        self.waiting.sort(key=priority_order)
        while self.waiting and budget > 0 and len(self.running) < self.config.max_num_seqs:
            seq = self.waiting[0]
            use_prefix_cache = not seq.needs_prompt_logprobs  # every prompt position's logits are wanted
            if not bm.can_allocate(seq, use_prefix_cache):
                break
            if not self.config.enable_chunked_prefill and seq.num_tokens > budget:
                break
            self.waiting.pop(0)
            bm.allocate(seq, use_prefix_cache)
            # A prompt cached in full still runs its last token: that row gives the next token's logits.
            seq.num_cached_tokens = min(seq.num_cached_tokens, seq.num_tokens - 1)
            if seq.first_scheduled_time is None:
                seq.first_scheduled_time = time.perf_counter()
                seq.num_prefix_cached_tokens = seq.num_cached_tokens
            seq.status = SequenceStatus.RUNNING
            n = min(seq.num_uncomputed_tokens, budget)
            self._take(seq, n, out)
            budget -= n
        return out

    def _take(self, seq: Sequence, n: int, out: SchedulerOutput) -> None:
        self.running.append(seq)
        out.seqs.append(seq)
        out.num_new_tokens.append(n)

    def _preempt(self, seq: Sequence, out: SchedulerOutput) -> None:
        seq.num_preemptions += 1
        if self.config.preemption_mode == "swap":
            self.block_manager.swap_out(seq, self.kv_storage)
            seq.status = SequenceStatus.SWAPPED
            seq.num_swaps += 1
            self.swapped.append(seq)
            out.swapped_out.append(seq)
        else:
            self.block_manager.deallocate(seq)
            seq.num_cached_tokens = 0
            seq.status = SequenceStatus.WAITING
            self.waiting.append(seq)
            out.preempted.append(seq)

    # --- after the forward step --------------------------------------------------------------
    def postprocess(self, out: SchedulerOutput) -> list[Sequence]:
        """Advance each scheduled sequence by the tokens it computed; release the finished ones.

        The caller has appended the sampled token to every sequence whose step reached its end
        and decided whether it finished. Returns the sequences that finished in this step.
        """
        finished = []
        for seq, n in zip(out.seqs, out.num_new_tokens, strict=True):
            if seq.is_finished and seq not in self.running:  # aborted in the meantime: already released
                finished.append(seq)
                continue
            seq.num_cached_tokens += n  # before any release: the prefix cache keeps computed blocks only
            if seq.is_finished:
                self.running.remove(seq)
                self.block_manager.deallocate(seq)
                finished.append(seq)
        return finished
