"""`LLM`: the engine behind an API shaped like vLLM's.

    llm = LLM("smollm2", max_num_seqs=16)      # a model name, a .gguf path or an HF folder
    outputs = llm.generate(["The capital of France is", "Hello"], SamplingParams(max_tokens=20))
    outputs[0].text, outputs[0].token_ids, outputs[0].finish_reason, outputs[0].metrics.ttft
    outputs[0].outputs[i]          # sample i of n (SamplingParams(n=...)): .text, .token_ids, .logprobs
    llm.beam_search(["The capital of France is"], BeamSearchParams(beam_width=3, max_tokens=8))
    LLM("smollm2", kv_cache_dtype="int8")     # K/V as int8 with per-block scales: ~4x the fp32 blocks
    LLM("smollm2", dtype=torch.bfloat16)      # bf16 weights and K/V (fp32 is the CPU default)
    LLM("smollm2", weight_format="q4_1")      # the GGUF's own 4-bit weights (or "int8"), bf16 activations
    LLM("smollm2", speculative=SpeculativeConfig("ngram", num_speculative_tokens=4))  # see speculative.py

Each `step()` is the nano-vLLM walk-through's engine loop: the scheduler picks the batch, the model
runner runs one forward pass over it, the engine samples (forking a request's n samples off its
prompt the first time it is sampled), appends the tokens, detokenizes them incrementally, checks
the stop rules and releases what finished.
"""

import dataclasses
import itertools
import numbers
import sys
import time
import warnings
from collections.abc import Iterator

import numpy as np
import torch

from labkit.attention.paged import PagedAttentionBackend, resolve_backend
from labkit.cache.paged_storage import PagedKVStorage
from labkit.device import pick_device
from labkit.engine.beam_search import EngineBeamSearch
from labkit.engine.components import EngineComponents
from labkit.engine.cuda_graph import capture_sizes
from labkit.engine.interrupts import deferred_interrupts
from labkit.engine.memory import DEFAULT_CPU_KV_CACHE_BYTES, num_blocks_for_memory, profile_cuda_memory
from labkit.engine.metrics import EngineMetrics, RequestMetrics
from labkit.engine.outputs import BeamSearchOutput, CompletionOutput, RequestOutput
from labkit.engine.scheduler import SchedulerConfig, SchedulerOutput
from labkit.engine.sequence import FinishReason, Sequence
from labkit.engine.speculative import SpeculativeConfig, SpeculativeDecoder, check_supported
from labkit.model import DecoderModel, load_model
from labkit.model.fused_decode import FusedDecoder
from labkit.sampling import BeamSearchParams, SamplingParams, check_stop
from labkit.sampling.logprobs import compute_logprobs
from labkit.tokenizer import IncrementalDetokenizer, load_tokenizer

CHAT_ROLES = ("system", "developer", "user", "assistant")  # OpenAI's "developer" is the system prompt


