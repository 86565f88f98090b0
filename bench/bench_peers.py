"""labkit against llama.cpp, what a CPU user would run this GGUF with: the same file, the same thread
count, in one run on this machine.

Prints, each as a ratio labkit/llama.cpp measured in the same run, for every labkit weight format:
  1. batch-1 decode tok/s (time for 1 + n tokens minus time for 1, so the prefill cancels out);
  2. prompt processing tok/s on one ~128-token prompt;
  3. output tok/s on bench_engine.py's 64-request workload (same prompts and output lengths, every
     request generating exactly its length), llama.cpp driven through its own batch API: one
     `llama_batch` per step holding several sequence ids, finished sequences replaced at once
     (continuous batching, as llama.cpp's `parallel` example does it);
  4. agreement on a few chat prompts, for each labkit engine (the timed ones, and the quantized
     formats also in float32, llama.cpp's activation dtype): the greedy tokens both generate from the
     same prompt ids (matching prefix / longer output); then, along llama.cpp's own greedy text (each
     labkit model fed llama.cpp's tokens, one a step through a KV cache, so that one split does not
     change every later context), how often labkit's top token is llama.cpp's (the "same top" figure
     of llama.cpp's KL-divergence tool), llama.cpp's top-two gap where it is not, the mean KL
     divergence and the largest logit difference; the same against labkit's fp32 model of the
     dequantized weights. llama.cpp with its flash attention off runs the same comparisons against
     llama.cpp's default: the agreement one changed kernel inside the same engine reaches, as the
     yardstick;
  5. where the two part, stage by stage: labkit's q4_1 model (float32) fed llama.cpp's own input to
     each stage of every layer (read through llama.cpp's eval callback), against llama.cpp's output
     of it: the Q4_1 projections, SwiGLU and attention, each alone.
Both sides are timed alike (bench_engine.time_it: CPU seconds of the process with one thread); they
take turns and keep their best of --rounds for 1 and 2.

llama.cpp comes from llama-cpp-python built from source on this machine (`make bench-peers` does it
the first time: 10-25 minutes on two cores); this script never downloads anything.

    make bench-peers                  # build if needed, then this script with its defaults
    python bench/bench_peers.py --formats dequantized q4_1 --threads 2
"""

import argparse
import ctypes
import os
import re
from dataclasses import dataclass, field

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import numpy as np  # noqa: E402
import torch  # noqa: E402
from bench_engine import decode_speeds, time_it, workload  # noqa: E402

from labkit import kernels  # noqa: E402
from labkit.cache.kv_cache import KVCache  # noqa: E402
from labkit.engine import LLM  # noqa: E402
from labkit.kernels import int8_dot  # noqa: E402
from labkit.model.generate import last_token_logits  # noqa: E402
from labkit.model.weight_formats import WEIGHT_FORMATS  # noqa: E402
from labkit.registry import resolve_model_path  # noqa: E402
from labkit.sampling import SamplingParams  # noqa: E402

CHAT_QUESTIONS = ("What is a KV cache?", "Name three planets and one fact about each.",
                  "Write a haiku about a CPU.")
BUILD_HINT = "llama-cpp-python is not installed: `make bench-peers` builds it from source (10-25 minutes on two cores)"


def matching_prefix(a: list[int], b: list[int]) -> int:
    """How many leading tokens two greedy outputs share."""
    n = 0
    for x, y in zip(a, b, strict=False):
        if x != y:
            break
        n += 1
    return n


def top2_margin(logits: np.ndarray) -> float:
    """How far the greedy choice is ahead of the runner-up: a small margin makes a tie that rounding
    differences between two engines may break either way."""
    second, first = np.partition(logits, -2)[-2:]
    return float(first - second)


def agreement_note(matched: int, total: int, margin: float | None) -> str:
    return f"{matched}/{total}" + ("" if margin is None else f" (gap {margin:.2f})")


