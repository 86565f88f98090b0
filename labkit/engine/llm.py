"""`LLM`: the engine behind an API shaped like vLLM's.

    llm = LLM("smollm2", max_num_seqs=16)      # a model name, a .gguf path or an HF folder
    outputs = llm.generate(["The capital of France is", "Hello"], SamplingParams(max_tokens=20))
    outputs[0].text, outputs[0].token_ids, outputs[0].finish_reason, outputs[0].metrics.ttft

Each `step()` is seed 001's engine loop: the scheduler picks the batch, the model runner runs one
forward pass over it and samples, and the engine appends the tokens, detokenizes them
incrementally, checks the stop rules and releases what finished.
"""

import itertools
import sys
import time
import warnings
from collections.abc import Iterator
from dataclasses import dataclass

import torch

from labkit.attention.paged import PagedAttentionBackend
from labkit.cache.block_manager import BlockManager
from labkit.cache.paged_storage import PagedKVStorage
from labkit.device import pick_device
from labkit.engine.metrics import EngineMetrics, RequestMetrics
from labkit.engine.model_runner import DEFAULT_CPU_KV_CACHE_BYTES, ModelRunner, num_blocks_for_memory
from labkit.engine.scheduler import Scheduler, SchedulerConfig, SchedulerOutput
from labkit.engine.sequence import FinishReason, Sequence
from labkit.model import DecoderModel, load_model
from labkit.sampling import SamplingParams, check_stop
from labkit.tokenizer import IncrementalDetokenizer, load_tokenizer


@dataclass(frozen=True)
class RequestOutput:
    request_id: int
    prompt: str | None
    prompt_token_ids: list[int]
    text: str
    token_ids: list[int]
    finish_reason: FinishReason | None
    stop_reason: str | int | None
    metrics: RequestMetrics

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