class LLM:
    def __init__(self, model="smollm2", *, tokenizer=None, block_size: int = 16, num_kvcache_blocks: int | None = None,
                 max_num_seqs: int = 64, max_num_batched_tokens: int = 1024, max_model_len: int | None = None,
                 attention_backend: str = "auto", enable_prefix_caching: bool = True,
                 enable_chunked_prefill: bool = True, preemption_mode: str = "recompute",
                 long_prefill_token_threshold: int = 0, priority_aging_steps: int | None = 50,
                 device: str | torch.device | None = None, dtype: torch.dtype | None = None,
                 gpu_memory_utilization: float = 0.9, cpu_kv_cache_bytes: int = DEFAULT_CPU_KV_CACHE_BYTES,
                 use_cuda_graph: bool = True, kv_cache_dtype: str = "auto", weight_format: str = "dequantized",
                 speculative: SpeculativeConfig | None = None,
                 components: EngineComponents | None = None):
        """`components`: an `EngineComponents` (components.py) whose factories build the block manager,
        scheduler and model runner instead of labkit's own classes.
        `weight_format`: "dequantized", "int8" or "q4_1" (labkit/model/weight_formats.py)."""
        if isinstance(model, DecoderModel):  # already loaded: several engines can share one model
            if tokenizer is None:
                raise ValueError("an already-loaded model needs its tokenizer: pass tokenizer=")
            if weight_format != "dequantized":
                raise ValueError(f"weight_format={weight_format!r} is chosen when the model is loaded: pass its name "
                                 f"or path, or load it with labkit.model.load_model(..., weight_format=...)")
            self.model, self.device = model, model.device
        else:
            self.device = pick_device(None if device is None else str(device))
            self.model = load_model(model, device=self.device, dtype=dtype, weight_format=weight_format,
                                    prepack=True)
        self.tokenizer = load_tokenizer(model) if tokenizer is None else tokenizer
        config = self.model.config
        if max_model_len is None:
            max_model_len = min(config.max_position_embeddings, 2048)
        elif isinstance(max_model_len, int) and max_model_len > config.max_position_embeddings:
            raise ValueError(f"max_model_len={max_model_len} is beyond the model's {config.max_position_embeddings} "
                             "positions (max_position_embeddings): its position embeddings end there")
        use_graphs = (use_cuda_graph and self.device.type == "cuda"
                      and resolve_backend(attention_backend, self.device) == "triton")
        if num_kvcache_blocks is None:
            profile = None
            if self.device.type == "cuda":  # vLLM's profile run: the largest step's activations must fit too
                largest_decode = min(max_num_seqs, max_num_batched_tokens) if use_graphs else 0
                profile = profile_cuda_memory(self.model, max_num_batched_tokens, max_num_seqs, largest_decode)
            num_kvcache_blocks = num_blocks_for_memory(
                config, block_size, self.model.dtype, profile=profile, gpu_memory_utilization=gpu_memory_utilization,
                cpu_kv_cache_bytes=cpu_kv_cache_bytes, max_model_len=max_model_len, kv_cache_dtype=kv_cache_dtype)
        self.storage = PagedKVStorage(config.num_layers, num_kvcache_blocks, block_size, config.num_kv_heads,
                                      config.head_dim, dtype=self.model.dtype, device=self.device,
                                      kv_cache_dtype=kv_cache_dtype)
        if components is None:
            components = EngineComponents()
        elif not isinstance(components, EngineComponents):
            raise TypeError(f"components must be an EngineComponents (labkit.engine.components), "
                            f"got {type(components).__name__}")
        self.block_manager = components.block_manager(num_kvcache_blocks, block_size,
                                                      enable_prefix_caching=enable_prefix_caching)
        self.scheduler = components.scheduler(
            SchedulerConfig(max_num_seqs, max_num_batched_tokens, max_model_len, enable_chunked_prefill,
                            preemption_mode, long_prefill_token_threshold, priority_aging_steps),
            self.block_manager, self.storage)
        backend = PagedAttentionBackend(self.storage, attention_backend)
        graphs = None
        if use_graphs:
            graphs = _capture_decode_graphs(self.model, backend,
                                            capture_sizes(max_num_seqs, max_num_batched_tokens, num_kvcache_blocks),
                                            -(-max_model_len // block_size), max_model_len)
        elif backend.reads_pool_in_c and FusedDecoder.unsupported(self.model, self.storage) is None:
            graphs = FusedDecoder(self.model, self.storage, backend)  # steps in C (fused_decode.py says which)
        self.runner = components.model_runner(self.model, self.storage, backend, graphs)
        if speculative is not None and not isinstance(speculative, SpeculativeConfig):
            raise TypeError(f"speculative must be a SpeculativeConfig or None, got {type(speculative).__name__}")
        if speculative is not None and components != EngineComponents():
            raise ValueError("speculative decoding runs with labkit's own block manager, scheduler and model "
                             "runner: pass speculative= or components=, not both")
        if speculative is not None and self.storage.quant is not None:
            # A rejected draft may have grown its block's scale and re-rounded the codes before it:
            # rolling back the tokens would not roll back the cache.
            raise ValueError(f"speculative decoding needs an unquantized KV cache, got kv_cache_dtype="
                             f"{kv_cache_dtype!r}: rejected drafts would leave their mark on the block scales")
        self.speculative = None if speculative is None else SpeculativeDecoder(
            speculative, self.runner, self.block_manager, self.storage, self.scheduler.config, config.vocab_size)
        self.eos_token_id = config.eos_token_id if config.eos_token_id is not None else self.tokenizer.eos_token_id
        self.metrics = EngineMetrics()
        self._requests: dict[int, Sequence] = {}
        self._detok: dict[int, IncrementalDetokenizer] = {}
        self._outputs: dict[int, RequestOutput] = {}  # finished, not yet handed to whoever owns them
        self._claimed: set[int] = set()  # requests a running generate() or stream() collects itself
        self._ids = itertools.count()

    # --- requests ----------------------------------------------------------------------------
    def _make_sequence(self, prompt, params: SamplingParams, priority: int) -> Sequence:
        if isinstance(prompt, str):
            if not prompt:
                raise ValueError("prompt is empty: give at least one character of text")
            token_ids, text = self.tokenizer.encode(prompt), prompt
            if not token_ids:
                raise ValueError(f"prompt {prompt!r} encodes to no tokens")
        elif _is_token_ids(prompt):
            token_ids, text = _token_ids(prompt), None
            if not token_ids:
                raise ValueError("prompt is an empty list of token ids")
            vocab = self.model.config.vocab_size
            if min(token_ids) < 0 or max(token_ids) >= vocab:
                raise ValueError(f"prompt token ids must lie in [0, {vocab}), got {min(token_ids)}..{max(token_ids)}")
        else:
            raise TypeError(f"a prompt must be a str (or a list of token ids), got {type(prompt).__name__}")
        if not isinstance(params, SamplingParams):
            raise TypeError(f"sampling params must be a SamplingParams, got {type(params).__name__}")
        if isinstance(priority, (bool, np.bool_)) or not isinstance(priority, numbers.Integral):
            raise TypeError(f"priority must be an integer, got {priority!r}")
        vocab = self.model.config.vocab_size
        for field, ids in params.token_ids_named().items():
            if any(t >= vocab for t in ids):
                raise ValueError(f"{field} must hold token ids below the vocabulary size {vocab}, got {max(ids)}")
        banned = set(params.stop_token_ids) | ({self.eos_token_id} if not params.ignore_eos else set())
        if params.min_tokens and params.allowed_token_ids is not None and set(params.allowed_token_ids) <= banned:
            raise ValueError(f"allowed_token_ids {list(params.allowed_token_ids)} are all EOS or stop tokens, which "
                             f"min_tokens={params.min_tokens} masks: no token could be sampled")
        if params.n > self.scheduler.config.max_num_seqs:
            raise ValueError(f"n={params.n} samples cannot run at once with max_num_seqs="
                             f"{self.scheduler.config.max_num_seqs}; lower n or raise max_num_seqs")
        if self.speculative is not None:
            check_supported(params)
        seq = Sequence(token_ids, params, priority=priority, prompt=text, seq_id=next(self._ids))
        self.scheduler.check_fits(seq)
        return seq

    def _enqueue(self, seq: Sequence) -> None:
        self.scheduler.add(seq)
        self._requests[seq.seq_id] = seq
        self._detok[seq.seq_id] = IncrementalDetokenizer(self.tokenizer, skip_special_tokens=True)

    def add_request(self, prompt, params: SamplingParams | None = None, priority: int = 0) -> int:
        """Queue one request; returns its id (for `abort`, or to find it in `step()`'s outputs)."""
        seq = self._make_sequence(prompt, SamplingParams() if params is None else params, priority)
        self._enqueue(seq)
        return seq.seq_id

    def abort(self, request_id: int) -> None:
        """Cancel a request: its blocks return to the pool and it finishes with reason ABORTED. As in
        vLLM, `step()` returns no output for it: whoever aborts it knows."""
        seq = self._requests.get(request_id)
        if seq is None:
            raise ValueError(f"no unfinished request with id {request_id!r}")
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
        """Where an unfinished request stands now (its text so far): what a streaming server sends on."""
        seq = self._requests.get(request_id)
        if seq is None:
            raise ValueError(f"no unfinished request with id {request_id!r}")
        return self._output(seq)

    # --- the engine loop ---------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        """One scheduling + forward step. Returns the outputs of finished requests that were queued
        with `add_request`, including those that finished during another caller's steps (a
        `generate` or `stream` call collects its own requests and leaves everyone else's here).
        Ctrl-C during a step takes effect when the step is done (labkit/engine/interrupts.py)."""
        finished = {}
        with deferred_interrupts(undo=lambda: self._outputs.update(finished)):  # kept for the next step
            self._run_step()
            for i in [i for i in self._outputs if i not in self._claimed]:
                finished[i] = self._outputs.pop(i)
        return list(finished.values())

    def _run_step(self) -> None:
        """Schedule, run, append and release; finished requests' outputs go to `self._outputs`.

        Safe to stop at any exception it raises: until the scheduler's postprocess advances a
        sequence, its step can simply run again, so the sampled tokens are
        appended one sequence at a time, each append (and each fork of a new sample) all or
        nothing, and whatever finished but was not released or collected yet is picked up by the
        next step. A new sample adopted before the interrupt recomputes its share of the step
        itself (copying the shared partial block); the samples not yet adopted are forked again.
        """
        start = time.perf_counter()
        out = self.scheduler.schedule()  # also releases what an interrupted step left finished
        if not out.is_empty:
            num_batched_tokens = out.num_batched_tokens  # before forked samples join `out`
            if self.speculative is None:
                draws = self._run_isolated(out)
                now = time.perf_counter()
                for draw in draws:
                    if draw.forked_from is not None:
                        self._adopt(draw.forked_from, draw.seq, out)
                    self._append(draw.seq, draw.token, now, draw.logprobs)
                num_sampled = len(draws)
            else:
                num_sampled = self._append_speculated(self.speculative.step(out))
            self.scheduler.postprocess(out)
            self._account(out, num_batched_tokens, num_sampled, time.perf_counter() - start)
        for seq in [s for s in self._requests.values() if s.group_finished]:
            self._finalize(seq)

    def _run_isolated(self, out: SchedulerOutput) -> list["_Draw"]:
        """The step's draws (see `_draw`). If the batch fails, each scheduled sequence runs alone:
        a request whose step fails by itself finishes with reason ERROR (its error as stop_reason),
        all its samples with it, and the others go on; if every one of several fails, the engine is
        at fault and it raises."""
        try:
            return self._draw(out.seqs, out.num_new_tokens)
        except Exception as batch_error:
            draws, failures = [], {}
            for seq, n in zip(out.seqs, out.num_new_tokens, strict=True):
                try:
                    draws += self._draw([seq], [n])
                except Exception as error:  # noqa: BLE001 - isolate it; its output carries the message
                    failures[seq] = error
            if len(failures) == len(out.seqs) > 1:
                raise batch_error
            for seq, error in failures.items():
                self._fail(seq, f"{type(error).__name__}: {error}")
            return [d for d in draws if not (d.forked_from or d.seq).is_finished]  # not a failed request's

    def _draw(self, seqs: list[Sequence], num_new_tokens: list[int]) -> list["_Draw"]:
        """Run the model over `seqs` and sample the next token of each that is due one, plus the
        first token of every new sample a request with n > 1 forks now (from its parent's logits
        row). New samples come before their parent, so the parent's append commits the fork: an
        interrupt before it leaves the parent to fork the missing samples again next step.

        Changes nothing but the K/V it computes and prompt logprobs (positions already recorded are
        skipped), so a failed or interrupted call can simply be repeated."""
        forward = self.runner.forward(seqs, num_new_tokens)
        for prompt in forward.prompt_logits:
            targets = prompt.seq.prompt_token_ids[prompt.first_target:prompt.first_target + len(prompt.logits)]
            prompt.seq.prompt_logprobs += compute_logprobs(prompt.logits, targets,
                                                           [prompt.seq.params.prompt_logprobs] * len(targets),
                                                           self._decode_token)
        samples, parents, rows = [], [], []
        for row, seq in enumerate(forward.sampled_seqs):
            for sample in self._new_samples(seq) + [seq]:
                samples.append(sample)
                parents.append(seq if sample is not seq else None)
                rows.append(row)
        if not samples:
            return []
        logits = forward.logits if len(rows) == len(forward.sampled_seqs) else forward.logits[rows]
        tokens = self.runner.sample(logits, samples, self.eos_token_id)
        logprobs = self._sampled_logprobs(logits, samples, tokens)
        return [_Draw(*draw) for draw in zip(samples, tokens, logprobs, parents, strict=True)]

    def _append_speculated(self, tokens_of: dict[Sequence, list[int]]) -> int:
        """Append each sequence's verified tokens in order until one finishes it; returns how many.
        (A speculative step is not isolated per request: its failure is the caller's.)"""
        now, count = time.perf_counter(), 0
        for seq, tokens in tokens_of.items():
            for token in tokens:
                self._append(seq, token, now)
                count += 1
                if seq.is_finished:
                    break
        return count

    def _new_samples(self, seq: Sequence) -> list[Sequence]:
        """The samples a request with n > 1 still has to fork off `seq`, its sample 0, which is about
        to get its first token (none otherwise). They are made here but join the request only in
        `_adopt`. With a seed, sample i uses seed + i (vLLM's rule), so every sample is
        reproducible and none depends on what else runs in the batch."""
        children = []
        for index in range(len(seq.group), seq.params.n):
            seed = seq.params.seed
            params = seq.params if seed is None else dataclasses.replace(seq.params, seed=_wrap_int64(seed + index))
            children.append(seq.fork(next(self._ids), params, index))
        return children

    def _adopt(self, parent: Sequence, child: Sequence, out: SchedulerOutput) -> None:
        """Make a new sample part of its request: it shares the parent's KV blocks (the prompt's)
        and, having computed what its parent computed, is advanced alike by postprocess. All or
        nothing: an interrupt halfway through undoes it."""
        detok = IncrementalDetokenizer(self.tokenizer, skip_special_tokens=True)
        num_new_tokens = out.num_new_tokens[out.seqs.index(parent)]
        try:
            self.scheduler.fork(parent, child)
            out.seqs.append(child)
            out.num_new_tokens.append(num_new_tokens)
            self._detok[child.seq_id] = detok
            parent.group.append(child)
        except BaseException:
            self.scheduler.abort(child)  # releases the blocks it shares, if it got them
            self._detok.pop(child.seq_id, None)
            if child in out.seqs:
                del out.num_new_tokens[out.seqs.index(child)]
                out.seqs.remove(child)
            raise

    def _fail(self, seq: Sequence, reason: str) -> None:
        """Finish the request `seq` belongs to with reason ERROR (every unfinished sample of it) and
        release its blocks."""
        warnings.warn(f"request {seq.request_id} failed and was finished with reason 'error': {reason}", stacklevel=4)
        for sample in seq.group:
            if not sample.is_finished:
                sample.finish(FinishReason.ERROR, reason)
            self.scheduler.abort(sample)  # releases its blocks

    def _sampled_logprobs(self, logits: torch.Tensor, seqs: list[Sequence], tokens: list[int]) -> list:
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

    def _append(self, seq: Sequence, token: int, now: float, logprobs: dict | None = None) -> None:
        """Add one sampled token, its logprobs, its text and the stop decision; all or nothing."""
        detok = self._detok[seq.seq_id]
        checkpoint = detok.state()
        try:
            piece = detok.push(token)
            text = seq.text + piece
            state = check_stop(seq.params, seq.output_token_ids + [token], text, len(piece), self.eos_token_id)
        except BaseException:
            detok.restore(checkpoint)
            raise
        # From here on nothing can fail: plain assignments.
        seq.append_token(token)
        seq.text = text
        if logprobs is not None:
            seq.logprobs.append(logprobs)
            seq.cumulative_logprob += logprobs[token].logprob
        if seq.first_token_time is None:
            seq.first_token_time = now
        if state is not None:
            if state.finish_reason == "length":
                seq.finish(FinishReason.MAX_TOKENS)
            elif state.stop_reason is None:
                seq.finish(FinishReason.EOS, token)
            else:
                if state.text_end is not None:  # vLLM's rule: the text stops before the stop string...
                    keep = len(state.stop_reason) if seq.params.include_stop_str_in_output else 0
                    seq.text = seq.text[:state.text_end + keep]  # ...or just after it, if asked
                seq.finish(FinishReason.STOP, state.stop_reason)
        elif seq.num_tokens >= self.scheduler.config.max_model_len:
            seq.finish(FinishReason.MAX_TOKENS)

    def _account(self, out: SchedulerOutput, num_batched_tokens: int, num_sampled: int, elapsed: float) -> None:
        m = self.metrics
        m.num_steps += 1
        m.busy_time += elapsed
        m.num_generated_tokens += num_sampled
        m.num_batched_tokens += num_batched_tokens
        m.num_preemptions += len(out.preempted)
        m.num_swaps += len(out.swapped_out)
        m.prefix_cache_queried_tokens = self.block_manager.stats.queried_tokens
        m.prefix_cache_hit_tokens = self.block_manager.stats.hit_tokens
        if self.speculative is not None:
            spec = self.speculative
            m.num_draft_tokens += spec.num_draft_tokens
            m.num_accepted_draft_tokens += spec.num_accepted_tokens
            m.num_verify_passes += spec.num_verify_passes

    def _finalize(self, seq: Sequence) -> None:
        """Keep the output of a finished request (`seq` is its sample 0) for its owner; forget the request."""
        for sample in seq.group:
            detok = self._detok.pop(sample.seq_id, None)
            if detok is not None and sample.finish_reason is not FinishReason.STOP:
                sample.text += detok.flush()
        if self.speculative is not None:
            self.speculative.forget(seq)
        metrics = RequestMetrics.of(seq)
        self._outputs[seq.request_id] = self._output(seq, metrics)
        self._requests.pop(seq.request_id, None)
        self.metrics.record(metrics)

    @staticmethod
    def _output(seq: Sequence, metrics: RequestMetrics | None = None) -> RequestOutput:
        """vLLM's RequestOutput of the request whose sample 0 is `seq`, finished or not."""
        samples = [CompletionOutput(s.index, s.text, s.output_token_ids, s.cumulative_logprob, s.logprobs,
                                    s.finish_reason, s.stop_reason) for s in seq.group]
        return RequestOutput(seq.request_id, seq.prompt, seq.prompt_token_ids, seq.prompt_logprobs, samples,
                             seq.group_finished, metrics or RequestMetrics.of(seq))

    # --- user-facing calls -------------------------------------------------------------------
    def generate(self, prompts, sampling_params: SamplingParams | list[SamplingParams] | None = None, *,
                 priority: int | list[int] = 0, use_tqdm: bool | None = None) -> list[RequestOutput]:
        """Run prompts to completion; outputs come back in prompt order.

        Every prompt is checked before any is queued, so one bad prompt leaves the engine untouched.
        `use_tqdm=None` shows a progress bar only when stderr is a terminal (not in notebooks or tests).
        """
        if isinstance(prompts, str) or isinstance(prompts, np.ndarray) or (
                isinstance(prompts, list) and prompts and _is_token_ids(prompts)):
            prompts = [prompts]
        if not isinstance(prompts, (list, tuple)) or not prompts:
            raise TypeError("prompts must be a str or a non-empty list of prompts")
        n = len(prompts)
        params = _per_prompt(sampling_params if sampling_params is not None else SamplingParams(), n,
                             "sampling_params")
        priorities = _per_prompt(priority, n, "priority")
        seqs = [self._make_sequence(p, sp, pr) for p, sp, pr in zip(prompts, params, priorities, strict=True)]
        ids = [seq.seq_id for seq in seqs]
        bar = _progress(n, use_tqdm)
        try:
            self._claimed.update(ids)
            for seq in seqs:
                self._enqueue(seq)
            while not all(i in self._outputs for i in ids):
                done = sum(i in self._outputs for i in ids)
                self._run_step()
                bar.update(sum(i in self._outputs for i in ids) - done)
            return [self._outputs[i] for i in ids]
        finally:
            bar.close()
            for i in ids:  # interrupted (e.g. KeyboardInterrupt): leave nothing queued
                if i in self._requests:
                    self.abort(i)
                self._outputs.pop(i, None)
            self._claimed.difference_update(ids)

    def chat(self, messages, sampling_params: SamplingParams | None = None, **kwargs) -> list[RequestOutput]:
        """One conversation (a list of {"role", "content"} dicts) or a batch of them (a list of lists),
        as vLLM's `LLM.chat` takes them."""
        if isinstance(messages, dict):
            raise TypeError("messages is a single message dict; a conversation is a list of messages: "
                            "wrap it in a list, [{'role': ..., 'content': ...}]")
        if not isinstance(messages, (list, tuple)) or not messages:
            raise TypeError("messages must be a non-empty list of messages ({'role': ..., 'content': ...} "
                            f"dicts), or a list of such lists; got {type(messages).__name__}")
        conversations = messages if isinstance(messages[0], (list, tuple)) else [messages]
        for conversation in conversations:
            if not conversation or not all(isinstance(m, dict) and {"role", "content"} <= m.keys()
                                           for m in conversation):
                raise TypeError("each message must be a dict with 'role' and 'content', and each "
                                f"conversation a non-empty list of them; got {conversation!r}")
            for m in conversation:
                if m["role"] not in CHAT_ROLES or not isinstance(m["content"], str):
                    raise ValueError(f"a message's role must be one of {', '.join(CHAT_ROLES)} and its content a "
                                     f"str (what labkit serve takes too); got {m['role']!r} with "
                                     f"{type(m['content']).__name__} content")
        prompts = [render_chat(self.tokenizer, c) for c in conversations]
        return self.generate(prompts, sampling_params, **kwargs)

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
                ready = len(seq.text) if seq.is_finished else len(seq.text) - hold
                if ready > sent:
                    yield seq.text[sent:ready]
                    sent = ready
            # Finished during another caller's step (between our yields): the rest of the text.
            if seq.seq_id in self._requests:  # that step was interrupted before collecting it
                self._finalize(seq)
            text = self._outputs[seq.seq_id].text
            if len(text) > sent:
                yield text[sent:]
        finally:
            if seq.seq_id in self._requests:
                self.abort(seq.seq_id)
            self._outputs.pop(seq.seq_id, None)
            self._claimed.discard(seq.seq_id)

    def beam_search(self, prompts, params: BeamSearchParams) -> list[BeamSearchOutput]:
        """vLLM's `LLM.beam_search`, run inside this engine: one BeamSearchOutput per prompt.

        Each beam is an engine Sequence in the paged KV cache. A beam that continues in k ways is
        forked k - 1 times (its blocks are shared, the partial last block copied on write); no
        beam's prompt is prefilled twice. The search follows transformers' rules (see
        labkit/sampling/beam.py), so it returns transformers' `generate(num_beams=...)` hypotheses.
        A prompt is a str, a list of token ids, or vLLM's {"prompt": ...} / {"prompt_token_ids": ...}.
        Runs on its own: call it when no other request is queued.
        """
        if not isinstance(params, BeamSearchParams):
            raise TypeError(f"params must be a BeamSearchParams, got {type(params).__name__}")
        if isinstance(prompts, (str, dict)) or (isinstance(prompts, list) and prompts and isinstance(prompts[0], int)):
            prompts = [prompts]
        if not isinstance(prompts, (list, tuple)) or not prompts:
            raise TypeError("prompts must be a str, a dict or a non-empty list of them")
        if self.speculative is not None:
            raise ValueError("beam_search does not run with speculative decoding: use an engine without speculative=")
        if self.has_unfinished_requests():
            raise RuntimeError("beam_search runs alone: finish or abort the queued requests first")
        token_lists = []
        for prompt in prompts:
            if isinstance(prompt, dict):
                if not ("prompt" in prompt) ^ ("prompt_token_ids" in prompt):
                    raise ValueError(f"a prompt dict needs one of 'prompt' or 'prompt_token_ids', got {sorted(prompt)}")
                prompt = prompt.get("prompt", prompt.get("prompt_token_ids"))
            token_lists.append(self._make_sequence(prompt, SamplingParams(max_tokens=params.max_tokens), 0).token_ids)
        search = EngineBeamSearch(self.block_manager, self.storage, self.runner, self.scheduler.config.max_model_len)
        eos = None if params.ignore_eos else self.eos_token_id
        return [search.run(ids, params, eos, self.tokenizer) for ids in token_lists]

    def reset_metrics(self) -> None:
        self.metrics = EngineMetrics()


def _capture_decode_graphs(model, backend, sizes, max_blocks, max_model_len):
    """CUDA graphs for decode steps, or None (with a warning) if capturing fails: eager still works."""
    from labkit.engine.cuda_graph import DecodeGraphs

    try:
        with torch.inference_mode():
            return DecodeGraphs(model, backend, sizes, max_blocks, max_model_len)
    except Exception as error:  # noqa: BLE001 - any capture failure means: run without graphs
        warnings.warn(f"CUDA graph capture failed, decoding without graphs: {error}", stacklevel=3)
        return None


@dataclasses.dataclass(frozen=True)
class _Draw:
    """One sampled token of one step: for `seq`, forked off `forked_from` in this step if not None."""

    seq: Sequence
    token: int
    logprobs: dict | None
    forked_from: Sequence | None


def render_chat(tokenizer, messages: list[dict], add_generation_prompt: bool = True) -> str:
    """A conversation as the chat template renders it (what `LLM.chat` and the server's chat route
    tokenize); OpenAI's "developer" role is the template's system prompt."""
    return tokenizer.apply_chat_template([{**m, "role": "system" if m["role"] == "developer" else m["role"]}
                                          for m in messages], add_generation_prompt=add_generation_prompt)


def _wrap_int64(value: int) -> int:
    """A derived seed (seed + sample index) kept in the int64 range a seed must lie in."""
    return (value + 2**63) % 2**64 - 2**63


def _is_token_ids(prompt) -> bool:
    """A prompt given as token ids: a list or tuple of integers (numpy's included) or a numpy array.
    Floats and bools are no token ids; `_token_ids` says so."""
    if isinstance(prompt, np.ndarray):
        return True
    return isinstance(prompt, (list, tuple)) and all(
        isinstance(t, (numbers.Number, np.bool_)) for t in prompt)


def _token_ids(prompt) -> list[int]:
    array = np.asarray(prompt)
    if array.ndim != 1:
        raise TypeError(f"a prompt of token ids must be one-dimensional, got shape {array.shape}")
    if array.size and not np.issubdtype(array.dtype, np.integer):
        raise TypeError(f"token ids must be integers, got {array.dtype} values")
    return [int(t) for t in array]


def _per_prompt(value, n: int, name: str) -> list:
    if isinstance(value, (list, tuple)):
        if len(value) != n:
            raise ValueError(f"{name} has {len(value)} entries for {n} prompts")
        return list(value)
    return [value] * n


class _NoBar:
    def update(self, n: int) -> None:
        pass

    def close(self) -> None:
        pass


def _progress(total: int, use_tqdm: bool | None):
    if use_tqdm is None:
        use_tqdm = total > 1 and sys.stderr.isatty()
    if not use_tqdm:
        return _NoBar()
    from tqdm.auto import tqdm

    return tqdm(total=total, desc="generate", unit="req")
