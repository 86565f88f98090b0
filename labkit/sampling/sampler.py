"""The batched sampler: one call per engine step picks the next token of every running sequence.

How the engine calls it, once per step, with the logits of each sequence's last position:

    metadata = SamplingMetadata.from_requests(
        [seq.params for seq in running],           # SamplingParams per row
        [seq.prompt_token_ids for seq in running], # for repetition_penalty
        [seq.output_token_ids for seq in running], # generated so far: penalties, and the step counter
        device=logits.device,
    )
    next_tokens = sampler(logits, metadata)       # LongTensor [batch]

Per row, in this order (vLLM's and transformers'): the processors of `processors.py` (allowed
token ids, logit bias, min_tokens) and the penalties on the raw logits; then greedy rows
(temperature 0) take the argmax, and the others go through temperature, top-k, top-p, min-p and a
draw from what is left. Everything is tensor operations over the whole batch; the only Python
loop is the one that packs the requests' lists into tensors.

Seeds. A seeded request must draw the same tokens whichever requests share its batch and in
whichever row it sits, and again after being preempted and recomputed. A torch.Generator per row
would need a Python loop over rows every step. Instead the randomness is a counter-based hash:
the uniform for vocabulary entry i of a request with seed s at step t (tokens generated so far)
is hash(s, t, i), computed for the whole batch at once. It depends on nothing but those three
numbers. The draw is the Gumbel-max trick: argmax_i(logit_i - log(-log u_i)) is distributed as
softmax(logits), which is exact sampling from the filtered distribution. Requests without a seed
get a fresh random seed from torch's global generator each step (so `torch.manual_seed` makes a
whole run reproducible).
"""

import warnings
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from labkit.device import upload
from labkit.sampling import triton_draw
from labkit.sampling.filters import NEG_INF, apply_min_p, apply_temperature, apply_top_k, apply_top_p
from labkit.sampling.params import SamplingParams
from labkit.sampling.penalties import PAD_ID, apply_penalties
from labkit.sampling.processors import logit_offsets

_MASK32 = 0xFFFFFFFF


def _mul32(x: torch.Tensor, c: int) -> torch.Tensor:
    """x * c mod 2**32 for x in [0, 2**32), without overflowing int64 (split x into 16-bit halves)."""
    low, high = x & 0xFFFF, x >> 16
    return (low * c + (((high * c) & 0xFFFF) << 16)) & _MASK32


def hash32(x: torch.Tensor) -> torch.Tensor:
    """A well-mixed 32-bit integer hash (Chris Wellons' "lowbias32"), element-wise on int64 tensors."""
    x = x & _MASK32
    x = x ^ (x >> 16)
    x = _mul32(x, 0x7FEB352D)
    x = x ^ (x >> 15)
    x = _mul32(x, 0x846CA68B)
    return x ^ (x >> 16)


def row_keys(seeds: torch.Tensor, steps: torch.Tensor) -> torch.Tensor:
    """One 32-bit key per row `[batch]`, from its seed (64 bits) and step."""
    return hash32(hash32(hash32(seeds & _MASK32) ^ ((seeds >> 32) & _MASK32)) ^ (steps & _MASK32))


def uniforms_of(keys: torch.Tensor, vocab_hash: torch.Tensor) -> torch.Tensor:
    """Uniforms in (0, 1), float64, for row keys and hashed vocabulary indices of the same shape."""
    return (hash32(keys ^ vocab_hash).to(torch.float64) + 0.5) / 2.0**32


def seeded_uniforms(seeds: torch.Tensor, steps: torch.Tensor, vocab_hash: torch.Tensor) -> torch.Tensor:
    """Uniforms in (0, 1), `[batch, vocab]` float64, a pure function of (seed, step, vocabulary index).

    `vocab_hash` is `hash32(arange(vocab))`, computed once by the Sampler.
    """
    return uniforms_of(row_keys(seeds, steps).unsqueeze(-1), vocab_hash)


GREEDY_BLOCK = 1024  # vocabulary entries per block of `greedy_tokens`' first pass


