"""One request's whole life in the engine: its tokens, its KV blocks, its state and its timings.

The lifecycle is the sequence design note's ("Sequence & KV Cache"):

    WAITING --schedule--> RUNNING --EOS / max tokens / stop string / abort--> FINISHED
       ^                    |  ^
       |  preempt           |  |  swap in
       +--(recompute)-------+  |
                            v  |
                           SWAPPED  (KV blocks copied to CPU memory)

A sequence preempted by recompute goes back to WAITING and loses its KV blocks; when it is
admitted again, its prompt *and* the tokens it already generated are prefilled together, so
nothing it produced is lost. The block manager sees a sequence through four attributes
(`seq_id`, `token_ids`, `block_table`, `num_cached_tokens`); the rest is the engine's.
"""

import itertools
import time
from enum import Enum
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from labkit.sampling import SamplingParams


class SequenceStatus(Enum):
    WAITING = "waiting"
    RUNNING = "running"
    SWAPPED = "swapped"
    FINISHED = "finished"


class FinishReason(str, Enum):
    """The sequence design note's four reasons, and ERROR. vLLM reports EOS and STOP both as "stop"; labkit keeps
    them apart."""

    EOS = "eos"  # the model produced an end-of-sequence token
    MAX_TOKENS = "length"  # max_tokens (or max_model_len) reached: vLLM's "length"
    STOP = "stop"  # a stop string or stop token appeared
    ABORTED = "abort"  # cancelled by the caller
    ERROR = "error"  # its step failed (stop_reason holds the error); the other requests went on

    def __str__(self) -> str:
        return self.value


class Sequence:
    _ids = itertools.count()

    def __init__(self, prompt_token_ids: list[int], params: "SamplingParams", priority: int = 0,
                 prompt: str | None = None, seq_id: int | None = None):
        if not prompt_token_ids:
            raise ValueError("prompt_token_ids is empty: a request needs at least one prompt token")
        self.seq_id = next(Sequence._ids) if seq_id is None else seq_id
        self.prompt = prompt
        self.params = params
        self.priority = int(priority)
        self.arrival_order = next(Sequence._ids)  # ties in priority go first-come, first-served
        self.arrival_step = 0  # the scheduler's step count when it was added: its age, for aging
        self.token_ids: list[int] = list(prompt_token_ids)  # prompt, then outputs: what the KV cache holds
        self.num_prompt_tokens = len(prompt_token_ids)
        self.block_table: list[int] = []
        self.num_cached_tokens = 0  # leading tokens whose K/V is stored in block_table's blocks
        self.status = SequenceStatus.WAITING
        self.finish_reason: FinishReason | None = None
        self.stop_reason: str | int | None = None  # which stop string / token ended it
        self.text = ""  # detokenized output, maintained by the engine for stop strings and streaming
        # Metrics (time.perf_counter seconds) and counters.
        self.arrival_time = time.perf_counter()
        self.first_scheduled_time: float | None = None
        self.first_token_time: float | None = None
        self.finish_time: float | None = None
        self.num_prefix_cached_tokens = 0  # prompt tokens served by the prefix cache at first admission
        self.num_preemptions = 0
        self.num_swaps = 0
        # A request's samples (SamplingParams.n): this one is sample `index`; `group` lists them all,
        # in index order, and is shared by all of them. The request's id is that of sample 0.
        self.request_id = self.seq_id
        self.index = 0
        self.group: list[Sequence] = [self]
        # Asked-for logprobs (see labkit/sampling/logprobs.py); prompt_logprobs live on sample 0.
        self.logprobs: list | None = None if params.logprobs is None else []
        self.cumulative_logprob: float | None = None if params.logprobs is None else 0.0
        self.prompt_logprobs: list | None = None if params.prompt_logprobs is None else [None]

    # --- token views -------------------------------------------------------------------------
    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def prompt_token_ids(self) -> list[int]:
        return self.token_ids[: self.num_prompt_tokens]

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens:]

    @property
    def known_output_token_ids(self) -> list[int]:
        """output_token_ids without a trailing placeholder (an id < 0): the token an overlapped step drew,
        still on the device, whose id the host does not know yet (labkit/engine/overlap.py)."""
        ids = self.output_token_ids
        return ids[:-1] if ids and ids[-1] < 0 else ids

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens

    @property
    def num_uncomputed_tokens(self) -> int:
        """Tokens whose K/V the model has not produced yet: the rest of a prefill, or 1 to decode."""
        return len(self.token_ids) - self.num_cached_tokens

    @property
    def is_prefill(self) -> bool:
        """More than the last token is still to compute (a prompt, or a recompute after preemption)."""
        return self.num_uncomputed_tokens > 1

    @property
    def is_finished(self) -> bool:
        return self.status is SequenceStatus.FINISHED

    @property
    def needs_prompt_logprobs(self) -> bool:
        """prompt_logprobs were asked for and some prompt position has none yet."""
        return self.prompt_logprobs is not None and len(self.prompt_logprobs) < self.num_prompt_tokens

    @property
    def group_finished(self) -> bool:
        return all(seq.is_finished for seq in self.group)

    # --- transitions -------------------------------------------------------------------------
    def fork(self, seq_id: int, params: "SamplingParams", index: int) -> "Sequence":
        """Sample `index` of the same request: same tokens so far, its own params (its seed).

        Only the Sequence is made here; the engine adds it to `group` (shared by all samples) and
        shares the KV blocks (BlockManager.fork) once its first token is drawn.
        """
        child = Sequence(self.token_ids, params, self.priority, self.prompt, seq_id)
        child.num_prompt_tokens = self.num_prompt_tokens
        child.arrival_order, child.arrival_time = self.arrival_order, self.arrival_time
        child.arrival_step = self.arrival_step
        child.first_scheduled_time = self.first_scheduled_time
        child.num_prefix_cached_tokens = self.num_prefix_cached_tokens
        child.status, child.text = self.status, self.text
        child.request_id, child.index, child.group = self.request_id, index, self.group
        child.prompt_logprobs = None
        return child

    def append_token(self, token_id: int) -> None:
        self.token_ids.append(token_id)

    def finish(self, reason: FinishReason, stop_reason: str | int | None = None) -> None:
        self.status = SequenceStatus.FINISHED
        self.finish_reason = reason
        self.stop_reason = stop_reason
        self.finish_time = time.perf_counter()

    def __repr__(self) -> str:
        return (f"Sequence(id={self.seq_id}, {self.status.value}, priority={self.priority}, "
                f"tokens={self.num_prompt_tokens}+{self.num_output_tokens}, cached={self.num_cached_tokens})")
