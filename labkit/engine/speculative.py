"""Speculative decoding: a cheap drafter guesses the next k tokens, the target model checks them all
in one forward pass over the paged KV cache (the book's §10.9 names it; its text stops before).

A decode step normally runs one new token per sequence. With speculation, each decoding sequence
also runs its k draft tokens: the step computes K/V for all 1 + k positions and the logits of every
one of them, so one target forward yields between 1 and k + 1 tokens:

- greedy: the drafts are kept while they equal the target's argmax; the first mismatch is replaced
  by the target's own choice, and if all k match, the last row gives a bonus token. The output is
  the one plain greedy decoding gives, only reached in fewer target forwards;
- sampling: draft x (drawn from the drafter's distribution q) is accepted with probability
  min(1, p(x) / q(x)); on a rejection the token is drawn from normalize(max(0, p - q)) and the rest
  is dropped. Each emitted token is then distributed exactly as p, the target's distribution
  (Leviathan et al., 2023). A deterministic drafter (prompt lookup) has q = one-hot.

Rejected drafts are rolled back: they leave `token_ids`, the sequence advances its computed count
only over the accepted ones (their K/V, written this step, is exactly what a plain decode would
have written), and blocks that held nothing but rejected tokens go back to the pool.

Two drafters: `NgramDrafter` (prompt lookup: copy what followed the last earlier occurrence of the
context's final n-gram; free, and strong on repetitive text) and `DraftModelDrafter` (a smaller
model, e.g. SmolLM2 cut to its first layers, run autoregressively over the whole context).

Supported: n = 1, temperature (greedy or plain), no top-k/top-p/min-p filters, no penalties, bias
or masks, no logprobs; `LLM` rejects other requests with an error naming the option.
"""

import copy
import dataclasses
from dataclasses import dataclass
from typing import Protocol

import torch

from labkit.engine.scheduler import SchedulerOutput
from labkit.engine.sequence import Sequence
from labkit.sampling import SamplingParams


@dataclass(frozen=True)
class SpeculativeConfig:
    """`method`: "ngram" (prompt lookup) or "draft_model" (then `draft_model` is a DecoderModel with
    the target's vocabulary). `num_speculative_tokens`: k, the drafts checked per target forward.
    Prompt lookup matches the longest n-gram from `prompt_lookup_max` down to `prompt_lookup_min`."""

    method: str = "ngram"
    num_speculative_tokens: int = 4
    prompt_lookup_max: int = 3
    prompt_lookup_min: int = 1
    draft_model: object = None

    def __post_init__(self):
        k = self.num_speculative_tokens
        if isinstance(k, bool) or not isinstance(k, int) or k < 1:
            raise ValueError(f"num_speculative_tokens must be an integer >= 1, got {k!r}")
        if self.method not in ("ngram", "draft_model"):
            raise ValueError(f"speculative method must be 'ngram' or 'draft_model', got {self.method!r}")
        lo, hi = self.prompt_lookup_min, self.prompt_lookup_max
        if not (isinstance(lo, int) and isinstance(hi, int) and 1 <= lo <= hi):
            raise ValueError(f"need 1 <= prompt_lookup_min <= prompt_lookup_max, got {lo!r} and {hi!r}")
        if (self.method == "draft_model") != (self.draft_model is not None):
            raise ValueError("method='draft_model' needs draft_model= (a DecoderModel), and only it takes one")


@dataclass
class Draft:
    """Proposed tokens and, per token, the drafter's distribution q it was drawn from (None: each
    token was chosen deterministically, q is one-hot)."""

    tokens: list[int]
    probs: torch.Tensor | None = None  # [len(tokens), vocab] fp32


class Drafter(Protocol):
    def propose(self, token_ids: list[int], k: int, params: SamplingParams,
                generator: torch.Generator) -> Draft: ...


def ngram_lookup(token_ids: list[int], k: int, max_n: int, min_n: int = 1) -> list[int]:
    """Prompt lookup: for n from max_n down to min_n, find the first earlier occurrence of the last
    n tokens and return (up to k of) the tokens that followed it; [] if no n-gram recurs. The first
    occurrence (vLLM's choice) leaves the most tokens after it: in a run "x x x x", the latest would
    offer one."""
    for n in range(min(max_n, len(token_ids) - 1), min_n - 1, -1):
        tail = token_ids[-n:]
        for start in range(len(token_ids) - n):  # never the tail itself
            if token_ids[start:start + n] == tail:
                return token_ids[start + n:start + n + k]
    return []


class NgramDrafter:
    def __init__(self, max_n: int, min_n: int):
        self.max_n, self.min_n = max_n, min_n

    def propose(self, token_ids, k, params, generator) -> Draft:
        return Draft(ngram_lookup(token_ids, k, self.max_n, self.min_n))


