"""Continuous batching: which sequences run in the next forward step, and how many tokens each.

Every step has a token budget (`max_num_batched_tokens`) and a sequence budget (`max_num_seqs`).
The scheduler fills it in a fixed order, highest priority first and, within a priority, first come
first served (the sequence design note):

1. RUNNING sequences: a decode costs one token; a prompt being prefilled in chunks takes what is
   left of the budget after one token for each decode behind it, and at most
   `long_prefill_token_threshold` tokens when that is set (vLLM's cap). A decode whose next token
   needs a new KV block (or a copy-on-write copy of a partial block it shares with a sibling
   sample, made right away by the block manager) and finds none preempts the lowest-priority
   running sequence whose release helps: one that frees a block, or the only other holder of the
   shared block it writes into (one whose blocks are all shared frees nothing; if none helps,
   itself): by *swap* (its blocks are copied to CPU memory and come back later) when
   `preemption_mode="swap"`, else by *recompute* (its blocks are freed; it re-enters the waiting
   queue and is prefilled again, generated tokens included).
2. SWAPPED sequences come back when their blocks fit again, in priority order.
3. WAITING sequences are admitted while blocks and budget last. A prompt longer than the budget
   that remains is prefilled in chunks over several steps (chunked prefill), so one long prompt
   never stalls the decodes of the others, and prefills and decodes share a step.
   Admission asks the block manager, which counts prefix-cache hits: cached blocks cost nothing.

No new work is admitted in a step that preempted (it would only be preempted back), and the head
of a queue is never skipped for a later, smaller request. Priorities age: a request gains one
level for every `priority_aging_steps` steps since it was added (a preemption does not reset
that), so a request of priority p ranks ahead of every request of priority q > p that arrived
(q - p + 1) * priority_aging_steps steps or more after it. Only the finitely many that arrived
before that can delay it: starvation is bounded.
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
    long_prefill_token_threshold: int = 0  # vLLM's: most prompt tokens one request runs per step; 0 = no cap
    priority_aging_steps: int | None = 50  # +1 effective priority per this many steps waited; None = strict

    def __post_init__(self):
        for name in ("max_num_seqs", "max_num_batched_tokens", "max_model_len"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be a positive integer, got {value!r}")
        if isinstance(self.long_prefill_token_threshold, bool) or not isinstance(
                self.long_prefill_token_threshold, int) or self.long_prefill_token_threshold < 0:
            raise ValueError("long_prefill_token_threshold must be an integer >= 0 (0 means no cap), "
                             f"got {self.long_prefill_token_threshold!r}")
        aging = self.priority_aging_steps
        if aging is not None and (isinstance(aging, bool) or not isinstance(aging, int) or aging < 1):
            raise ValueError(f"priority_aging_steps must be a positive integer or None, got {aging!r}")
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

    @property
    def num_batched_tokens(self) -> int:
        return sum(self.num_new_tokens)

    @property
    def is_empty(self) -> bool:
        return not self.seqs


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
        self.num_steps = 0  # schedule() calls: the clock of priority aging

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
        seq.arrival_step = self.num_steps
        self.waiting.append(seq)

    def abort(self, seq: Sequence) -> None:
        """Cancel a sequence wherever it is, returning its blocks (GPU or CPU) to the pool. One that
        already finished (but was not released yet) keeps its finish reason."""
        if seq in self.running:
            self.running.remove(seq)
            self.block_manager.deallocate(seq)
        elif seq in self.swapped:
            self.swapped.remove(seq)
            self.block_manager.deallocate(seq)  # drops the CPU copy
        elif seq in self.waiting:
            self.waiting.remove(seq)
        if not seq.is_finished:
            seq.finish(FinishReason.ABORTED)

    def fork(self, parent: Sequence, child: Sequence) -> None:
        """Run `child` (a new sample of a running `parent`) from now on, sharing the parent's KV blocks."""
        if parent not in self.running:
            raise ValueError(f"only a running sequence can be forked, {parent!r} is not running")
        self.block_manager.fork(parent, child)
        child.status = SequenceStatus.RUNNING
        self.running.append(child)

    def release_finished(self) -> None:
        """Release the sequences that finished outside `postprocess`: a step interrupted before it, or a
        token appended a step late (overlap.py), perhaps after a preemption queued the sequence again.
        Scheduled again, they would get a token past their end."""
        for seq in [s for queue in (self.running, self.waiting, self.swapped) for s in queue if s.is_finished]:
            self.abort(seq)

    @property
    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running or self.swapped)

    # --- one step ----------------------------------------------------------------------------
    def schedule(self) -> SchedulerOutput:
        """One step's plan: the running sequences first (preempting where the blocks run out), then the
        swapped ones back, then waiting requests (`admit_waiting`), within the step's token budget."""
        self.num_steps += 1
        self.release_finished()
        out = SchedulerOutput()
        budget = self.config.max_num_batched_tokens
        bm = self.block_manager

        # 1. Running sequences, highest priority first; the tail is where victims come from. A
        # sequence leaves `queue` only once it is placed, so an interrupted step loses nobody.
        queue = sorted(self.running, key=self.order)
        self.running = []
        try:
            while queue:
                seq = queue[0]
                if budget == 0:
                    self.running.append(queue.pop(0))  # stays running, just not in this step
                    continue
                while not bm.can_append(seq):
                    victim = self.choose_victim(queue)
                    self.preempt(victim, out)
                    queue.remove(victim)
                    if victim is seq:
                        break
                else:
                    bm.append(seq, self.kv_storage)  # copy-on-write copies are made here
                    # A prefill leaves one token of the budget to every decode still to come: a
                    # long prompt must not stall them.
                    decodes_after = sum(not s.is_prefill for s in queue[1:]) if seq.is_prefill else 0
                    n = self.chunk_size(seq, budget - decodes_after)
                    queue.pop(0)
                    if n == 0 and seq.is_prefill:  # the decodes behind it took what was left
                        self.running.append(seq)
                        continue
                    self._take(seq, n, out)
                    budget -= n
        finally:
            self.running.extend(queue)

        # 2. and 3.: nothing new enters a step that had to preempt.
        if out.preempted or out.swapped_out:
            return out
        self.swapped.sort(key=self.order)
        while self.swapped and budget > 0 and self._has_seats_for(self.swapped[0]):
            seq = self.swapped[0]
            # Its blocks come back, plus the block its pending token may need.
            if bm.blocks_needed(seq.num_tokens) > bm.num_free_blocks:
                break
            bm.swap_in(seq, self.kv_storage)
            bm.append(seq, self.kv_storage)  # copy-on-write copies are made here
            seq.status = SequenceStatus.RUNNING
            self.swapped.pop(0)
            out.swapped_in.append(seq)
            n = self.chunk_size(seq, budget)
            self._take(seq, n, out)
            budget -= n

        if self.swapped:  # the swapped come back before anything new starts
            return out
        self.admit_waiting(out, budget)
        return out

    def admit_waiting(self, out: SchedulerOutput, budget: int) -> None:
        """Step 3: admit waiting sequences in order while blocks, `budget` tokens and seats last."""
        self.waiting.sort(key=self.order)
        while self.waiting and budget > 0 and self._has_seats_for(self.waiting[0]):
            seq = self.waiting[0]
            if not self.block_manager.can_allocate(seq, self.uses_prefix_cache(seq)):
                break
            if not self.config.enable_chunked_prefill and seq.num_tokens > budget:
                break
            n = self.admit(seq, budget, out)
            budget -= n

    @staticmethod
    def seats(seq: Sequence) -> int:
        """The places in the batch `seq` will take: its request's n samples while it is sample 0 and they
        are not forked yet (they join the batch on its first token), else itself."""
        return 1 + (seq.params.n - len(seq.group) if seq.index == 0 else 0)

    def _has_seats_for(self, seq: Sequence) -> bool:
        """max_num_seqs counts samples: `seq` starts only if it and the samples it will fork fit."""
        return sum(map(self.seats, self.running)) + self.seats(seq) <= self.config.max_num_seqs

    @staticmethod
    def uses_prefix_cache(seq: Sequence) -> bool:
        """False for a request that wants every prompt position's logprobs: all of them are computed."""
        return not seq.needs_prompt_logprobs

    def admit(self, seq: Sequence, budget: int, out: SchedulerOutput) -> int:
        """Move `seq` from waiting to running with its blocks; it computes up to `budget` tokens now."""
        self.block_manager.allocate(seq, self.uses_prefix_cache(seq))
        # A prompt cached in full still runs its last token: that row gives the next token's logits.
        seq.num_cached_tokens = min(seq.num_cached_tokens, seq.num_tokens - 1)
        if seq.first_scheduled_time is None:
            seq.first_scheduled_time = time.perf_counter()
            seq.num_prefix_cached_tokens = seq.num_cached_tokens
        seq.status = SequenceStatus.RUNNING
        self.waiting.remove(seq)
        n = self.chunk_size(seq, budget)
        self._take(seq, n, out)
        return n

    def order(self, seq: Sequence) -> tuple[int, int]:
        """Sort key: higher effective priority first, then earlier arrival. The effective priority
        is the priority plus one for every `priority_aging_steps` steps since the request was added
        (preemptions do not reset it), so nothing waits forever behind a stream of higher ones."""
        return (-self.effective_priority(seq), seq.arrival_order)

    def effective_priority(self, seq: Sequence) -> int:
        """`seq`'s priority with its age bonus (see `order`)."""
        aging = self.config.priority_aging_steps
        return seq.priority + (0 if aging is None else (self.num_steps - seq.arrival_step) // aging)

    def chunk_size(self, seq: Sequence, budget: int) -> int:
        """How many of its uncomputed tokens `seq` runs now: what the budget allows, and a prefill
        at most `long_prefill_token_threshold` (when set) so one long prompt cannot take a step."""
        n = min(seq.num_uncomputed_tokens, max(budget, 0))
        return self.capped_prefill(n) if seq.is_prefill else n

    def capped_prefill(self, num_tokens: int) -> int:
        """A prefill's tokens this step under `long_prefill_token_threshold` (vLLM's cap; 0: none)."""
        cap = self.config.long_prefill_token_threshold
        return min(num_tokens, cap) if cap > 0 else num_tokens

    def choose_victim(self, queue: list[Sequence]) -> Sequence:
        """The sequence to preempt so that `queue[0]` can grow: the lowest in order whose release
        helps it, else `queue[0]` itself. A release helps if it frees a block (ref_count 1: a block
        shared by a fork or the prefix cache frees nothing), or if the victim is the only other
        holder of the shared block `queue[0]` writes into next (a sibling sample): then that block
        needs no copy-on-write."""
        blocks = self.block_manager.blocks
        write_block = self.block_manager.shared_write_block(queue[0])
        for seq in reversed(queue[1:]):
            if any(blocks[b].ref_count == 1 for b in seq.block_table):
                return seq
            if write_block is not None and blocks[write_block].ref_count == 2 and write_block in seq.block_table:
                return seq
        return queue[0]

    def _take(self, seq: Sequence, n: int, out: SchedulerOutput) -> None:
        self.running.append(seq)
        out.seqs.append(seq)
        out.num_new_tokens.append(n)

    def preempt(self, seq: Sequence, out: SchedulerOutput) -> None:
        """Take a running `seq` off the GPU: swap its K/V out (preemption_mode "swap"), or free its
        blocks and queue it again to recompute; `out` records which."""
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
