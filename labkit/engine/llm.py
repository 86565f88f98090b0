"""`LLM`: the engine behind an API shaped like vLLM's.

    llm = LLM("smollm2", max_num_seqs=16)      # a model name, a .gguf path or an HF folder
    outputs = llm.generate(["The capital of France is", "Hello"], SamplingParams(max_tokens=20))
    outputs[0].text, outputs[0].token_ids, outputs[0].finish_reason, outputs[0].metrics.ttft
    outputs[0].outputs[i]          # sample i of n (SamplingParams(n=...)): .text, .token_ids, .logprobs
    llm.beam_search(["The capital of France is"], BeamSearchParams(beam_width=3, max_tokens=8))

The keywords are an `EngineConfig`'s fields (config.py); builder.py builds the engine from it.
Each `step()` is the nano-vLLM walk-through's engine loop: the scheduler picks the batch, the model
runner runs one forward pass, the engine samples (draws.py, forking a request's n samples: samples.py),
appends the tokens with their stop decision (output_processor.py) and releases what finished. With
`async_scheduling=True`, a plain decode step is launched before the last one's tokens are appended
(overlap.py), so the host's work hides behind the GPU's.
"""

import itertools
import sys
import time
from collections.abc import Iterator

from tqdm.auto import tqdm

from labkit.engine import inputs, samples
from labkit.engine.beam_search import EngineBeamSearch
from labkit.engine.builder import build_engine
from labkit.engine.config import EngineConfig
from labkit.engine.draws import StepDrawer
from labkit.engine.interrupts import deferred_interrupts
from labkit.engine.metrics import EngineMetrics
from labkit.engine.output_processor import OutputProcessor
from labkit.engine.outputs import BeamSearchOutput, RequestOutput
from labkit.engine.overlap import OverlappedSteps, unfinished
from labkit.engine.sequence import Sequence
from labkit.sampling import BeamSearchParams, SamplingParams


