"""What the engine returns, shaped like vLLM's outputs.

A `RequestOutput` per request holds one `CompletionOutput` per sample (`SamplingParams.n`), in
sample order. The course's shortcuts `out.text`, `out.token_ids`, `out.finish_reason` and
`out.stop_reason` read the first sample, so code written for n = 1 reads naturally.
`LLM.beam_search` returns a `BeamSearchOutput` per prompt, as vLLM does.
"""

from dataclasses import dataclass

from labkit.engine.metrics import RequestMetrics
from labkit.engine.sequence import FinishReason
from labkit.sampling.logprobs import PositionLogprobs


@dataclass(frozen=True)
class CompletionOutput:
    index: int  # which of the request's n samples
    text: str
    token_ids: list[int]
    cumulative_logprob: float | None  # sum of the sampled tokens' logprobs; None unless logprobs was asked
    logprobs: list[PositionLogprobs] | None  # one dict per generated token, if logprobs was asked
    finish_reason: FinishReason | None
    stop_reason: str | int | None = None

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass(frozen=True)
class RequestOutput:
    request_id: int
    prompt: str | None
    prompt_token_ids: list[int]
    prompt_logprobs: list[PositionLogprobs | None] | None  # first entry None: nothing predicts token 0
    outputs: list[CompletionOutput]
    finished: bool
    metrics: RequestMetrics  # sample 0's timings and token counts

    @property
    def text(self) -> str:
        return self.outputs[0].text

    @property
    def token_ids(self) -> list[int]:
        return self.outputs[0].token_ids

    @property
    def finish_reason(self) -> FinishReason | None:
        return self.outputs[0].finish_reason

    @property
    def stop_reason(self) -> str | int | None:
        return self.outputs[0].stop_reason


@dataclass(frozen=True)
class BeamSearchSequence:
    """One finished beam (vLLM's fields): `tokens` holds the prompt and the generated tokens."""

    tokens: list[int]
    text: str  # the generated text (without the prompt)
    cum_logprob: float  # sum of the generated tokens' log-probabilities
    score: float  # cum_logprob / (generated tokens) ** length_penalty: what the beams are ranked by
    finish_reason: str  # "stop" (EOS) or "length"


@dataclass(frozen=True)
class BeamSearchOutput:
    sequences: list[BeamSearchSequence]  # best score first
