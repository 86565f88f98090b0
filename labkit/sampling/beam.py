"""Beam search (book §10.5), with transformers' exact rules for length penalty and stopping.

Keep the `num_beams` best partial sequences by total log-probability; at each step extend all of
them by every token, and keep the best again. What transformers (5.x `_beam_search`) adds, and
this module reproduces so that both return the same hypotheses:

- each step considers the top `2 * num_beams` extensions (more with several EOS ids), so that
  `num_beams` beams can keep running even when some extensions end with EOS;
- an extension that ends (EOS, or the max_new_tokens-th token) is *finished* only if it ranks
  among the top `num_beams` extensions of its step; its score is
  sum_logprobs / generated_length ** length_penalty, where generated_length counts the new
  tokens including the EOS (not the prompt);
- the finished pool keeps the `num_beams` best scores;
- the search stops at max_new_tokens, or when the pool is full and either early_stopping is True,
  or the best running beam can no longer beat the worst finished one. That bound divides the best
  running sum by the current generated length ** length_penalty (early_stopping=False), or by
  max_new_tokens ** length_penalty when early_stopping="never" and length_penalty > 0.

Scores are float32 tensors throughout, as in transformers, so ties and rounding agree.

`BeamSearchParams` is vLLM's request for `LLM.beam_search`, which runs this search inside the
engine (labkit/engine/beam_search.py).
"""

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

StepLogitsFn = Callable[[list[list[int]]], torch.Tensor]