class LLM:
    def __init__(self, model="smollm2", *, tokenizer=None, block_size: int = 16, num_kvcache_blocks: int | None = None,
                 max_num_seqs: int = 64, max_num_batched_tokens: int = 1024, max_model_len: int | None = None,
                 attention_backend: str = "auto", enable_prefix_caching: bool = True,
                 enable_chunked_prefill: bool = True, preemption_mode: str = "recompute",
                 device: str | torch.device | None = None, dtype: torch.dtype | None = None,
                 gpu_memory_utilization: float = 0.9, cpu_kv_cache_bytes: int = DEFAULT_CPU_KV_CACHE_BYTES,
                 use_cuda_graph: bool = True):
        if isinstance(model, DecoderModel):  # already loaded: several engines can share one model
            if tokenizer is None:
                raise ValueError("an already-loaded model needs its tokenizer: pass tokenizer=")
            self.model, self.device = model, model.device
        else:
            self.device = pick_device(None if device is None else str(device))
            self.model = load_model(model, device=self.device, dtype=dtype)
        self.tokenizer = load_tokenizer(model) if tokenizer is None else tokenizer
        config = self.model.config
        if num_kvcache_blocks is None:
            num_kvcache_blocks = num_blocks_for_memory(config, block_size, self.model.dtype, self.device,
                                                       gpu_memory_utilization, cpu_kv_cache_bytes)
        self.storage = PagedKVStorage(config.num_layers, num_kvcache_blocks, block_size, config.num_kv_heads,
                                      config.head_dim, dtype=self.model.dtype, device=self.device)
        self.block_manager = BlockManager(num_kvcache_blocks, block_size,
                                          enable_prefix_caching=enable_prefix_caching)
        if max_model_len is None:
            max_model_len = min(config.max_position_embeddings, 2048)
        self.scheduler = Scheduler(
            SchedulerConfig(max_num_seqs, max_num_batched_tokens, max_model_len, enable_chunked_prefill,
                            preemption_mode),
            self.block_manager, self.storage)
        backend = PagedAttentionBackend(self.storage, attention_backend)
        graphs = None
        if use_cuda_graph and self.device.type == "cuda" and backend.backend == "triton":
            graphs = _capture_decode_graphs(self.model, backend, max_num_seqs, -(-max_model_len // block_size),
                                            max_model_len)
        self.runner = ModelRunner(self.model, self.storage, backend, graphs)
        self.eos_token_id = config.eos_token_id if config.eos_token_id is not None else self.tokenizer.eos_token_id
        self.metrics = EngineMetrics()
        self._requests: dict[int, Sequence] = {}
        self._detok: dict[int, IncrementalDetokenizer] = {}
        self._ids = itertools.count()

    # --- requests ----------------------------------------------------------------------------
    def _make_sequence(self, prompt, params: SamplingParams, priority: int) -> Sequence:
        if isinstance(prompt, str):
            if not prompt:
                raise ValueError("prompt is empty: give at least one character of text")
            token_ids, text = self.tokenizer.encode(prompt), prompt
            if not token_ids:
                raise ValueError(f"prompt {prompt!r} encodes to no tokens")
        elif isinstance(prompt, (list, tuple)) and all(isinstance(t, int) and not isinstance(t, bool)
                                                       for t in prompt):
            if not prompt:
                raise ValueError("prompt is an empty list of token ids")
            vocab = self.model.config.vocab_size
            if min(prompt) < 0 or max(prompt) >= vocab:
                raise ValueError(f"prompt token ids must lie in [0, {vocab}), got {min(prompt)}..{max(prompt)}")
            token_ids, text = list(prompt), None
        else:
            raise TypeError(f"a prompt must be a str (or a list of token ids), got {type(prompt).__name__}")
        if not isinstance(params, SamplingParams):
            raise TypeError(f"sampling params must be a SamplingParams, got {type(params).__name__}")
        if isinstance(priority, bool) or not isinstance(priority, int):
            raise TypeError(f"priority must be an int, got {priority!r}")
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
        """Cancel a request: its blocks return to the pool and it finishes with reason ABORTED."""
        seq = self._requests.get(request_id)
        if seq is None:
            raise ValueError(f"no unfinished request with id {request_id!r}")
        self.scheduler.abort(seq)
        self._finalize(seq)

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished

    def request_output(self, request_id: int) -> RequestOutput:
        """Where an unfinished request stands now (its text so far): what a streaming server sends on."""
        seq = self._requests.get(request_id)
        if seq is None:
            raise ValueError(f"no unfinished request with id {request_id!r}")
        return self._output(seq)

    # --- the engine loop ---------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        """One scheduling + forward step. Returns outputs of the requests that finished in it."""
        start = time.perf_counter()
        out = self.scheduler.schedule()
        if out.is_empty:
            return []
        seqs, tokens = self.runner.run(out.seqs, out.num_new_tokens)
        now = time.perf_counter()
        for seq, token in zip(seqs, tokens, strict=True):
            self._append(seq, token, now)
        finished = self.scheduler.postprocess(out)
        self._account(out, len(seqs), time.perf_counter() - start)
        return [self._finalize(seq) for seq in finished]

    def _append(self, seq: Sequence, token: int, now: float) -> None:
        seq.append_token(token)
        if seq.first_token_time is None:
            seq.first_token_time = now
        piece = self._detok[seq.seq_id].push(token)
        seq.text += piece
        state = check_stop(seq.params, seq.output_token_ids, seq.text, len(piece), self.eos_token_id)
        if state is not None:
            if state.finish_reason == "length":
                seq.finish(FinishReason.MAX_TOKENS)
            elif state.stop_reason is None:
                seq.finish(FinishReason.EOS, token)
            else:
                if state.text_end is not None:  # vLLM's rule: the text stops before the stop string
                    seq.text = seq.text[:state.text_end]
                seq.finish(FinishReason.STOP, state.stop_reason)
        elif seq.num_tokens >= self.scheduler.config.max_model_len:
            seq.finish(FinishReason.MAX_TOKENS)

    def _account(self, out: SchedulerOutput, num_sampled: int, elapsed: float) -> None:
        m = self.metrics
        m.num_steps += 1
        m.busy_time += elapsed
        m.num_generated_tokens += num_sampled
        m.num_batched_tokens += out.num_batched_tokens
        m.num_preemptions += len(out.preempted)
        m.num_swaps += len(out.swapped_out)
        m.prefix_cache_queried_tokens = self.block_manager.stats.queried_tokens
        m.prefix_cache_hit_tokens = self.block_manager.stats.hit_tokens

    def _finalize(self, seq: Sequence) -> RequestOutput:
        """The output of a finished request; forgets the request."""
        detok = self._detok.pop(seq.seq_id, None)
        if detok is not None and seq.finish_reason is not FinishReason.STOP:
            seq.text += detok.flush()
        self._requests.pop(seq.seq_id, None)
        metrics = RequestMetrics.of(seq)
        self.metrics.finished.append(metrics)
        return self._output(seq, metrics)

    @staticmethod
    def _output(seq: Sequence, metrics: RequestMetrics | None = None) -> RequestOutput:
        return RequestOutput(seq.seq_id, seq.prompt, seq.prompt_token_ids, seq.text, seq.output_token_ids,
                             seq.finish_reason, seq.stop_reason, metrics or RequestMetrics.of(seq))

    # --- user-facing calls -------------------------------------------------------------------
    def generate(self, prompts, sampling_params: SamplingParams | list[SamplingParams] | None = None, *,
                 priority: int | list[int] = 0, use_tqdm: bool | None = None) -> list[RequestOutput]:
        """Run prompts to completion; outputs come back in prompt order.

        Every prompt is checked before any is queued, so one bad prompt leaves the engine untouched.
        `use_tqdm=None` shows a progress bar only when stderr is a terminal (not in notebooks or tests).
        """
        if isinstance(prompts, str) or (isinstance(prompts, list) and prompts and isinstance(prompts[0], int)):
            prompts = [prompts]
        if not isinstance(prompts, (list, tuple)) or not prompts:
            raise TypeError("prompts must be a str or a non-empty list of prompts")
        n = len(prompts)
        params = _per_prompt(sampling_params if sampling_params is not None else SamplingParams(), n,
                             "sampling_params")
        priorities = _per_prompt(priority, n, "priority")
        seqs = [self._make_sequence(p, sp, pr) for p, sp, pr in zip(prompts, params, priorities, strict=True)]
        for seq in seqs:
            self._enqueue(seq)
        outputs: dict[int, RequestOutput] = {}
        bar = _progress(n, use_tqdm)
        try:
            while len(outputs) < n:
                for result in self.step():
                    outputs[result.request_id] = result
                    bar.update(1)
        finally:
            bar.close()
            for seq in seqs:  # interrupted (e.g. KeyboardInterrupt): leave nothing queued
                if seq.seq_id not in outputs and not seq.is_finished:
                    self.abort(seq.seq_id)
        by_id = {**{s.seq_id: self._output(s) for s in seqs if s.seq_id not in outputs}, **outputs}
        return [by_id[s.seq_id] for s in seqs]

    def chat(self, messages, sampling_params: SamplingParams | None = None, **kwargs) -> list[RequestOutput]:
        """One conversation (a list of {"role", "content"} dicts) or a list of them."""
        conversations = [messages] if messages and isinstance(messages[0], dict) else messages
        if not isinstance(conversations, list) or not conversations:
            raise TypeError("messages must be a list of {'role': ..., 'content': ...} dicts, or a list of those")
        prompts = [self.tokenizer.apply_chat_template(c, add_generation_prompt=True) for c in conversations]
        return self.generate(prompts, sampling_params, **kwargs)

    def stream(self, prompt, sampling_params: SamplingParams | None = None, priority: int = 0) -> Iterator[str]:
        """Yield the text of one request as it is generated (other queued requests advance too).

        Closing the generator early aborts the request.
        """
        seq = self._make_sequence(prompt, sampling_params or SamplingParams(), priority)
        self._enqueue(seq)
        sent = 0
        try:
            while not seq.is_finished:
                self.step()
                # Text is held back while a stop string might still be forming at its end.
                hold = max((len(s) - 1 for s in seq.params.stop), default=0) if not seq.is_finished else 0
                ready = len(seq.text) - hold
                if ready > sent:
                    yield seq.text[sent:ready]
                    sent = ready
        finally:
            if not seq.is_finished:
                self.abort(seq.seq_id)

    def reset_metrics(self) -> None:
        self.metrics = EngineMetrics()


def _capture_decode_graphs(model, backend, max_num_seqs, max_blocks, max_model_len):
    """CUDA graphs for decode steps, or None (with a warning) if capturing fails: eager still works."""
    from labkit.engine.cuda_graph import DecodeGraphs

    try:
        with torch.inference_mode():
            return DecodeGraphs(model, backend, max_num_seqs, max_blocks, max_model_len)
    except Exception as error:  # noqa: BLE001 - any capture failure means: run without graphs
        warnings.warn(f"CUDA graph capture failed, decoding without graphs: {error}", stacklevel=3)
        return None


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