@dataclass
class Agreement:
    """How one model's next-token scores compare with a reference's along the same text."""
    same_top: int = 0
    positions: int = 0
    split_gaps: list[float] = field(default_factory=list)  # the reference's top-two gap where the tops differ
    gaps: list[float] = field(default_factory=list)  # ... at every position
    kl_sum: float = 0.0
    max_logit_diff: float = 0.0

    def add(self, reference: torch.Tensor, logits: torch.Tensor) -> None:
        """Rows [positions, vocab] of both at the same positions."""
        reference, logits = reference.double(), logits.double()
        same = reference.argmax(-1) == logits.argmax(-1)
        self.same_top += int(same.sum())
        self.positions += len(same)
        gaps = [top2_margin(row.numpy()) for row in reference]
        self.gaps += gaps
        self.split_gaps += [g for g, agrees in zip(gaps, same.tolist(), strict=True) if not agrees]
        log_p, log_q = reference.log_softmax(-1), logits.log_softmax(-1)
        self.kl_sum += float((log_p.exp() * (log_p - log_q)).sum())
        self.max_logit_diff = max(self.max_logit_diff, float((reference - logits).abs().max()))

    def __str__(self) -> str:
        splits = ", ".join(f"{g:.2f}" for g in sorted(self.split_gaps))
        splits = f" (reference gaps there {splits}; median over all {np.median(self.gaps):.2f})" if splits else ""
        return (f"same top {self.same_top}/{self.positions}{splits}, mean KL {self.kl_sum / self.positions:.4f}, "
                f"max |logit difference| {self.max_logit_diff:.2f}")


def forced_logits(model, prompt: list[int], continuation: list[int]) -> torch.Tensor:
    """The model's scores before each token of `continuation` [len, vocab] when it is fed that
    continuation instead of its own choices: the prompt in one step, then one token a step through a
    contiguous KV cache, the way decoding runs (the quantized formats' integer kernels included)."""
    cache = KVCache(model.config.num_layers)
    with torch.inference_mode():
        return torch.stack([last_token_logits(model, torch.tensor([step]), cache.seq_len, cache)[0].float()
                            for step in [prompt] + [[t] for t in continuation[:-1]]])


def best_times(runs: dict, rounds: int) -> dict:
    """Best time of each run over `rounds`; the runs take turns, so a burst of load on a shared machine
    does not land on one of them only."""
    best = dict.fromkeys(runs, float("inf"))
    for _ in range(rounds):  # one timed call of each run a round, not time_it's repeats: the turns matter
        for name, run in runs.items():
            best[name] = min(best[name], time_it(run))
    return best


@dataclass
class _Request:
    prompt: list[int]
    max_tokens: int
    output: list[int] = field(default_factory=list)
    seq_id: int | None = None


@dataclass(frozen=True)
class BatchEntry:
    """One token of a step's batch: which request, its sequence id, the token, its position, and whether
    the step must return logits for it (the last token of each sequence in the batch)."""
    request: int
    seq_id: int
    token: int
    pos: int
    logits: bool