def greedy_tokens(logits: torch.Tensor) -> torch.Tensor:
    """Each row's argmax of `logits` [batch, vocab], exactly torch's `max(-1).indices` (the first
    maximum; a NaN counts as the largest), in two passes. On a CPU, torch's max-with-index over a
    49,152-wide row runs ~6x slower than a plain max: so the first pass takes the plain max of each
    block of GREEDY_BLOCK entries, and the index search runs only inside the first block that holds
    the row's maximum (an earlier block holding it would hold an earlier maximum)."""
    rows, vocab = logits.shape
    if vocab % GREEDY_BLOCK:
        return logits.max(-1).indices
    blocks = logits.view(rows, vocab // GREEDY_BLOCK, GREEDY_BLOCK)
    block = blocks.amax(-1).max(-1).indices
    within = blocks[torch.arange(rows, device=logits.device), block].max(-1).indices
    return block * GREEDY_BLOCK + within


def gumbel_scores(logits: torch.Tensor, uniforms: torch.Tensor) -> torch.Tensor:
    """logit - log(-log u) in float64, entry by entry: the Gumbel-max trick's perturbed logits."""
    return logits.to(torch.float64) - torch.log(-torch.log(uniforms))


def gumbel_max(logits: torch.Tensor, uniforms: torch.Tensor) -> torch.Tensor:
    """Sample one index per row from softmax(logits), given one uniform per entry (-inf entries never win)."""
    return gumbel_scores(logits, uniforms).argmax(dim=-1)


def _padded(rows: Sequence[Sequence[int]]) -> torch.Tensor:
    width = max((len(r) for r in rows), default=0)
    return torch.tensor([list(r) + [PAD_ID] * (width - len(r)) for r in rows], dtype=torch.long)


@dataclass(frozen=True)
class SamplingMetadata:
    """Everything the sampler needs for one step, one row per sequence (vLLM's name for it).

    Penalty tensors are None when no row uses a penalty, so the common case skips that work.
    """

    temperature: torch.Tensor  # [batch] float64, 0 = greedy
    top_k: torch.Tensor  # [batch] int64, <= 0 = off
    top_p: torch.Tensor  # [batch] float64, 1 = off
    min_p: torch.Tensor  # [batch] float64, 0 = off
    seeds: torch.Tensor  # [batch] int64: the request's seed, or a fresh random one
    steps: torch.Tensor  # [batch] int64: tokens generated so far, the counter of the seeded draws
    # Known on the host, so the sampler takes its branches without waiting for the GPU to answer:
    greedy_rows: str  # "all", "some" or "none"
    filters: frozenset[str]  # which of "top_k", "top_p", "min_p" some row uses
    max_top_k: int = 0  # the largest top_k of any row (top_k's topk width)
    prompt_token_ids: torch.Tensor | None = None  # [batch, longest prompt], -1 padded
    output_token_ids: torch.Tensor | None = None  # [batch, longest output], -1 padded
    repetition_penalty: torch.Tensor | None = None  # [batch], 1 = off
    presence_penalty: torch.Tensor | None = None  # [batch], 0 = off
    frequency_penalty: torch.Tensor | None = None  # [batch], 0 = off
    logit_offsets: torch.Tensor | None = None  # [batch, vocab]: bias, and -inf where masked (processors.py)

    @classmethod
    def from_requests(
        cls,
        params: Sequence[SamplingParams],
        prompt_token_ids: Sequence[Sequence[int]],
        output_token_ids: Sequence[Sequence[int]],
        device: torch.device | str = "cpu",
        eos_token_id: int | None = None,
        vocab_size: int | None = None,
    ) -> "SamplingMetadata":
        """Pack per-request settings and token histories into per-row tensors on `device`.

        `vocab_size` is needed when a row uses logit_bias, allowed_token_ids or min_tokens (which
        masks `eos_token_id` and the stop token ids).
        """
        if not all(isinstance(p, SamplingParams) for p in params):
            raise TypeError("params must be a sequence of SamplingParams, one per row")
        if not len(params) == len(prompt_token_ids) == len(output_token_ids):
            raise ValueError(
                f"params, prompt_token_ids and output_token_ids need one entry per row, got "
                f"{len(params)}, {len(prompt_token_ids)} and {len(output_token_ids)}"
            )
        # Built on the CPU, then sent without waiting (labkit.device.upload): a blocking copy to a GPU would
        # first wait for the forward pass still running there, and the host work below would not overlap it.
        to_device = lambda t: None if t is None else upload(t, device)
        column = lambda name, dtype: torch.tensor([getattr(p, name) for p in params], dtype=dtype)
        random_seeds = torch.randint(0, 2**62, (len(params),)).tolist()
        seeds = [p.seed if p.seed is not None else fresh for p, fresh in zip(params, random_seeds, strict=True)]
        num_greedy = sum(p.temperature == 0 for p in params)
        penalized = any(
            p.repetition_penalty != 1 or p.presence_penalty != 0 or p.frequency_penalty != 0 for p in params
        )
        return cls(
            temperature=to_device(column("temperature", torch.float64)),
            top_k=to_device(column("top_k", torch.int64)),
            top_p=to_device(column("top_p", torch.float64)),
            min_p=to_device(column("min_p", torch.float64)),
            seeds=to_device(torch.tensor(seeds, dtype=torch.int64)),
            steps=to_device(torch.tensor([len(out) for out in output_token_ids], dtype=torch.int64)),
            greedy_rows=("all" if num_greedy == len(params) else "some" if num_greedy else "none"),
            max_top_k=max((p.top_k for p in params), default=0),
            filters=frozenset(name for name, used in (("top_k", any(p.top_k > 0 for p in params)),
                                                      ("top_p", any(p.top_p < 1 for p in params)),
                                                      ("min_p", any(p.min_p > 0 for p in params))) if used),
            prompt_token_ids=to_device(_padded(prompt_token_ids)) if penalized else None,
            output_token_ids=to_device(_padded(output_token_ids)) if penalized else None,
            repetition_penalty=to_device(column("repetition_penalty", torch.float32)) if penalized else None,
            presence_penalty=to_device(column("presence_penalty", torch.float32)) if penalized else None,
            frequency_penalty=to_device(column("frequency_penalty", torch.float32)) if penalized else None,
            logit_offsets=to_device(_offsets(params, output_token_ids, eos_token_id, vocab_size)),
        )


def _offsets(params, output_token_ids, eos_token_id, vocab_size) -> torch.Tensor | None:
    if vocab_size is None:
        if any(p.logit_bias or p.allowed_token_ids is not None or p.min_tokens > 0 for p in params):
            raise ValueError("vocab_size is needed for logit_bias, allowed_token_ids or min_tokens")
        return None
    return logit_offsets(params, [len(out) for out in output_token_ids], eos_token_id, vocab_size)


class NothingToSample(ValueError):
    """A row's allowed_token_ids, logit_bias and min_tokens leave no token that may be drawn."""


def _check_samplable(logits: torch.Tensor) -> None:
    """Refuse rows the processors left nothing to sample from (every entry -inf, e.g. allowed_token_ids
    holding only EOS under min_tokens) or made non-finite: an argmax over them would return a token
    the request forbade. The engine fails such a request alone (FinishReason.ERROR)."""
    best = logits.amax(-1)
    bad = ~torch.isfinite(best)
    if bad.any():
        rows = bad.nonzero().flatten().tolist()
        raise NothingToSample(f"no token may be sampled in row(s) {rows}: allowed_token_ids, logit_bias and "
                              "min_tokens (which masks EOS and stop_token_ids) leave none")


class Sampler:
    """Picks one token per row of a logits batch, each row with its own SamplingParams.

    Holds between calls: the hashed vocabulary indices of the seeded draws, and whether the Triton draw runs.
    """

    def __init__(self):
        self._vocab_hash: torch.Tensor | None = None
        self._triton_draw = triton_draw.available()

    def __call__(self, logits: torch.Tensor, metadata: SamplingMetadata) -> torch.Tensor:
        """Next token ids `[batch]` (int64) for `logits` `[batch, vocab]`; the input is not modified."""
        if logits.dim() != 2 or logits.shape[0] != metadata.temperature.shape[0]:
            raise ValueError(
                f"logits must be [batch, vocab] with one row per request ({metadata.temperature.shape[0]}), "
                f"got shape {tuple(logits.shape)}"
            )
        logits = logits.float()
        if metadata.logit_offsets is not None:
            logits = logits + metadata.logit_offsets
            _check_samplable(logits)
        if metadata.repetition_penalty is not None:
            logits = apply_penalties(
                logits,
                metadata.prompt_token_ids,
                metadata.output_token_ids,
                metadata.repetition_penalty,
                metadata.presence_penalty,
                metadata.frequency_penalty,
            )
        if metadata.greedy_rows == "all":
            return greedy_tokens(logits)
        sampled = self.draw(self.filter(logits, metadata), metadata)
        if metadata.greedy_rows == "none":
            return sampled
        return torch.where(metadata.temperature == 0, greedy_tokens(logits), sampled)

    def draw(self, filtered: torch.Tensor, metadata: SamplingMetadata) -> torch.Tensor:
        """One Gumbel-max draw per row of the filtered logits. An entry's uniform depends only on (seed,
        step, index), so when top-k or top-p left few entries, the noise is computed for those alone
        (hashing and two float64 logs over a 32 x 49,152 batch cost ~75 ms of a ~95 ms step on a CPU)
        and the draw is the same as over the whole row: the removed entries are -inf and never win.
        On a GPU, one Triton kernel does the whole draw in a pass over the logits (triton_draw.py)."""
        if filtered.is_cuda and self._triton_draw:
            try:
                return triton_draw.gumbel_argmax(filtered, row_keys(metadata.seeds, metadata.steps))
            except Exception as error:  # noqa: BLE001 - it did not compile here: the torch draw gives the same tokens
                warnings.warn(f"the Triton sampling kernel failed ({error}); sampling with torch ops", stacklevel=2)
                self._triton_draw = False
        vocab_hash = self._hashed_vocab(filtered)
        kept = filtered != NEG_INF
        if 2 * int(kept.sum()) > filtered.numel():  # counted first: listing most of the batch costs more
            return gumbel_max(filtered, seeded_uniforms(metadata.seeds, metadata.steps, vocab_hash))
        rows, columns = kept.nonzero(as_tuple=True)
        uniforms = uniforms_of(row_keys(metadata.seeds, metadata.steps)[rows], vocab_hash[columns])
        scores = torch.full(filtered.shape, NEG_INF, dtype=torch.float64, device=filtered.device)
        scores[rows, columns] = gumbel_scores(filtered[rows, columns], uniforms)
        return scores.argmax(dim=-1)

    # The two truncations, each a method a subclass may replace (the course's engine parts do):
    # (logits, per-row setting) -> logits with the dropped entries at -inf; top_k is also given
    # the largest setting, known on the host.
    top_k = staticmethod(apply_top_k)
    top_p = staticmethod(apply_top_p)

    def filter(self, logits: torch.Tensor, metadata: SamplingMetadata) -> torch.Tensor:
        """Temperature, top-k, top-p and min-p per row (greedy rows pass through at temperature 1)."""
        temperature = torch.where(metadata.temperature == 0, 1.0, metadata.temperature)
        logits = apply_temperature(logits, temperature)
        if "top_k" in metadata.filters:
            logits = self.top_k(logits, metadata.top_k, metadata.max_top_k)
        if "top_p" in metadata.filters:
            logits = self.top_p(logits, metadata.top_p)
        if "min_p" in metadata.filters:
            logits = apply_min_p(logits, metadata.min_p)
        return logits

    def _hashed_vocab(self, logits: torch.Tensor) -> torch.Tensor:
        cached = self._vocab_hash
        if cached is None or cached.shape[0] != logits.shape[-1] or cached.device != logits.device:
            self._vocab_hash = hash32(torch.arange(logits.shape[-1], dtype=torch.int64, device=logits.device))
        return self._vocab_hash
