"""When a request is finished: EOS, a stop token, a stop string, or max_tokens.

The engine calls `check_stop` for each sequence after appending its new token and detokenizing
it. Stop strings are searched in the text, not in the token ids, because one string can span
several tokens ("\\n\\nUser:" may arrive as "\\n", "\\nUser", ":") and one token can hold several
strings. Only the region where a match could newly end is searched, so a step costs O(new text).
"""

from collections.abc import Sequence
from dataclasses import dataclass

from labkit.sampling.params import SamplingParams


@dataclass(frozen=True)
class StopMatch:
    """A stop string found in the text: the output text ends at `start` (the string is not included)."""

    start: int
    stop: str


@dataclass(frozen=True)
class FinishState:
    """Why a sequence finished, in vLLM's terms.

    finish_reason: "stop" (EOS, a stop token or a stop string) or "length" (max_tokens reached).
    stop_reason: the stop string or stop token id that matched; None for EOS and for "length".
    text_end: where to cut the output text (a stop string's start), or None to keep it all.
    """

    finish_reason: str
    stop_reason: str | int | None = None
    text_end: int | None = None


def find_stop_string(text: str, stop: Sequence[str], num_new_chars: int) -> StopMatch | None:
    """The earliest stop string that ends within the last `num_new_chars` characters of `text`, or None.

    Earlier text was searched on earlier steps; a match that ends in the new characters may start
    before them (a stop string spanning tokens), so the search starts len(stop) - 1 characters back.
    """
    if num_new_chars < 0 or num_new_chars > len(text):
        raise ValueError(f"num_new_chars must be in [0, len(text)] = [0, {len(text)}], got {num_new_chars}")
    best = None
    for candidate in stop:
        start = text.find(candidate, max(0, len(text) - num_new_chars - len(candidate) + 1))
        if start != -1 and (best is None or start < best.start):
            best = StopMatch(start, candidate)
    return best


def check_stop(
    params: SamplingParams,
    output_token_ids: Sequence[int],
    text: str,
    num_new_chars: int,
    eos_token_id: int | None,
) -> FinishState | None:
    """Whether the sequence is finished after its newest token (the last of `output_token_ids`).

    `text` is the output detokenized so far, of which the last `num_new_chars` characters are new.
    Checked in vLLM's order: EOS (unless ignore_eos), stop token ids, stop strings, max_tokens;
    none of them before min_tokens tokens were generated (the sampler masks EOS and stop tokens
    until then, and a stop string that appears earlier does not count).
    """
    if len(output_token_ids) < max(1, params.min_tokens):
        return None
    last = output_token_ids[-1]
    if last == eos_token_id and not params.ignore_eos:
        return FinishState("stop")
    if last in params.stop_token_ids:
        return FinishState("stop", stop_reason=last)
    match = find_stop_string(text, params.stop, num_new_chars)
    if match is not None:
        return FinishState("stop", stop_reason=match.stop, text_end=match.start)
    if len(output_token_ids) >= params.max_tokens:
        return FinishState("length")
    return None