class ContinuousBatcher:
    """Which tokens go into each decode call of an engine whose KV cache is keyed by sequence id.

    Each step carries the newest token of every running request first, then whole prompts of waiting
    requests, in arrival order, while a free sequence id and the token budget last. A request that has
    generated its `max_tokens` (end-of-sequence is ignored) finishes, and its sequence id is handed to
    the caller to clear from the cache before it is given to the next request.
    """

    def __init__(self, prompts: list[list[int]], max_tokens: list[int], max_seqs: int, max_batch_tokens: int):
        if len(prompts) != len(max_tokens):
            raise ValueError(f"{len(prompts)} prompts but {len(max_tokens)} output lengths")
        if max_seqs < 1 or max_batch_tokens < 1:
            raise ValueError(f"max_seqs ({max_seqs}) and max_batch_tokens ({max_batch_tokens}) must be >= 1")
        for i, (prompt, n) in enumerate(zip(prompts, max_tokens, strict=True)):
            if not prompt:
                raise ValueError(f"prompt {i} is empty")
            if len(prompt) > max_batch_tokens:
                raise ValueError(f"prompt {i} has {len(prompt)} tokens, more than a batch holds "
                                 f"({max_batch_tokens}): it could never be scheduled")
            if n < 1:
                raise ValueError(f"request {i} asks for {n} tokens; every request generates at least 1")
        self.requests = [_Request(list(p), n) for p, n in zip(prompts, max_tokens, strict=True)]
        self.max_batch_tokens = max_batch_tokens
        self._waiting = list(range(len(prompts)))
        self._running: list[int] = []
        self._free_ids = list(range(max_seqs - 1, -1, -1))  # popped from the end: 0 first

    @property
    def done(self) -> bool:
        return not self._waiting and not self._running

    def next_batch(self) -> list[BatchEntry]:
        entries = []
        for r in self._running:
            req = self.requests[r]
            entries.append(BatchEntry(r, req.seq_id, req.output[-1], len(req.prompt) + len(req.output) - 1, True))
        while self._waiting and self._free_ids:
            req = self.requests[self._waiting[0]]
            if len(entries) + len(req.prompt) > self.max_batch_tokens:
                break
            r = self._waiting.pop(0)
            req.seq_id = self._free_ids.pop()
            last = len(req.prompt) - 1
            entries.extend(BatchEntry(r, req.seq_id, t, i, i == last) for i, t in enumerate(req.prompt))
            self._running.append(r)
        return entries

    def advance(self, sampled: dict[int, int]) -> list[int]:
        """Append each request's sampled token; return the sequence ids of requests that finished."""
        if set(sampled) != set(self._running):
            raise ValueError(f"sampled tokens for requests {sorted(sampled)}, but {sorted(self._running)} run")
        finished = []
        for r, token in sampled.items():
            req = self.requests[r]
            req.output.append(token)
            if len(req.output) == req.max_tokens:
                finished.append(req.seq_id)
                self._free_ids.append(req.seq_id)
                self._running.remove(r)
        return finished