def first_layers(model, num_layers: int):
    """A draft model made of `model`'s embedding, first `num_layers` layers, final norm and head,
    sharing their weights (no copy): same vocabulary, a fraction of the cost, a rougher guess."""
    if isinstance(num_layers, bool) or not isinstance(num_layers, int) or not 1 <= num_layers <= len(model.layers):
        raise ValueError(f"num_layers must be an integer in [1, {len(model.layers)}], got {num_layers!r}")
    draft = copy.copy(model)  # a shallow copy: the same parameter tensors
    draft._modules = dict(model._modules)
    draft.layers = torch.nn.ModuleList(model.layers[:num_layers])
    draft.config = dataclasses.replace(model.config, num_layers=num_layers)
    return draft


class DraftModelDrafter:
    """A smaller model guesses k tokens one at a time, greedily or by sampling at the request's
    temperature. It recomputes its whole context each time (no KV cache of its own): simple, and
    cheap enough for a model a fraction of the target's size on the short contexts of the labs."""

    def __init__(self, model):
        self.model = model

    @torch.inference_mode()
    def propose(self, token_ids, k, params, generator) -> Draft:
        context, tokens, probs = list(token_ids), [], []
        for _ in range(k):
            logits = self.model(torch.tensor(context, device=self.model.device))[-1].float().cpu()
            if params.greedy:
                token = int(logits.argmax())
            else:
                q = torch.softmax(logits / params.temperature, -1)
                token = int(torch.multinomial(q, 1, generator=generator))
                probs.append(q)
            tokens.append(token)
            context.append(token)
        return Draft(tokens, torch.stack(probs) if probs else None)


def verify_greedy(target_logits: torch.Tensor, draft: list[int]) -> list[int]:
    """Tokens one target forward yields: the drafts that match the target's argmax, then the
    target's own token (the correction at the first mismatch, or the bonus after k matches).
    `target_logits` has len(draft) + 1 rows: row i predicts the token after draft i - 1."""
    choices = target_logits.argmax(-1).tolist()
    accepted = []
    for guess, choice in zip(draft, choices, strict=False):
        if guess != choice:
            break
        accepted.append(guess)
    return accepted + [choices[len(accepted)]]


def verify_sampled(target_probs: torch.Tensor, draft: list[int], draft_probs: torch.Tensor | None,
                   generator: torch.Generator) -> list[int]:
    """Rejection sampling: accept draft x with probability min(1, p(x) / q(x)); at the first
    rejection draw from normalize(max(0, p - q)) and stop; after k acceptances draw a bonus token
    from the last row. Every returned token is distributed as the target's p."""
    out = []
    for i, guess in enumerate(draft):
        p = target_probs[i]
        q = draft_probs[i] if draft_probs is not None else torch.nn.functional.one_hot(
            torch.tensor(guess), p.shape[-1]).to(p.dtype)
        if float(torch.rand((), generator=generator)) < min(1.0, float(p[guess] / q[guess])):
            out.append(guess)
            continue
        residual = torch.clamp(p - q, min=0)
        total = float(residual.sum())
        # p == q leaves nothing, but then the draft was accepted with probability 1: never reached.
        out.append(int(torch.multinomial(residual / total if total > 0 else p, 1, generator=generator)))
        return out
    out.append(int(torch.multinomial(target_probs[len(draft)], 1, generator=generator)))
    return out


def check_supported(params: SamplingParams) -> None:
    """Raise ValueError naming the first option speculative decoding does not handle here."""
    unsupported = {
        "n > 1": params.n > 1, "logprobs": params.logprobs is not None,
        "prompt_logprobs": params.prompt_logprobs is not None,
        "top_k": params.top_k not in (0, -1), "top_p": params.top_p < 1, "min_p": params.min_p > 0,
        "penalties, logit_bias, allowed_token_ids or min_tokens": params.changes_logits,
    }
    named = [name for name, used in unsupported.items() if used]
    if named:
        raise ValueError(f"speculative decoding supports plain greedy or temperature sampling with n=1; "
                         f"this request uses {named[0]}: drop it or run an engine without speculative=")