@dataclass(frozen=True)
class BeamSearchParams:
    """vLLM's beam-search request: keep `beam_width` beams for up to `max_tokens` new tokens.

    ignore_eos: never finish a beam on EOS. temperature: 0 scores beams with the model's raw
    log-probabilities; > 0 divides the logits by it first. length_penalty: a hypothesis scores
    cum_logprob / generated_length ** length_penalty (1 = the mean log-probability per token).
    """

    beam_width: int
    max_tokens: int
    ignore_eos: bool = False
    temperature: float = 0.0
    length_penalty: float = 1.0

    def __post_init__(self):
        for name in ("beam_width", "max_tokens"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be an integer >= 1, got {value!r}")
        if not isinstance(self.ignore_eos, bool):
            raise ValueError(f"ignore_eos must be True or False, got {self.ignore_eos!r}")
        for name, allowed, rule in [("temperature", lambda t: 0 <= t < math.inf, "must be finite and >= 0"),
                                    ("length_penalty", math.isfinite, "must be a finite number")]:
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not allowed(value):
                raise ValueError(f"{name} {rule}, got {value!r}")


@dataclass(frozen=True)
class BeamHypothesis:
    """A finished sequence: its new tokens (EOS included if it ended on one) and its scores."""

    token_ids: tuple[int, ...]
    sum_logprobs: float
    score: float  # sum_logprobs / len(token_ids) ** length_penalty


@dataclass(frozen=True)
class BeamCandidate:
    """One extension considered at one step, kept for drawing the search tree.

    `parent` indexes the previous step's running beams (in their order); status is "running" (it
    became a beam), "finished" (it entered the finished pool) or "dropped".
    """

    parent: int
    token_id: int
    sum_logprobs: float
    status: str


@dataclass(frozen=True)
class BeamSearchResult:
    hypotheses: list[BeamHypothesis]  # best score first
    steps: list[list[BeamCandidate]]  # per step, the extensions considered, best first

    @property
    def best(self) -> BeamHypothesis:
        return self.hypotheses[0]


def beam_search(
    step_logits_fn: StepLogitsFn,
    prompt_ids: Sequence[int],
    num_beams: int,
    max_new_tokens: int,
    length_penalty: float = 1.0,
    eos_token_id: int | Sequence[int] | None = None,
    early_stopping: bool | str = False,
) -> BeamSearchResult:
    """Beam search over any scorer.

    `step_logits_fn(sequences)` takes a list of token-id lists (prompt + tokens so far, one per
    running beam, all of one length) and returns next-token logits `[len(sequences), vocab]`: a
    transformers model, labkit's model, or a toy table all fit. early_stopping is True, False or
    "never", with transformers' meaning (see the module docstring).
    """
    if not isinstance(num_beams, int) or num_beams < 1:
        raise ValueError(f"num_beams must be an integer >= 1, got {num_beams!r}")
    if not isinstance(max_new_tokens, int) or max_new_tokens < 1:
        raise ValueError(f"max_new_tokens must be an integer >= 1, got {max_new_tokens!r}")
    if early_stopping not in (True, False, "never"):
        raise ValueError(f"early_stopping must be True, False or 'never', got {early_stopping!r}")
    if len(prompt_ids) == 0:
        raise ValueError("prompt_ids must hold at least one token")
    eos_ids = set() if eos_token_id is None else {eos_token_id} if isinstance(eos_token_id, int) else set(eos_token_id)
    candidates_per_step = max(2, 1 + len(eos_ids)) * num_beams

    running: list[tuple[int, ...]] = [()]  # one beam to start: every copy of the prompt would be equal
    running_sums = torch.zeros(1)
    finished: list[BeamHypothesis] = []
    steps: list[list[BeamCandidate]] = []
    for step in range(max_new_tokens):
        generated_length = step + 1
        logits = step_logits_fn([list(prompt_ids) + list(beam) for beam in running])
        if not isinstance(logits, torch.Tensor) or logits.dim() != 2 or logits.shape[0] != len(running):
            got = tuple(logits.shape) if isinstance(logits, torch.Tensor) else type(logits).__name__
            raise ValueError(f"step_logits_fn must return logits [{len(running)}, vocab], got {got}")
        vocab_size = logits.shape[-1]
        running_sums = running_sums.to(logits.device)  # the scorer's device: a GPU model's logits stay there
        totals = (running_sums.unsqueeze(-1) + torch.log_softmax(logits.float(), dim=-1)).flatten()
        top_sums, top_index = totals.topk(min(candidates_per_step, totals.numel()))
        parents, tokens = (top_index // vocab_size).tolist(), (top_index % vocab_size).tolist()
        last_step = generated_length == max_new_tokens
        ends = [last_step or token in eos_ids for token in tokens]
        scores = top_sums / generated_length**length_penalty

        statuses, kept = [], 0
        for rank, (parent, token, ended) in enumerate(zip(parents, tokens, ends, strict=True)):
            if ended and rank < num_beams:
                sequence = running[parent] + (token,)
                finished.append(BeamHypothesis(sequence, top_sums[rank].item(), scores[rank].item()))
                statuses.append("finished")
            elif not ended and kept < num_beams:
                statuses.append("running")
                kept += 1
            else:
                statuses.append("dropped")
        finished = sorted(finished, key=lambda h: -h.score)[:num_beams]  # stable: older wins a tie
        steps.append([
            BeamCandidate(parent, token, total, status)
            for parent, token, total, status in zip(parents, tokens, top_sums.tolist(), statuses, strict=True)
        ])
        if last_step:
            break
        keep = [rank for rank, status in enumerate(statuses) if status == "running"]
        running = [running[parents[rank]] + (tokens[rank],) for rank in keep]
        running_sums = top_sums[keep]
        if len(finished) == num_beams and (early_stopping is True or not _can_improve(
            running_sums[0], finished[-1].score, generated_length, max_new_tokens, length_penalty, early_stopping
        )):
            break
    return BeamSearchResult(finished, steps)


def _can_improve(best_running_sum, worst_finished_score, generated_length, max_new_tokens, length_penalty,
                 early_stopping) -> bool:
    """transformers' heuristic: could the best running beam still beat the worst finished hypothesis?"""
    if early_stopping == "never" and length_penalty > 0:
        generated_length = max_new_tokens  # a positive penalty favours length: assume the longest
    return bool(best_running_sum / generated_length**length_penalty > worst_finished_score)