class LlamaCpp:
    """One llama.cpp context on a GGUF file through llama-cpp-python's C API, greedy only."""

    def __init__(self, path, threads: int, n_ctx: int, n_batch: int, n_seq_max: int = 1, kv_unified: bool = False,
                 taps: "Taps | None" = None, flash_attention: bool | None = None):
        try:
            import llama_cpp
        except ImportError:
            raise SystemExit(BUILD_HINT) from None
        self.lib = llama_cpp
        self._quiet = llama_cpp.llama_log_callback(lambda level, text, data: None)  # kept alive: C holds it
        llama_cpp.llama_log_set(self._quiet, ctypes.c_void_p(0))
        llama_cpp.llama_backend_init()
        self.model = llama_cpp.llama_model_load_from_file(str(path).encode(), llama_cpp.llama_model_default_params())
        if not self.model:
            raise RuntimeError(f"llama.cpp could not load {path}")
        params = llama_cpp.llama_context_default_params()
        params.n_ctx, params.n_batch, params.n_seq_max = n_ctx, n_batch, n_seq_max
        params.n_threads = params.n_threads_batch = threads
        params.kv_unified = kv_unified
        if flash_attention is not None:  # else llama.cpp's default: on where the backend has the kernel
            params.flash_attn_type = int(flash_attention)
        if taps is not None:
            self._taps = llama_cpp.ggml_backend_sched_eval_callback(taps.observe)  # kept alive: C holds it
            params.cb_eval = self._taps
        self.ctx = llama_cpp.llama_init_from_model(self.model, params)
        if not self.ctx:
            llama_cpp.llama_model_free(self.model)
            raise RuntimeError(f"llama.cpp could not make a context of {n_ctx} tokens, {n_seq_max} sequences")
        self.memory = llama_cpp.llama_get_memory(self.ctx)
        self.vocab = llama_cpp.llama_model_get_vocab(self.model)
        self.n_vocab = llama_cpp.llama_vocab_n_tokens(self.vocab)
        self.n_batch = n_batch
        self.batch = llama_cpp.llama_batch_init(n_batch, 0, 1)

    def close(self):
        self.lib.llama_batch_free(self.batch)
        self.lib.llama_free(self.ctx)
        self.lib.llama_model_free(self.model)

    def _decode(self, entries) -> None:
        b = self.batch
        b.n_tokens = len(entries)
        for i, (seq_id, token, pos, logits) in enumerate(entries):
            b.token[i], b.pos[i], b.n_seq_id[i], b.logits[i] = token, pos, 1, logits
            b.seq_id[i][0] = seq_id
        status = self.lib.llama_decode(self.ctx, b)
        if status != 0:
            raise RuntimeError(f"llama_decode returned {status} for a batch of {len(entries)} tokens")

    def logits(self, i: int) -> np.ndarray:
        """The vocabulary scores of the batch's i-th output token (-1: the last)."""
        scores = self.lib.llama_get_logits_ith(self.ctx, i)
        if not scores:
            raise RuntimeError(f"llama.cpp has no logits for batch row {i}")
        return np.ctypeslib.as_array(scores, shape=(self.n_vocab,))

    def prefill(self, prompt: list[int]) -> np.ndarray:
        """Logits after `prompt`, from an empty cache."""
        self.lib.llama_memory_clear(self.memory, True)
        self._decode([(0, t, i, i == len(prompt) - 1) for i, t in enumerate(prompt)])
        return self.logits(-1)

    def forced_logits(self, prompt: list[int], continuation: list[int]) -> torch.Tensor:
        """Scores before each token of `continuation` [len, vocab], in one batch: llama.cpp's CPU
        results for a token do not depend on the batch it comes in (measured: its greedy text and
        logits are the same fed one token at a time)."""
        self.lib.llama_memory_clear(self.memory, True)
        ids, first = prompt + continuation[:-1], len(prompt) - 1
        self._decode([(0, t, i, i >= first) for i, t in enumerate(ids)])
        return torch.stack([torch.from_numpy(self.logits(i).copy()) for i in range(first, len(ids))])

    def generate(self, prompt: list[int], max_tokens: int, stop_at_eos: bool = False) -> list[int]:
        """Greedy tokens of one sequence (batch 1)."""
        out = [int(self.prefill(prompt).argmax())]
        while len(out) < max_tokens and not (stop_at_eos and self.lib.llama_vocab_is_eog(self.vocab, out[-1])):
            self._decode([(0, out[-1], len(prompt) + len(out) - 1, True)])
            out.append(int(self.logits(-1).argmax()))
        return out

    def run_workload(self, prompts, max_tokens, max_seqs: int) -> list[list[int]]:
        """Every request to exactly its length, continuously batched over `max_seqs` sequence ids."""
        self.lib.llama_memory_clear(self.memory, True)
        batcher = ContinuousBatcher(prompts, max_tokens, max_seqs, self.n_batch)
        while not batcher.done:
            entries = batcher.next_batch()
            self._decode([(e.seq_id, e.token, e.pos, e.logits) for e in entries])
            rows = [(i, e.request) for i, e in enumerate(entries) if e.logits]
            for seq_id in batcher.advance({r: int(self.logits(i).argmax()) for i, r in rows}):
                self.lib.llama_memory_seq_rm(self.memory, seq_id, -1, -1)
        return [req.output for req in batcher.requests]


class _GgmlTensor(ctypes.Structure):
    """ggml.h's `struct ggml_tensor` as llama-cpp-python 0.3.36 (the version `make bench-peers` pins)
    builds it, up to its name."""
    _fields_ = [("type", ctypes.c_int), ("buffer", ctypes.c_void_p), ("ne", ctypes.c_int64 * 4),
                ("nb", ctypes.c_size_t * 4), ("op", ctypes.c_int), ("op_params", ctypes.c_int32 * 16),
                ("flags", ctypes.c_int32), ("src", ctypes.c_void_p * 10), ("view_src", ctypes.c_void_p),
                ("view_offs", ctypes.c_size_t), ("data", ctypes.c_void_p), ("name", ctypes.c_char * 64)]