class SpeculativeDecoder:
    """Runs the engine's step with drafts: propose, grow the block tables, verify in one forward,
    roll back. Counters of the last step, for the engine's metrics: drafts proposed, drafts
    accepted, and verify passes (sequences whose drafts were checked)."""

    def __init__(self, config: SpeculativeConfig, runner, block_manager, storage, scheduler_config,
                 vocab_size: int):
        self.drafter: Drafter
        if config.method == "ngram":
            self.drafter = NgramDrafter(config.prompt_lookup_max, config.prompt_lookup_min)
        else:
            draft_vocab = config.draft_model.config.vocab_size
            if draft_vocab != vocab_size:
                raise ValueError(f"the draft model's vocabulary ({draft_vocab}) differs from the target's "
                                 f"({vocab_size}): their token ids would not mean the same")
            self.drafter = DraftModelDrafter(config.draft_model)
        self.k = config.num_speculative_tokens
        self.runner, self.block_manager, self.storage = runner, block_manager, storage
        self.scheduler_config = scheduler_config
        self._generators: dict[int, torch.Generator] = {}
        self.num_draft_tokens = self.num_accepted_tokens = self.num_verify_passes = 0  # of the last step

    def generator(self, seq: Sequence) -> torch.Generator:
        """One generator per sequence: seeded by the request's seed, else from torch's global one."""
        gen = self._generators.get(seq.seq_id)
        if gen is None:
            seed = seq.params.seed if seq.params.seed is not None else int(torch.randint(2**62, ()))
            gen = self._generators[seq.seq_id] = torch.Generator().manual_seed(seed)
        return gen

    def forget(self, seq: Sequence) -> None:
        self._generators.pop(seq.seq_id, None)

    def step(self, out: SchedulerOutput) -> dict[Sequence, list[int]]:
        """Run the scheduled step with drafts; returns the tokens each sampled sequence gains, in
        order, and leaves `out.num_new_tokens` at what each sequence computed for good."""
        self.num_draft_tokens = self.num_accepted_tokens = self.num_verify_passes = 0
        drafts = self._propose(out)
        scored = [1 + len(drafts[s].tokens) if s in drafts else 1 for s in out.seqs]
        try:
            forward = self.runner.forward(out.seqs, out.num_new_tokens, num_scored=scored)
        except BaseException:
            for i, seq in enumerate(out.seqs):
                if seq in drafts:  # as if never proposed
                    self._roll_back(seq, drafts[seq].tokens, out, i, num_kept=0, num_final_tokens=None)
            raise
        result, row = {}, 0
        for seq in forward.sampled_seqs:
            draft = drafts.get(seq, Draft([]))
            logits = forward.logits[row:row + 1 + len(draft.tokens)]
            row += 1 + len(draft.tokens)
            if seq.params.greedy:
                tokens = verify_greedy(logits, draft.tokens)
            else:
                probs = torch.softmax(logits.cpu() / seq.params.temperature, -1)
                tokens = verify_sampled(probs, draft.tokens, draft.probs, self.generator(seq))
            if draft.tokens:
                self._roll_back(seq, draft.tokens, out, out.seqs.index(seq), num_kept=len(tokens) - 1,
                                num_final_tokens=seq.num_tokens - len(draft.tokens) + len(tokens))
                self.num_draft_tokens += len(draft.tokens)
                self.num_accepted_tokens += len(tokens) - 1
                self.num_verify_passes += 1
            result[seq] = tokens
        return result

    def _propose(self, out: SchedulerOutput) -> dict[Sequence, Draft]:
        """Drafts for the sequences that decode this step, as many as the token budget, the request's
        remaining length and the free blocks allow; appended to their tokens, with blocks for them."""
        budget = self.scheduler_config.max_num_batched_tokens - out.num_batched_tokens
        bm, drafts = self.block_manager, {}
        for i, seq in enumerate(out.seqs):
            if out.num_new_tokens[i] != 1 or seq.num_uncomputed_tokens != 1:
                continue  # a prefill (chunk): nothing to speculate on yet
            room = min(seq.num_prompt_tokens + seq.params.max_tokens, self.scheduler_config.max_model_len)
            k = min(self.k, budget, room - seq.num_tokens - 1)  # the last token is the target's own
            while k > 0 and bm.blocks_needed(seq.num_tokens + k) - len(seq.block_table) > bm.num_free_blocks:
                k -= 1
            if k <= 0:
                continue
            draft = self.drafter.propose(seq.token_ids, k, seq.params, self.generator(seq))
            if not draft.tokens:
                continue
            seq.token_ids.extend(draft.tokens)
            bm.append(seq, self.storage)
            out.num_new_tokens[i] += len(draft.tokens)
            budget -= len(draft.tokens)
            drafts[seq] = draft
        return drafts

    def _roll_back(self, seq: Sequence, draft: list[int], out: SchedulerOutput, index: int, num_kept: int,
                   num_final_tokens: int | None) -> None:
        """Drop the drafts from `seq`'s tokens (the kept ones come back through the engine's append,
        with its stop checks), count only the kept ones as computed, and free the blocks that only
        rejected drafts needed: those past `num_final_tokens`, the count once the engine has
        appended (None: nothing will be appended)."""
        del seq.token_ids[len(seq.token_ids) - len(draft):]
        out.num_new_tokens[index] = 1 + num_kept
        self.block_manager.truncate(seq, seq.num_tokens if num_final_tokens is None else num_final_tokens)
