"""From sampled tokens to what a caller sees: the stop decision, the text, logprobs and `RequestOutput`.

Each step, every sampled token gets the stop rules that need only token ids (EOS, stop_token_ids,
max_tokens, max_model_len). Its text is needed at once only by a request with stop strings (a stop
string is found in the text); every other request is detokenized when its text is asked for (a
stream, `LLM.request_output`) or when it finishes, all the tokens since in one call. That gives the
same text: the detokenizer's pieces concatenate to the decoding of all the ids, however they are cut.
"""

import dataclasses

import torch

from labkit.engine.metrics import RequestMetrics
from labkit.engine.outputs import CompletionOutput, RequestOutput
from labkit.engine.sequence import FinishReason, Sequence
from labkit.sampling import check_stop
from labkit.sampling.logprobs import compute_logprobs
from labkit.tokenizer import IncrementalDetokenizer


@dataclasses.dataclass
class _TextState:
    """A sample's detokenizer and how many of its output tokens it has taken (the text holds those)."""

    detokenizer: IncrementalDetokenizer
    num_tokens: int = 0


class OutputProcessor:
    def __init__(self, tokenizer, eos_token_id: int | None, max_model_len: int):
        self.tokenizer, self.eos_token_id, self.max_model_len = tokenizer, eos_token_id, max_model_len
        self._text: dict[int, _TextState] = {}  # seq_id -> its text's state, from its first detokenized token

    def append(self, seq: Sequence, token: int, now: float, logprobs: dict | None = None) -> None:
        """Add one sampled token, its logprobs and the stop decision (and, where stop strings are
        looked for, its text); all or nothing."""
        state = self._state(seq) if seq.params.stop else None
        checkpoint = None if state is None else state.detokenizer.state()
        try:
            text = piece = ""
            if state is not None:
                piece = state.detokenizer.push(seq.output_token_ids[state.num_tokens:] + [token])
                text = seq.text + piece
            stop = check_stop(seq.params, seq.output_token_ids + [token], text, len(piece), self.eos_token_id)
        except BaseException:
            if state is not None:
                state.detokenizer.restore(checkpoint)
            raise
        # From here on nothing can fail: plain assignments.
        seq.append_token(token)
        if state is not None:
            seq.text, state.num_tokens = text, seq.num_output_tokens
        if logprobs is not None:
            seq.logprobs.append(logprobs)
            seq.cumulative_logprob += logprobs[token].logprob
        if seq.first_token_time is None:
            seq.first_token_time = now
        if stop is not None:
            if stop.finish_reason == "length":
                seq.finish(FinishReason.MAX_TOKENS)
            elif stop.stop_reason is None:
                seq.finish(FinishReason.EOS, token)
            else:
                if stop.text_end is not None:  # vLLM's rule: the text stops before the stop string...
                    keep = len(stop.stop_reason) if seq.params.include_stop_str_in_output else 0
                    seq.text = seq.text[:stop.text_end + keep]  # ...or just after it, if asked
                seq.finish(FinishReason.STOP, stop.stop_reason)
        elif seq.num_tokens >= self.max_model_len:
            seq.finish(FinishReason.MAX_TOKENS)

    def append_all(self, seq: Sequence, tokens: list[int], now: float) -> int:
        """Append `tokens` in order until one finishes `seq` (a speculative step's); returns how many."""
        for count, token in enumerate(tokens, 1):
            self.append(seq, token, now)
            if seq.is_finished:
                return count
        return len(tokens)

    def _state(self, seq: Sequence) -> _TextState:
        state = self._text.get(seq.seq_id)
        if state is None:
            state = _TextState(IncrementalDetokenizer(self.tokenizer, skip_special_tokens=True))
            self._text[seq.seq_id] = state
        return state

    def catch_up(self, seq: Sequence, final: bool = False) -> str:
        """`seq`'s text with every token it has: the tokens not detokenized yet are, in one call (with
        `final`, what the detokenizer still holds back too, unless a stop ended the text). All or nothing."""
        state = self._state(seq)
        missing = seq.known_output_token_ids[state.num_tokens:]
        if not missing and not final:
            return seq.text
        checkpoint = state.detokenizer.state()
        try:
            piece = state.detokenizer.push(missing) if missing else ""
            if final and seq.finish_reason is not FinishReason.STOP:
                piece += state.detokenizer.flush()
        except BaseException:
            state.detokenizer.restore(checkpoint)
            raise
        seq.text += piece
        state.num_tokens += len(missing)
        return seq.text

    def finish(self, seq: Sequence) -> RequestOutput:
        """The output of a finished request (`seq` is its sample 0); its samples' text states are dropped."""
        for sample in seq.group:
            self.catch_up(sample, final=True)
        output = self.output(seq, RequestMetrics.of(seq))
        for sample in seq.group:
            self._text.pop(sample.seq_id, None)
        return output

    def output(self, seq: Sequence, metrics: RequestMetrics | None = None) -> RequestOutput:
        """vLLM's RequestOutput of the request whose sample 0 is `seq`, finished or not (its text so far,
        without the token an overlapped step has not brought to the host yet)."""
        samples = [CompletionOutput(s.index, self.catch_up(s), s.known_output_token_ids, s.cumulative_logprob,
                                    s.logprobs, s.finish_reason, s.stop_reason) for s in seq.group]
        return RequestOutput(seq.request_id, seq.prompt, seq.prompt_token_ids, seq.prompt_logprobs, samples,
                             seq.group_finished, metrics or RequestMetrics.of(seq))

    # --- logprobs ------------------------------------------------------------------------------
    def add_prompt_logprobs(self, prompt_logits) -> None:
        """Record the prompt logprobs of the positions a forward pass computed (`forward.prompt_logits`)."""
        for prompt in prompt_logits:
            targets = prompt.seq.prompt_token_ids[prompt.first_target:prompt.first_target + len(prompt.logits)]
            prompt.seq.prompt_logprobs += compute_logprobs(prompt.logits, targets,
                                                           [prompt.seq.params.prompt_logprobs] * len(targets),
                                                           self._decode_token)

    def sampled_logprobs(self, logits: torch.Tensor, seqs: list[Sequence], tokens: list[int]) -> list:
        """The asked-for logprobs of each sampled token (None where a request did not ask)."""
        wanted = [i for i, seq in enumerate(seqs) if seq.params.logprobs is not None]
        result = [None] * len(seqs)
        if wanted:
            computed = compute_logprobs(logits[wanted], [tokens[i] for i in wanted],
                                        [seqs[i].params.logprobs for i in wanted], self._decode_token)
            for i, position in zip(wanted, computed, strict=True):
                result[i] = position
        return result

    def _decode_token(self, token_id: int) -> str:
        return self.tokenizer.decode([token_id])