class Taps:
    """llama.cpp's intermediate float32 tensors, read through its graph's eval callback: every value of
    a wanted name in the order it is computed (a name such as "Qcur-3" is the projection, then its
    reshape, then the rotated copy), as [rows, columns] (a token per row)."""

    def __init__(self, wanted):
        self.wanted = wanted  # name -> bool
        self.tensors: dict[str, list[torch.Tensor]] = {}

    def observe(self, tensor, ask: bool, user_data) -> bool:
        t = ctypes.cast(tensor, ctypes.POINTER(_GgmlTensor)).contents
        name = t.name.decode(errors="replace")
        if ask:
            return self.wanted(name)
        ne, nb = list(t.ne), list(t.nb)
        if t.type == 0 and t.data and nb[0] == 4 and nb[1] == 4 * ne[0] and nb[2] == nb[1] * ne[1]:  # contiguous f32
            data = ctypes.cast(t.data, ctypes.POINTER(ctypes.c_float))
            values = np.ctypeslib.as_array(data, shape=(int(np.prod(ne)),))
            columns = ne[0] * ne[1] if ne[2] > 1 else ne[0]  # [tokens, heads, dim] or [tokens, features]
            self.tensors.setdefault(name, []).append(torch.from_numpy(values.copy()).view(-1, columns))
        return True


STAGES = ("attn_norm", "Qcur", "Kcur", "Vcur", "kqv_out", "attn_out", "ffn_norm", "ffn_gate", "ffn_up",
          "ffn_swiglu", "ffn_out")
STAGE_NAME = re.compile(rf"({'|'.join(STAGES)})-\d+")  # llama.cpp's names for them in layer i: "ffn_up-7"


def stage_differences(path, model, prompt: list[int], threads: int) -> tuple[dict[str, float], int]:
    """Each stage of labkit's model computed from llama.cpp's own input to it, against llama.cpp's
    output of it, on one prompt: ({stage: the largest |difference| relative to the largest |output| of
    the same tensor, over the layers}, layers compared). So each stage is compared alone, without the
    differences of the stages before it; float32 rounding alone leaves ~1e-7. `model` holds
    the file's Q4_1 blocks in float32; its linears run their integer kernel, 8 rows a call. q and k
    are left out of the projections: the file stores their rows permuted for llama.cpp's rotation."""
    taps = Taps(lambda name: bool(STAGE_NAME.fullmatch(name)))
    llama = LlamaCpp(path, threads, n_ctx=max(512, len(prompt)), n_batch=max(512, len(prompt)), taps=taps)
    llama.prefill(prompt)
    llama.close()
    config, T = model.config, len(prompt)
    rows = int8_dot.DENSE_FROM_ROWS
    worst, layers = {}, 0

    def compare(stage: str, got: torch.Tensor, expected: torch.Tensor):
        relative = float((got.float() - expected).abs().max() / expected.abs().max())
        worst[stage] = max(worst.get(stage, 0.0), relative)

    def linear(module, x):  # 8 rows a call: the integer kernel, not the float GEMM that larger batches take
        return torch.cat([module(x[r:r + rows]) for r in range(0, len(x), rows)])

    with torch.inference_mode():
        for i, layer in enumerate(model.layers):
            tap = {name: taps.tensors[f"{name}-{i}"] for name in STAGES}
            if any(values[0].shape[0] != T for values in tap.values()):
                continue  # the last layer: llama.cpp keeps only the rows that need logits
            layers += 1
            attn, mlp = layer.self_attn, layer.mlp
            compare("projections", linear(attn.v_proj, tap["attn_norm"][0]), tap["Vcur"][0])
            compare("projections", linear(attn.o_proj, tap["kqv_out"][0]), tap["attn_out"][0])
            compare("projections", linear(mlp.gate_proj, tap["ffn_norm"][0]), tap["ffn_gate"][0])
            compare("projections", linear(mlp.up_proj, tap["ffn_norm"][0]), tap["ffn_up"][0])
            compare("projections", linear(mlp.down_proj, tap["ffn_swiglu"][0]), tap["ffn_out"][0])
            compare("SwiGLU", torch.nn.functional.silu(tap["ffn_gate"][0]) * tap["ffn_up"][0], tap["ffn_swiglu"][0])
            q, k, v = (tap[name][-1].view(T, -1, config.head_dim).transpose(0, 1) for name in ("Qcur", "Kcur", "Vcur"))
            out = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
            compare("attention", out.transpose(0, 1).reshape(T, -1), tap["kqv_out"][0])
    return worst, layers


