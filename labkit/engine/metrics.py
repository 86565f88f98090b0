"""What a serving engine is judged by: per request TTFT and TPOT, for the engine throughput,
prefix-cache hit rate, preemptions and swaps.

- TTFT (time to first token): arrival -> first generated token; queueing and the prefill count.
- TPOT (time per output token): the mean gap between later tokens, (finish - first) / (n - 1).
- Throughput: generated tokens per second of engine time (time spent inside `step`).
"""

from collections import deque
from dataclasses import dataclass, field

from labkit.engine.sequence import Sequence


@dataclass(frozen=True)
class RequestMetrics:
    arrival_time: float
    first_scheduled_time: float | None
    first_token_time: float | None
    finish_time: float | None
    num_prompt_tokens: int
    num_output_tokens: int
    num_prefix_cached_tokens: int
    num_preemptions: int
    num_swaps: int

    @classmethod
    def of(cls, seq: Sequence) -> "RequestMetrics":
        return cls(seq.arrival_time, seq.first_scheduled_time, seq.first_token_time, seq.finish_time,
                   seq.num_prompt_tokens, seq.num_output_tokens, seq.num_prefix_cached_tokens,
                   seq.num_preemptions, seq.num_swaps)

    @property
    def ttft(self) -> float | None:
        return None if self.first_token_time is None else self.first_token_time - self.arrival_time

    @property
    def tpot(self) -> float | None:
        if self.finish_time is None or self.first_token_time is None or self.num_output_tokens < 2:
            return None
        return (self.finish_time - self.first_token_time) / (self.num_output_tokens - 1)


FINISHED_WINDOW = 1000  # the most recent finished requests whose metrics are kept one by one


@dataclass
class _Mean:
    """A running mean of the values that are not None."""

    total: float = 0.0
    count: int = 0

    def add(self, value: float | None) -> None:
        if value is not None:
            self.total += value
            self.count += 1

    @property
    def value(self) -> float | None:
        return self.total / self.count if self.count else None


@dataclass
class EngineMetrics:
    """Counters over the engine's whole life. Per request, only the last FINISHED_WINDOW finished
    requests are kept (`finished`, for percentiles); the means cover every request, so a
    long-running engine's memory stays bounded."""

    num_steps: int = 0
    num_batched_tokens: int = 0  # tokens the model ran (prefill and decode; prefix-cache hits excluded)
    num_generated_tokens: int = 0
    num_preemptions: int = 0  # by recompute
    num_swaps: int = 0  # swap-outs
    busy_time: float = 0.0  # seconds spent inside step()
    num_finished: int = 0
    finished: deque[RequestMetrics] = field(default_factory=lambda: deque(maxlen=FINISHED_WINDOW))
    prefix_cache_queried_tokens: int = 0
    prefix_cache_hit_tokens: int = 0
    num_draft_tokens: int = 0  # speculative decoding: tokens drafters proposed
    num_accepted_draft_tokens: int = 0  # ... and the target kept
    num_verify_passes: int = 0  # ... and the sequence-steps that verified drafts
    _ttft: _Mean = field(default_factory=_Mean, repr=False)
    _tpot: _Mean = field(default_factory=_Mean, repr=False)

    def record_step(self, out, num_batched_tokens: int, num_sampled: int, elapsed: float, block_manager,
                    speculative=None) -> None:
        """Count one engine step: `out` is what the scheduler ran; the prefix-cache and speculative
        counters are copied from the block manager's and the speculative decoder's totals."""
        self.num_steps += 1
        self.busy_time += elapsed
        self.num_generated_tokens += num_sampled
        self.num_batched_tokens += num_batched_tokens
        self.num_preemptions += len(out.preempted)
        self.num_swaps += len(out.swapped_out)
        self.prefix_cache_queried_tokens = block_manager.stats.queried_tokens
        self.prefix_cache_hit_tokens = block_manager.stats.hit_tokens
        if speculative is not None:
            self.num_draft_tokens += speculative.num_draft_tokens
            self.num_accepted_draft_tokens += speculative.num_accepted_tokens
            self.num_verify_passes += speculative.num_verify_passes

    def record(self, request: RequestMetrics) -> None:
        """Count one finished request."""
        self.num_finished += 1
        self.finished.append(request)
        self._ttft.add(request.ttft)
        self._tpot.add(request.tpot)

    @property
    def throughput(self) -> float:
        """Generated tokens per second of engine time."""
        return self.num_generated_tokens / self.busy_time if self.busy_time else 0.0

    @property
    def prefix_cache_hit_rate(self) -> float:
        q = self.prefix_cache_queried_tokens
        return self.prefix_cache_hit_tokens / q if q else 0.0

    @property
    def acceptance_rate(self) -> float:
        """The share of drafted tokens the target kept (speculative decoding)."""
        return self.num_accepted_draft_tokens / self.num_draft_tokens if self.num_draft_tokens else 0.0

    @property
    def tokens_per_target_forward(self) -> float:
        """Tokens a sequence gained per target forward that verified drafts: accepted + 1."""
        passes = self.num_verify_passes
        return (self.num_accepted_draft_tokens + passes) / passes if passes else 0.0

    @property
    def mean_ttft(self) -> float | None:
        return self._ttft.value

    @property
    def mean_tpot(self) -> float | None:
        return self._tpot.value

    def summary(self) -> str:
        ms = lambda x: "n/a" if x is None else f"{1000 * x:.1f} ms"  # noqa: E731
        return (f"{self.num_finished} requests, {self.num_generated_tokens} tokens generated in "
                f"{self.num_steps} steps; throughput {self.throughput:.1f} tok/s; mean TTFT "
                f"{ms(self.mean_ttft)}, mean TPOT {ms(self.mean_tpot)}; prefix-cache hit rate "
                f"{self.prefix_cache_hit_rate:.1%}; preemptions {self.num_preemptions}, swaps {self.num_swaps}")
