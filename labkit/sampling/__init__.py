"""Choosing the next token: SamplingParams, the logit filters, the batched Sampler, stop checks, beam search.

One concept per module: `params` (what a request asks for, validated), `filters` (temperature,
top-k, top-p, min-p with transformers' semantics), `penalties` (repetition, presence, frequency),
`processors` (allowed_token_ids, logit_bias, min_tokens), `sampler` (the vectorized, seeded per-row
sampler the engine calls each step), `logprobs` (what a request's logprobs report), `stop` (finish
reasons) and `beam` (beam search over any scorer).
"""

from labkit.sampling.beam import BeamCandidate, BeamHypothesis, BeamSearchParams, BeamSearchResult, beam_search
from labkit.sampling.filters import (
    apply_min_p,
    apply_temperature,
    apply_top_k,
    apply_top_p,
    filter_logits,
    keep_argmax,
)
from labkit.sampling.logprobs import Logprob
from labkit.sampling.params import SamplingParams
from labkit.sampling.penalties import apply_penalties, token_counts
from labkit.sampling.sampler import Sampler, SamplingMetadata, greedy_tokens
from labkit.sampling.stop import FinishState, StopMatch, check_stop, find_stop_string

__all__ = [
    "BeamCandidate",
    "BeamHypothesis",
    "BeamSearchParams",
    "BeamSearchResult",
    "FinishState",
    "Logprob",
    "Sampler",
    "SamplingMetadata",
    "SamplingParams",
    "StopMatch",
    "apply_min_p",
    "apply_penalties",
    "apply_temperature",
    "apply_top_k",
    "apply_top_p",
    "beam_search",
    "check_stop",
    "filter_logits",
    "find_stop_string",
    "greedy_tokens",
    "keep_argmax",
    "token_counts",
]