def format_dtype(weight_format: str, dtype: torch.dtype) -> torch.dtype:
    """The dtype labkit runs a weight format in: bf16 for the quantized ones (their prefill chunks run
    float GEMMs of the dequantized weights, fastest in bf16; the fused decode step sums in fp32)."""
    return dtype if weight_format == "dequantized" else torch.bfloat16


def make_llm(path, weight_format: str, dtype, max_num_seqs: int, max_num_batched_tokens: int) -> LLM:
    # No prefix caching: llama.cpp starts every timed run from an empty cache, so labkit does too.
    return LLM(path, device="cpu", dtype=format_dtype(weight_format, dtype), weight_format=weight_format,
               max_num_seqs=max_num_seqs, max_num_batched_tokens=max_num_batched_tokens,
               enable_prefix_caching=False)


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="smollm2", help="a known model name or a .gguf file (both engines read it)")
    parser.add_argument("--formats", nargs="+", choices=WEIGHT_FORMATS, default=list(WEIGHT_FORMATS),
                        help="labkit weight formats to run")
    parser.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32",
                        help="labkit's dtype for the dequantized format (int8 and q4_1 run bf16; "
                             "llama.cpp runs the file's own types)")
    parser.add_argument("--threads", type=int, default=1,
                        help="threads for both (1: CPU-time figures, stable on a shared machine)")
    parser.add_argument("--rounds", type=int, default=3, help="turns each side takes in decode and prompt timing")
    parser.add_argument("--decode-tokens", type=int, default=64)
    parser.add_argument("--prompt-tokens", type=int, default=128, help="prompt length for prompt processing")
    parser.add_argument("--num-requests", type=int, default=64)
    parser.add_argument("--prompt-len", type=int, nargs=2, default=(16, 96))
    parser.add_argument("--output-len", type=int, nargs=2, default=(8, 128))
    parser.add_argument("--max-num-seqs", type=int, default=64, help="sequences in flight, both engines")
    parser.add_argument("--max-batch-tokens", type=int, default=2048, help="tokens per step, both engines")
    parser.add_argument("--kv-unified", action="store_true",
                        help="llama.cpp: one KV buffer shared by all sequences instead of one per sequence")
    parser.add_argument("--agreement-tokens", type=int, default=48)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    if args.threads < 1 or args.rounds < 1:
        parser.error("--threads and --rounds must be >= 1")
    torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)
    path = resolve_model_path(args.model)
    formats = list(dict.fromkeys(args.formats))
    dtype = getattr(torch, args.dtype)

    prompts, outputs = workload(args.num_requests, args.seed, tuple(args.prompt_len), tuple(args.output_len))
    long_prompt = workload(1, args.seed + 1, (args.prompt_tokens,) * 2, (1, 1))[0][0]
    short_prompt = prompts[0][:32]
    per_seq = max(len(p) + n for p, n in zip(prompts, outputs, strict=True))
    single = LlamaCpp(path, args.threads, n_ctx=max(512, args.prompt_tokens + args.decode_tokens + 64),
                      n_batch=max(512, args.prompt_tokens), n_seq_max=1)
    print(f"model {path.name}; {args.threads} thread(s), timed in "
          f"{'CPU' if args.threads == 1 else 'wall-clock'} seconds")
    print(f"llama.cpp (llama-cpp-python {single.lib.__version__}): the file's Q4_1/Q8_0 blocks; "
          f"{single.lib.llama_print_system_info().decode().strip()}")
    for f in formats:
        f_dtype = format_dtype(f, dtype)
        print(f"labkit {f}: {str(f_dtype).removeprefix('torch.')}, {kernels.describe('cpu', f_dtype, f).linear}")
    llms = {f: make_llm(path, f, dtype, args.max_num_seqs, args.max_batch_tokens) for f in formats}
    greedy = lambda n: SamplingParams(temperature=0, max_tokens=n, ignore_eos=True)  # noqa: E731

    # 1. batch-1 decode
    runs = {"llama.cpp": lambda p, n: single.generate(p, n)}
    runs.update({f: (lambda p, n, llm=llm: llm.generate([p], greedy(n))) for f, llm in llms.items()})
    decode = decode_speeds(runs, short_prompt, args.decode_tokens, rounds=args.rounds)
    print(f"batch-1 decode, {len(short_prompt)}-token prompt + {args.decode_tokens} tokens (tok/s): "
          f"llama.cpp {decode['llama.cpp']:.1f}; " + "; ".join(
              f"labkit {f} {decode[f]:.1f} (ratio {decode[f] / decode['llama.cpp']:.2f})" for f in formats))

    # 2. prompt processing
    runs = {"llama.cpp": lambda: single.prefill(long_prompt).argmax()}
    runs.update({f: (lambda llm=llm: llm.generate([long_prompt], greedy(1))) for f, llm in llms.items()})
    best = best_times(runs, args.rounds)
    pp = {name: len(long_prompt) / t for name, t in best.items()}
    print(f"prompt processing, {len(long_prompt)} tokens (tok/s): llama.cpp {pp['llama.cpp']:.1f}; " + "; ".join(
        f"labkit {f} {pp[f]:.1f} (ratio {pp[f] / pp['llama.cpp']:.2f})" for f in formats))

    # 3. the 64-request workload
    total_out = sum(outputs)
    print(f"workload: {len(prompts)} requests, {sum(map(len, prompts))} prompt tokens, {total_out} output tokens, "
          f"up to {args.max_num_seqs} sequences and {args.max_batch_tokens} tokens per step "
          f"(llama.cpp KV {'unified' if args.kv_unified else 'one buffer per sequence'})")
    batched = LlamaCpp(path, args.threads, n_ctx=args.max_num_seqs * per_seq, n_batch=args.max_batch_tokens,
                       n_seq_max=args.max_num_seqs, kv_unified=args.kv_unified)
    batched.run_workload(prompts[:2], outputs[:2], args.max_num_seqs)  # warm-up
    t_llama = time_it(lambda: batched.run_workload(prompts, outputs, args.max_num_seqs))
    batched.close()
    tput = {"llama.cpp": total_out / t_llama}
    params = [greedy(n) for n in outputs]
    for f, llm in llms.items():
        llm.generate(prompts[:2], params[:2])  # warm-up
        tput[f] = total_out / time_it(lambda llm=llm: llm.generate(prompts, params))
    print(f"workload output tok/s: llama.cpp {tput['llama.cpp']:.1f}; " + "; ".join(
        f"labkit {f} {tput[f]:.1f} (ratio {tput[f] / tput['llama.cpp']:.2f})" for f in formats))

    # 4. agreement with llama.cpp on chat prompts, from the same prompt ids: every timed engine, and the
    # quantized formats also in float32, llama.cpp's activation dtype. llama.cpp with its flash attention
    # off, against its default, is the agreement two correct implementations of the model reach.
    tokenizer = next(iter(llms.values())).tokenizer
    name = {f: f"{f} {str(format_dtype(f, dtype)).removeprefix('torch.')}" for f in formats}
    engines = {name[f]: llm for f, llm in llms.items()}
    engines.update({f"{f} float32": LLM(path, device="cpu", dtype=torch.float32, weight_format=f)
                    for f in formats if format_dtype(f, dtype) != torch.float32})
    own = "llama.cpp without flash attention"
    unfused = LlamaCpp(path, args.threads, n_ctx=512, n_batch=512, flash_attention=False)
    prefixes = {e: [] for e in [own, *engines]}  # per prompt: matching prefix, longer output, llama.cpp's gap there
    fp32 = f"dequantized {args.dtype}" if dtype == torch.float32 and "dequantized" in formats else None
    versus_llama = {e: Agreement() for e in [own, *engines]}
    versus_fp32 = {e: Agreement() for e in engines if fp32 and e != fp32}
    chats = [tokenizer.encode(tokenizer.apply_chat_template([{"role": "user", "content": question}],
                                                            add_generation_prompt=True)) for question in CHAT_QUESTIONS]
    for ids in chats:
        reference = single.generate(ids, args.agreement_tokens, stop_at_eos=True)
        reference_logits = single.forced_logits(ids, reference)
        greedy_text = {own: unfused.generate(ids, args.agreement_tokens, stop_at_eos=True)}
        greedy_text.update({e: llm.generate([ids], SamplingParams(temperature=0, max_tokens=args.agreement_tokens))[0]
                           .outputs[0].token_ids for e, llm in engines.items()})
        for e, got in greedy_text.items():
            m = matching_prefix(got, reference)
            margin = top2_margin(single.prefill(ids + reference[:m])) if m < min(len(got), len(reference)) else None
            prefixes[e].append((m, max(len(got), len(reference)), margin))
        forced = {e: forced_logits(llm.model, ids, reference) for e, llm in engines.items()}
        forced[own] = unfused.forced_logits(ids, reference)
        for e, agreement in versus_llama.items():
            agreement.add(reference_logits, forced[e])
            if e in versus_fp32:
                versus_fp32[e].add(forced[fp32], forced[e])
    single.close()
    unfused.close()
    print(f"greedy agreement with llama.cpp on {len(CHAT_QUESTIONS)} chat prompts (matching prefix / tokens per "
          "prompt, and where they part llama.cpp's own gap between its top two logits): " + "; ".join(
              f"{e} {', '.join(agreement_note(*p) for p in prefixes[e])}" for e in prefixes))
    agree = [e for e in engines if all(m == n for m, n, _ in prefixes[e])]
    print(f"labkit engines whose greedy tokens match llama.cpp's on every prompt: {', '.join(agree) or 'none'}")
    as_far = [e for e in engines if all(mine[0] >= theirs[0] for mine, theirs in zip(prefixes[e], prefixes[own],
                                                                                     strict=True))]
    print(f"labkit engines whose greedy tokens follow llama.cpp's at least as far as {own} does, on every prompt: "
          f"{', '.join(as_far) or 'none'}")
    print("along llama.cpp's greedy text, each fed the same tokens, against llama.cpp: " + "; ".join(
        f"{e} {a}" for e, a in versus_llama.items()))
    if versus_fp32:
        print(f"along the same text, against labkit's {fp32} model of the dequantized weights: " + "; ".join(
            f"{e} {a}" for e, a in versus_fp32.items()))
    if "q4_1 float32" in engines and int8_dot.load() is not None:
        worst, layers = stage_differences(path, engines["q4_1 float32"].model, chats[0], args.threads)
        print(f"labkit q4_1 float32, each stage fed llama.cpp's own input to it ({len(chats[0])}-token prompt, "
              f"{layers} layers; largest |difference| from llama.cpp's output, relative to its largest value): "
              + "; ".join(f"{stage} {relative:.1e}" for stage, relative in worst.items()))
    print("batch-1 decode ratio labkit/llama.cpp: " + ", ".join(
        f"{f} {decode[f] / decode['llama.cpp']:.2f}" for f in formats))


if __name__ == "__main__":
    main()
