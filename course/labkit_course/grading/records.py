"""The records graders hand to a student's function, kept apart from the graders themselves.

A student's kernel rebuilds these when a grader passes them (the codec carries course dataclasses
only), so they must be importable there; the graders' modules are not (they hold the references and
the knowledge checks' keys, and the sandbox hides them). Nothing here answers an exercise.
"""

from dataclasses import dataclass, field

import torch


@dataclass
class SimulatedClock:
    """Lab 04: a clock the grader controls; it moves only when the model below computes."""

    now: float = 100.0

    def __call__(self) -> float:
        return self.now


@dataclass
class ScriptedLM:
    """Lab 04: a stand-in model that owns its KV cache: it remembers every token fed to it, and its
    next token depends on all of them and their positions, so feeding a token twice, or skipping one,
    changes what it says. Each call advances the clock: a prefill by `prefill_ms` per token, a decode
    step by the next of `step_ms`."""

    vocab_size: int
    clock: SimulatedClock
    prefill_ms: float
    step_ms: list
    seen: list = field(default_factory=list)
    calls: list = field(default_factory=list)

    def __call__(self, token_ids) -> torch.Tensor:
        ids = [int(t) for t in token_ids]
        cost = self.prefill_ms * len(ids) if not self.calls else self.step_ms[(len(self.calls) - 1) % len(self.step_ms)]
        self.calls.append(ids)
        self.seen.extend(ids)
        self.clock.now += cost / 1e3
        winner = (sum(i * t for i, t in enumerate(self.seen, 1)) * 31 + 7 * len(self.seen)) % self.vocab_size
        logits = torch.linspace(-1.0, 1.0, self.vocab_size).roll(winner + 1)  # the runner-up sits next to it
        logits[winner] = 2.0
        return logits


@dataclass(frozen=True)
class Request:
    """Lab 10: a waiting request as the scheduling exercise sees it."""

    id: str
    priority: int  # higher runs first
    arrival: int  # earlier runs first among equal priorities
    prompt_len: int  # tokens still to prefill
    blocks: int  # KV blocks it needs to be admitted


@dataclass(frozen=True)
class Running:
    """Lab 10: a running sequence as the victim exercise sees it."""

    id: str
    priority: int  # higher runs first
    arrival: int  # earlier runs first among equal priorities
    block_table: tuple[int, ...]  # the KV blocks it holds


@dataclass(frozen=True)
class Active:
    """Lab 10: a running sequence as the token-budget exercise sees it."""

    id: str
    uncomputed: int  # tokens whose K/V is not computed yet: 1 for a decode
    is_prefill: bool  # still working through its prompt (or, after a recompute, prompt and outputs)


@dataclass
class Sample:
    """Lab 11: one sample (sequence) of a request as the abort exercise sees it: labkit's Sequence
    reduced to what abort reads and changes."""

    request_id: int
    index: int  # sample `index` of its request (SamplingParams.n); 0 is the request's first
    block_table: list[int]
    finish_reason: str | None = None
