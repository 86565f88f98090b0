"""SamplingParams: how one request wants its tokens chosen, checked once when it is made.

The fields, their defaults and their meaning follow vLLM's `SamplingParams`, so a student who
knows one knows the other. Validation happens here, at construction, so the batched sampler can
trust every value it packs into a tensor and a bad request fails where it was written.
"""

import math
import warnings
from dataclasses import dataclass

MIN_TEMPERATURE = 1e-2  # vLLM's floor: below it logits / temperature overflow float32 into inf and NaN
MAX_TOP_K = 2**31 - 1  # any k above the vocabulary keeps every token; the sampler packs k into int32 range


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
        # Frozen: store immutable copies so nobody can change a validated request afterwards.
        object.__setattr__(self, "stop", tuple(self.stop))
        object.__setattr__(self, "stop_token_ids", tuple(self.stop_token_ids))

    def _check_number(self, name: str, allowed, rule: str):
        value = getattr(self, name)
        if not _is_number(value) or math.isnan(value) or not allowed(value):
            raise ValueError(f"{name} {rule}, got {value!r}")

    @property
    def greedy(self) -> bool:
        """vLLM's convention: temperature 0 picks the most likely token, with no randomness."""
        return self.temperature == 0
