"""SamplingParams: how one request wants its tokens chosen, checked once when it is made.

The fields, their defaults and their meaning follow vLLM's `SamplingParams`, so a student who
knows one knows the other. Validation happens here, at construction, so the batched sampler can
trust every value it packs into a tensor and a bad request fails where it was written.
"""

import math
import warnings
from collections.abc import Mapping
from dataclasses import dataclass
from types import MappingProxyType

MAX_LOGPROBS = 20  # vLLM's default max_logprobs: the most top entries a request may ask for
MIN_TEMPERATURE = 1e-2  # vLLM's floor: below it logits / temperature overflow float32 into inf and NaN
MAX_TOP_K = 2**31 - 1  # any k above the vocabulary keeps every token; the sampler packs k into int32 range
MAX_LOGIT_BIAS = 100.0  # OpenAI's range, [-100, 100]: enough to force or ban a token, and finite in float32


def _is_number(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _is_int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


@dataclass(frozen=True)
class SamplingParams:
    """Per-request sampling settings (vLLM's names and defaults).

    temperature: 0 means greedy (argmax); otherwise logits are divided by it. >= 0 and finite; a
        positive value below 0.01 is raised to 0.01 with a warning (vLLM's rule).
    top_k: keep the k most likely tokens; 0 or -1 disables. At most 2**31 - 1.
    top_p: keep the smallest set of most likely tokens whose probability reaches top_p. In (0, 1].
    min_p: drop tokens less likely than min_p times the most likely token's probability. In [0, 1].
    repetition_penalty: divide positive / multiply negative logits of tokens already in the prompt
        or output (transformers' and vLLM's rule). In [0.01, 100]; 1 disables.
    presence_penalty: subtract this from the logit of every token already generated. In [-2, 2].
    frequency_penalty: subtract this times the token's count so far in the output. In [-2, 2].
    max_tokens: the most tokens to generate. >= 1.
    stop: strings that end generation; the output is cut before the first one that appears.
    stop_token_ids: token ids that end generation (like EOS, but per request).
    ignore_eos: keep generating past the model's EOS token.
    seed: makes this request's draws reproducible, whatever else runs in the same batch.
    n: how many samples of the prompt to generate (parallel sampling). They share the prompt's KV
        blocks (fork + copy-on-write); with a seed, sample i draws with seed + i (vLLM's rule).
    logprobs: per generated token, the log-probabilities of the `logprobs` most likely tokens plus
        the sampled one (None: none). Raw: log_softmax of the model's logits before any processing.
    prompt_logprobs: the same for every prompt token (the first has none). Disables the prefix
        cache for the request's prompt, whose every position must be computed.
    min_tokens: EOS and stop_token_ids are masked (and stop strings ignored) until this many tokens
        were generated. In [0, max_tokens].
    logit_bias: {token id: bias} added to those logits before sampling (and before greedy's argmax).
        Each bias in [-100, 100] (OpenAI's range): +-100 already forces or bans a token, and a larger
        one would overflow float32 into inf, and inf - inf into NaN.
    allowed_token_ids: if given, every other token is masked out.
    include_stop_str_in_output: keep the matched stop string at the end of the output text.
    """

    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    max_tokens: int = 16
    stop: tuple[str, ...] = ()  # a list is accepted too and stored as a tuple
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    seed: int | None = None
    n: int = 1
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    min_tokens: int = 0
    logit_bias: dict[int, float] | None = None  # stored read-only
    allowed_token_ids: tuple[int, ...] | None = None  # a list is accepted too and stored as a tuple
    include_stop_str_in_output: bool = False

    def __post_init__(self):
        self._check_number("temperature", lambda t: 0 <= t < math.inf, "must be >= 0 and finite (0 means greedy)")
        if 0 < self.temperature < MIN_TEMPERATURE:
            warnings.warn(f"temperature {self.temperature} is below {MIN_TEMPERATURE}, where logits / temperature "
                          f"overflow; using {MIN_TEMPERATURE} (temperature=0 is greedy)", stacklevel=3)
            object.__setattr__(self, "temperature", MIN_TEMPERATURE)
        self._check_number("top_p", lambda p: 0 < p <= 1, "must be in (0, 1]")
        self._check_number("min_p", lambda p: 0 <= p <= 1, "must be in [0, 1]")
        self._check_number("repetition_penalty", lambda p: 0.01 <= p <= 100,
                           "must be in [0.01, 100] (1 disables it; further out one step degenerates)")
        self._check_number("presence_penalty", lambda p: -2 <= p <= 2, "must be in [-2, 2]")
        self._check_number("frequency_penalty", lambda p: -2 <= p <= 2, "must be in [-2, 2]")
        if not _is_int(self.top_k) or not -1 <= self.top_k <= MAX_TOP_K:
            raise ValueError(f"top_k must be an integer >= -1 and <= 2**31 - 1 (0 or -1 disables it), "
                             f"got {self.top_k!r}")
        if not _is_int(self.max_tokens) or self.max_tokens < 1:
            raise ValueError(f"max_tokens must be an integer >= 1, got {self.max_tokens!r}")
        if not isinstance(self.stop, (list, tuple)) or not all(isinstance(s, str) and s for s in self.stop):
            raise ValueError(f"stop must be a list of non-empty strings, got {self.stop!r}")
        if not isinstance(self.stop_token_ids, (list, tuple)) or not all(
            _is_int(t) and t >= 0 for t in self.stop_token_ids
        ):
            raise ValueError(f"stop_token_ids must be a list of token ids (integers >= 0), got {self.stop_token_ids!r}")
        if not isinstance(self.ignore_eos, bool):
            raise ValueError(f"ignore_eos must be True or False, got {self.ignore_eos!r}")
        if self.seed is not None and not (_is_int(self.seed) and -(2**63) <= self.seed < 2**63):
            raise ValueError(f"seed must be None or an integer in [-2**63, 2**63), got {self.seed!r}")
        if not _is_int(self.n) or self.n < 1:
            raise ValueError(f"n must be an integer >= 1 (the number of samples), got {self.n!r}")
        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(self, name)
            if value is not None and not (_is_int(value) and 0 <= value <= MAX_LOGPROBS):
                raise ValueError(f"{name} must be None or an integer in [0, {MAX_LOGPROBS}], got {value!r}")
        if not _is_int(self.min_tokens) or not 0 <= self.min_tokens <= self.max_tokens:
            raise ValueError(f"min_tokens must be an integer in [0, max_tokens={self.max_tokens}], "
                             f"got {self.min_tokens!r}")
        if self.logit_bias is not None and not (
            isinstance(self.logit_bias, Mapping)
            and all(_is_int(t) and t >= 0 and _is_number(b) and -MAX_LOGIT_BIAS <= b <= MAX_LOGIT_BIAS
                    for t, b in self.logit_bias.items())
        ):
            raise ValueError(f"logit_bias must be a dict of token id (integer >= 0) to a number in "
                             f"[-{MAX_LOGIT_BIAS:g}, {MAX_LOGIT_BIAS:g}], got {self.logit_bias!r}")
        if self.allowed_token_ids is not None and not (
            isinstance(self.allowed_token_ids, (list, tuple)) and self.allowed_token_ids
            and all(_is_int(t) and t >= 0 for t in self.allowed_token_ids)
        ):
            raise ValueError(f"allowed_token_ids must be None or a non-empty list of token ids (integers >= 0), "
                             f"got {self.allowed_token_ids!r}")
        if not isinstance(self.include_stop_str_in_output, bool):
            raise ValueError(
                f"include_stop_str_in_output must be True or False, got {self.include_stop_str_in_output!r}")
        # Frozen: store immutable copies so nobody can change a validated request afterwards.
        object.__setattr__(self, "stop", tuple(self.stop))
        object.__setattr__(self, "stop_token_ids", tuple(self.stop_token_ids))
        if self.logit_bias is not None:
            object.__setattr__(self, "logit_bias", MappingProxyType(dict(self.logit_bias)))
        if self.allowed_token_ids is not None:
            object.__setattr__(self, "allowed_token_ids", tuple(self.allowed_token_ids))

    def _check_number(self, name: str, allowed, rule: str):
        value = getattr(self, name)
        if not _is_number(value) or math.isnan(value) or not allowed(value):
            raise ValueError(f"{name} {rule}, got {value!r}")

    def token_ids_named(self) -> dict[str, list[int]]:
        """Every token id this request names, by field: the engine checks them against its vocabulary."""
        return {"stop_token_ids": list(self.stop_token_ids), "logit_bias": list(self.logit_bias or ()),
                "allowed_token_ids": list(self.allowed_token_ids or ())}

    @property
    def changes_logits(self) -> bool:
        """Whether anything but the filters touches the logits: penalties, bias, masks, min_tokens."""
        return (self.repetition_penalty != 1 or self.presence_penalty != 0 or self.frequency_penalty != 0
                or bool(self.logit_bias) or self.allowed_token_ids is not None or self.min_tokens > 0)

    @property
    def greedy(self) -> bool:
        """vLLM's convention: temperature 0 picks the most likely token, with no randomness."""
        return self.temperature == 0