class LLM:
    def __init__(self, model="smollm2", *, tokenizer=None, config: EngineConfig | None = None, **settings):
        """`settings`: EngineConfig's fields as keywords (or pass a whole `config`)."""
        if config is not None and settings:
            raise TypeError(f"pass config= or keyword settings, not both (got {', '.join(settings)})")
        engine = build_engine(model, tokenizer, EngineConfig(**settings) if config is None else config)
        self.config, self.model, self.tokenizer = engine.config, engine.model, engine.tokenizer
        self.device, self.storage, self.block_manager = engine.model.device, engine.storage, engine.block_manager
        self.scheduler, self.runner, self.speculative = engine.scheduler, engine.runner, engine.speculative
        self.eos_token_id = engine.eos_token_id
        self.output_processor = OutputProcessor(self.tokenizer, self.eos_token_id, self.config.max_model_len)
        self.metrics = EngineMetrics()
        self._requests: dict[int, Sequence] = {}  # unfinished, by request id (their sample 0)
        self._outputs: dict[int, RequestOutput] = {}  # finished, not yet handed to whoever owns them
        self._claimed: set[int] = set()  # requests a running generate() or stream() collects itself
        self._ids = itertools.count()
        self._drawer = StepDrawer(self.runner, self.output_processor, self.scheduler, self.eos_token_id, self._ids)
        self._overlap = OverlappedSteps(self.scheduler, self.runner, self.output_processor, self.eos_token_id) \
            if self.config.async_scheduling else None

    # --- requests ----------------------------------------------------------------------------
    def _make_sequence(self, prompt, params: SamplingParams, priority: int) -> Sequence:
        vocab_size = self.model.config.vocab_size
        token_ids, text = inputs.encode_prompt(prompt, self.tokenizer, vocab_size)
        inputs.check_request(params, priority, vocab_size, self.eos_token_id, self.config.max_num_seqs,
                             speculative=self.speculative is not None)
        seq = Sequence(token_ids, params, priority=priority, prompt=text, seq_id=next(self._ids))
        self.scheduler.check_fits(seq)
        return seq

    def _enqueue(self, seq: Sequence) -> None:
        self.scheduler.add(seq)
        self._requests[seq.seq_id] = seq

    def add_request(self, prompt, params: SamplingParams | None = None, priority: int = 0) -> int:
        """Queue one request; returns its id (for `abort`, or to find it in `step()`'s outputs)."""
        seq = self._make_sequence(prompt, SamplingParams() if params is None else params, priority)
        self._enqueue(seq)
        return seq.seq_id

    def abort(self, request_id: int) -> None:
        """Cancel a request: its blocks return to the pool and it finishes with reason ABORTED. As in
        vLLM, `step()` returns no output for it: whoever aborts it knows."""
        self._resolve_pending()
        seq = self._unfinished(request_id)
        for sample in seq.group:
            self.scheduler.abort(sample)
        self._finalize(seq)
        if request_id not in self._claimed:
            del self._outputs[request_id]

    def has_unfinished_requests(self) -> bool:
        """Whether `step()` has work left: requests to run or to collect, or outputs to hand back."""
        return (self.scheduler.has_unfinished or bool(self._requests)
                or any(i not in self._claimed for i in self._outputs))

    def request_output(self, request_id: int) -> RequestOutput:
        """Where an unfinished request stands now (its text so far): what a streaming server sends on.
        With async scheduling, the token of the step in flight is not in it yet: reading does not wait."""
        return self.output_processor.output(self._unfinished(request_id))

    def _unfinished(self, request_id: int) -> Sequence:
        seq = self._requests.get(request_id)
        if seq is None:
            raise ValueError(f"no unfinished request with id {request_id!r}")
        return seq

    # --- the engine loop ---------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        """One scheduling + forward step. Returns the outputs of finished requests that were queued
        with `add_request`, including those that finished during another caller's steps (a
        `generate` or `stream` call collects its own requests and leaves everyone else's here). With
        async scheduling a request's last token, and so its output, arrives one step later.
        Ctrl-C during a step takes effect when the step is done (labkit/engine/interrupts.py)."""
        finished = {}
        with deferred_interrupts(undo=lambda: self._outputs.update(finished)):  # kept for the next step
            self._run_step()
            for i in [i for i in self._outputs if i not in self._claimed]:
                finished[i] = self._outputs.pop(i)
        return list(finished.values())

    def _run_step(self) -> None:
        """Schedule, run, append and release; finished requests' outputs go to `self._outputs`.

        Safe to stop at any exception it raises: until the scheduler's postprocess advances a sequence,
        its step can simply run again, so the sampled tokens are appended one sequence at a time, each
        append (and each fork of a new sample) all or nothing, and whatever finished but was not
        released or collected yet is picked up by the next step. A new sample adopted before the
        interrupt recomputes its share of the step itself; the ones not yet adopted are forked again. An
        overlapped step keeps the same rule: its placeholders are resolved once, whenever that happens."""
        start = time.perf_counter()
        overlapped = self._overlap is not None and self._overlap.can_overlap()
        if not overlapped:
            self._resolve_pending()
        out = self.scheduler.schedule()  # also releases what an interrupted step (or a resolve) left finished
        if not out.is_empty:
            num_batched_tokens = out.num_batched_tokens  # before forked samples join `out`
            if overlapped:  # launched before the last step's tokens are appended (overlap.py)
                num_sampled = self._overlap.run(out)
                if num_sampled is None:  # not launched (see run): a synchronous step, which isolates a failure
                    self._resolve_pending()
                    out = unfinished(out)
                    num_sampled = self._draw_and_append(out)
            elif self.speculative is None:
                num_sampled = self._draw_and_append(out)
            else:
                now = time.perf_counter()  # a speculative step is not isolated per request: its failure is ours
                num_sampled = sum(self.output_processor.append_all(seq, tokens, now)
                                  for seq, tokens in self.speculative.step(out).items())
            self.scheduler.postprocess(out)
            self.metrics.record_step(out, num_batched_tokens, num_sampled, time.perf_counter() - start,
                                     self.block_manager, self.speculative)
        for seq in [s for s in self._requests.values() if s.group_finished]:
            self._finalize(seq)

    def _draw_and_append(self, out) -> int:
        """Run `out` and append each sampled token (adopting the samples a request forks); returns how many."""
        draws = self._drawer.draw_isolated(out) if out.seqs else []
        now = time.perf_counter()
        for draw in draws:
            if draw.forked_from is not None:
                samples.adopt(self.scheduler, draw.forked_from, draw.seq, out)
            self.output_processor.append(draw.seq, draw.token, now, draw.logprobs)
        return len(draws)

    def _resolve_pending(self) -> None:
        """Append the tokens of the overlapped step in flight, if any: before a step that does not
        overlap, and before an abort."""
        if self._overlap is not None:
            self.metrics.num_generated_tokens += self._overlap.resolve()

    def _finalize(self, seq: Sequence) -> None:
        """Keep the output of a finished request (`seq` is its sample 0) for its owner; forget the request."""
        if self.speculative is not None:
            self.speculative.forget(seq)
        output = self.output_processor.finish(seq)
        self._outputs[seq.request_id] = output
        self._requests.pop(seq.request_id, None)
        self.metrics.record(output.metrics)

    def _release(self, ids: list[int]) -> None:
        """The end of a generate or stream call, however it ended (KeyboardInterrupt, a closed
        generator): none of its requests stays queued, claimed or buffered. A Ctrl-C while it runs
        (a second one, after the one that ended the call) waits for it to finish."""
        with deferred_interrupts():
            for i in ids:
                if i in self._requests:
                    self.abort(i)
                self._outputs.pop(i, None)
            self._claimed.difference_update(ids)

    # --- user-facing calls -------------------------------------------------------------------
    def generate(self, prompts, sampling_params: SamplingParams | list[SamplingParams] | None = None, *,
                 priority: int | list[int] = 0, use_tqdm: bool | None = None) -> list[RequestOutput]:
        """Run prompts to completion; outputs come back in prompt order.

        Every prompt is checked before any is queued, so one bad prompt leaves the engine untouched.
        `use_tqdm=None` shows a progress bar only when stderr is a terminal (not in notebooks or tests).
        Ctrl-C stops the call at once and aborts its requests (`step` instead finishes its step, because
        the requests it advances belong to whoever queued them).
        """
        seqs = [self._make_sequence(*request) for request in inputs.requests(prompts, sampling_params, priority)]
        ids = [seq.seq_id for seq in seqs]
        if use_tqdm is None:
            use_tqdm = len(ids) > 1 and sys.stderr.isatty()
        # Made only when shown: even a disabled tqdm takes a multiprocessing lock (a named semaphore).
        bar = tqdm(total=len(ids), desc="generate", unit="req") if use_tqdm else None
        try:
            self._claimed.update(ids)
            for seq in seqs:
                self._enqueue(seq)
            while not all(i in self._outputs for i in ids):
                done = sum(i in self._outputs for i in ids)
                self._run_step()
                if bar is not None:
                    bar.update(sum(i in self._outputs for i in ids) - done)
            return [self._outputs[i] for i in ids]
        finally:
            if bar is not None:
                bar.close()
            self._release(ids)

    def chat(self, messages, sampling_params: SamplingParams | None = None, **kwargs) -> list[RequestOutput]:
        """One conversation (a list of {"role", "content"} dicts) or a batch of them (a list of lists),
        as vLLM's `LLM.chat` takes them."""
        return self.generate(inputs.chat_prompts(self.tokenizer, messages), sampling_params, **kwargs)

    def stream(self, prompt, sampling_params: SamplingParams | None = None, priority: int = 0) -> Iterator[str]:
        """Yield the text of one request as it is generated (other queued requests advance too).

        Closing the generator early aborts the request.
        """
        seq = self._make_sequence(prompt, sampling_params or SamplingParams(), priority)
        if seq.params.n != 1:
            raise ValueError(f"stream yields the text of one sample: n must be 1, got {seq.params.n} "
                             "(generate returns all n)")
        self._claimed.add(seq.seq_id)
        self._enqueue(seq)
        # Text is held back while a stop string might still be forming at its end.
        hold = max((len(s) - 1 for s in seq.params.stop), default=0)
        sent = 0
        try:
            while not seq.is_finished:
                self._run_step()
                ready = 0 if seq.is_finished else len(self.output_processor.catch_up(seq)) - hold
                if ready > sent:  # (a finished request's text is its output's, below)
                    yield seq.text[sent:ready]
                    sent = ready
            # Finished (in our step or another caller's): the rest of the text is in its output.
            if seq.seq_id in self._requests:  # the step was interrupted before collecting it
                self._finalize(seq)
            text = self._outputs[seq.seq_id].text
            if len(text) > sent:
                yield text[sent:]
        finally:
            self._release([seq.seq_id])

    def beam_search(self, prompts, params: BeamSearchParams) -> list[BeamSearchOutput]:
        """vLLM's `LLM.beam_search` inside this engine (beam_search.py): one BeamSearchOutput per prompt,
        transformers' `generate(num_beams=...)` hypotheses. A prompt is a str, a list of token ids, or
        vLLM's {"prompt": ...} / {"prompt_token_ids": ...}. Runs alone: no other request may be queued."""
        if not isinstance(params, BeamSearchParams):
            raise TypeError(f"params must be a BeamSearchParams, got {type(params).__name__}")
        prompts = inputs.beam_prompts(prompts)
        if self.speculative is not None:
            raise ValueError("beam_search does not run with speculative decoding: use an engine without speculative=")
        if self.has_unfinished_requests():
            raise RuntimeError("beam_search runs alone: finish or abort the queued requests first")
        token_lists = [self._make_sequence(p, SamplingParams(max_tokens=params.max_tokens), 0).token_ids
                       for p in prompts]
        search = EngineBeamSearch(self.block_manager, self.storage, self.runner, self.config.max_model_len)
        eos = None if params.ignore_eos else self.eos_token_id
        return [search.run(ids, params, eos, self.tokenizer) for ids in token_lists]

    def reset_metrics(self) -> None:
        self.metrics = EngineMetrics()

