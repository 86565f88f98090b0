"""nano-vLLM's own benchmark (its `bench.py`) on labkit, with transformers' `generate` in the same run.

The workload, exactly as nano-vLLM draws it: `random.seed(0)`; 256 prompts of random token ids in
[0, 10000], each 100-1024 tokens long; then 256 SamplingParams(temperature=0.6, ignore_eos=True,
max_tokens=100-1024). The engine takes 4096-token sequences, 512 at once, 16384 tokens a step
(nano-vLLM's defaults), with CUDA graphs. After a one-prompt warm-up ("Benchmark: "), throughput is
the requested output tokens (133,966 for seed 0) over the wall time of one `generate` call.

The model is Qwen3-0.6B's shape (q/k-norm, head_dim 128, tied embeddings) or SmolLM2-135M's, with
seeded random weights: throughput depends on the shape, not on the values, and no weights can be
fetched on the machine. transformers runs the same model (`transformers_twin`) on the first
`--hf-requests` requests as one left-padded `generate` batch with sampling at the same temperature,
each row generating the batch's longest requested output; its throughput counts requested tokens
only, as labkit's does.

The report places the run on the GPU's roofline: the bytes it must move (every weight once a step,
every cached K/V a step reads) and the FLOPs it must do (labkit_course.roofline's count of each recorded
step), over the measured copy bandwidth and bf16 matmul rate. A host-time breakdown says where the
wall time went (scheduling, preparing inputs, waiting for the GPU, sampling, appending tokens), and
`--profile` adds torch.profiler's top kernels over a short run.

    python bench/bench_nanovllm.py                      # a CUDA machine: -> reports/gpu/<date>-<gpu>-nanovllm.md
    python bench/bench_nanovllm.py --tiny               # anywhere: a scaled-down run (what make check runs)
"""

import argparse
import dataclasses
import datetime
import gc
import os
import platform
import random
import sys
import time
from collections import defaultdict
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import torch  # noqa: E402

from labkit.engine import LLM  # noqa: E402
from labkit.model import layers  # noqa: E402
from labkit.model.config import ModelConfig  # noqa: E402
from labkit.model.random_weights import SMOLLM2_135M, random_model  # noqa: E402
from labkit.model.transformers_oracle import transformers_twin  # noqa: E402
from labkit.sampling import SamplingParams  # noqa: E402
from labkit.timing import measure  # noqa: E402
from labkit.tokenizer import placeholder_tokenizer  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "bench"))  # gpu_check's measurements
# Qwen3-0.6B's config.json, as labkit reads it.
QWEN3_06B = ModelConfig(
    architecture="qwen3", vocab_size=151936, hidden_size=1024, intermediate_size=3072, num_layers=28,
    num_heads=16, num_kv_heads=8, head_dim=128, max_position_embeddings=40960, rms_norm_eps=1e-6,
    rope_theta=1000000.0, tie_word_embeddings=True, bos_token_id=151643, eos_token_id=151645,
)
MODELS = {"qwen3-0.6b": QWEN3_06B, "smollm2-135m": SMOLLM2_135M}


@dataclasses.dataclass(frozen=True)
class Workload:
    """nano-vLLM's bench.py draws (its defaults) and the engine settings it runs them with."""

    num_seqs: int = 256
    input_len: tuple[int, int] = (100, 1024)
    output_len: tuple[int, int] = (100, 1024)
    max_token_id: int = 10000
    max_model_len: int = 4096
    max_num_seqs: int = 512
    max_num_batched_tokens: int = 16384
    temperature: float = 0.6

    def draw(self, seed: int = 0) -> tuple[list[list[int]], list[SamplingParams]]:
        """The prompts, then the sampling params, in the order nano-vLLM's bench.py draws them."""
        random.seed(seed)
        prompts = [[random.randint(0, self.max_token_id) for _ in range(random.randint(*self.input_len))]
                   for _ in range(self.num_seqs)]
        params = [SamplingParams(temperature=self.temperature, ignore_eos=True,
                                 max_tokens=random.randint(*self.output_len)) for _ in range(self.num_seqs)]
        return prompts, params


# --tiny: the same script end to end on a CPU in seconds.
TINY = Workload(num_seqs=12, input_len=(10, 40), output_len=(4, 24), max_token_id=500, max_model_len=128,
                max_num_seqs=8, max_num_batched_tokens=128)


def tiny(config: ModelConfig) -> ModelConfig:
    """A 2-layer model of the same family (a Qwen3 keeps its q/k-norm) for --tiny."""
    return dataclasses.replace(config, vocab_size=512, hidden_size=64, intermediate_size=128, num_layers=2,
                               num_heads=4, num_kv_heads=2, head_dim=32, bos_token_id=None, eos_token_id=None)


class StepTimer:
    """Wall time per phase of the engine's steps, by wrapping the calls each step makes.

    `forward` launches the model (asynchronous on a GPU); `gpu wait` is the synchronize before
    sampling, i.e. the time the host had nothing to do but wait for the GPU; `sample` is the rest of
    sampling (its kernels and the copy of the tokens to the host). With async scheduling a decode step
    only launches its sampling, and `resolve` waits for the tokens of the step before and appends them.
    A call inside another wrapped call counts for its own phase only. What `generate` spends outside
    these calls (appending tokens, stop checks, outputs) is `other`.
    """

    def __init__(self, llm: LLM):
        self.seconds: dict[str, float] = defaultdict(float)
        self.steps: list[tuple[list[int], list[int], int]] = []  # (new tokens, context lengths, rows sampled)
        self._inner: list[float] = []  # per wrapped call in progress: the time its wrapped callees took
        sync = torch.cuda.synchronize if llm.device.type == "cuda" else (lambda: None)
        runner = llm.runner
        self._wrap(llm.scheduler, "schedule", "schedule")  # phases are reported in the order they are wrapped
        forward = self._timed("forward (launch)", runner.forward)
        wait, sample = self._timed("gpu wait", sync), self._timed("sample", runner.sample)

        def recorded_forward(seqs, num_new_tokens, num_scored=None, **kwargs):
            contexts = [seq.num_cached_tokens + n for seq, n in zip(seqs, num_new_tokens, strict=True)]
            out = forward(seqs, num_new_tokens, num_scored, **kwargs)
            self.steps.append((list(num_new_tokens), contexts, len(out.sampled_seqs)))
            return out

        def waited_sample(*args, **kwargs):
            wait()
            return sample(*args, **kwargs)

        runner.forward, runner.sample = recorded_forward, waited_sample
        if llm._overlap is not None:  # overlapped steps sample without waiting, and wait when they resolve
            self._wrap(runner, "sample_on_device", "sample (launch)")
            self._wrap(llm._overlap, "resolve", "resolve (gpu wait, append)")
        self._wrap(llm.scheduler, "postprocess", "postprocess")

    def _timed(self, label: str, fn):
        self.seconds[label] = 0.0

        def timed(*args, **kwargs):
            self._inner.append(0.0)
            start = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                total = time.perf_counter() - start
                self.seconds[label] += total - self._inner.pop()
                if self._inner:
                    self._inner[-1] += total

        return timed

    def _wrap(self, obj, name: str, label: str) -> None:
        setattr(obj, name, self._timed(label, getattr(obj, name)))

    def breakdown(self, wall: float) -> str:
        parts = dict(self.seconds)
        parts["other (append, stop checks, outputs)"] = wall - sum(parts.values())
        return ", ".join(f"{name} {seconds:.2f} s ({seconds / wall:.0%})" for name, seconds in parts.items())


def timed(fn, device: torch.device) -> float:
    """Seconds of one call of fn, to the end of its GPU work."""
    return measure(fn, repeats=1, warmup=0, device=device).median


@dataclasses.dataclass
class EngineRun:
    seconds: float
    tokens: int  # generated, all requests
    steps: list  # StepTimer.steps
    breakdown: str
    preemptions: int
    fast_path: str
    async_scheduling: bool


def run_labkit(model, workload: Workload, prompts, params, use_cuda_graph: bool, async_scheduling: bool) -> EngineRun:
    """One timed `generate` after nano-vLLM's warm-up; the engine (and its KV cache) is gone on return."""
    llm = LLM(model, tokenizer=placeholder_tokenizer(model.config.vocab_size), max_model_len=workload.max_model_len,
              max_num_seqs=workload.max_num_seqs, max_num_batched_tokens=workload.max_num_batched_tokens,
              use_cuda_graph=use_cuda_graph, async_scheduling=async_scheduling)
    llm.generate(["Benchmark: "], SamplingParams())
    timer = StepTimer(llm)
    outputs = []
    seconds = timed(lambda: outputs.extend(llm.generate(prompts, params)), llm.device)
    return EngineRun(seconds, sum(len(o.token_ids) for o in outputs), timer.steps, timer.breakdown(seconds),
                     llm.metrics.num_preemptions, type(llm.runner.fast_path).__name__, async_scheduling)


def free_gpu_memory() -> None:
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


@torch.inference_mode()
def run_transformers(hf, prompts, params, temperature: float, device: torch.device) -> float:
    """Seconds for one left-padded, sampled batch, every row generating the batch's longest output."""
    longest = max(p.max_tokens for p in params)
    width = max(len(p) for p in prompts)
    ids = torch.tensor([[0] * (width - len(p)) + p for p in prompts], device=device)
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts], device=device)
    hf.generate(input_ids=ids[:1, -8:], attention_mask=mask[:1, -8:], max_new_tokens=2, do_sample=True,
                temperature=temperature, top_k=0, pad_token_id=0)  # warm-up
    return timed(lambda: hf.generate(input_ids=ids, attention_mask=mask, max_new_tokens=longest,
                                     min_new_tokens=longest, do_sample=True, temperature=temperature, top_k=0,
                                     pad_token_id=0), device)


def gpu_peaks(device: torch.device) -> tuple[float, float]:
    """(bytes/s of a large device-to-device copy, read + write; bf16 FLOP/s of an 8192^3 matmul)."""
    from gpu_check import copy_bandwidth

    a, b = (torch.randn(8192, 8192, device=device, dtype=torch.bfloat16) for _ in range(2))
    matmul = measure(lambda: a @ b, repeats=5, warmup=1, device=device).best
    return copy_bandwidth(device), 2 * 8192**3 / matmul


def roofline(config: ModelConfig, steps, dtype_bytes: int) -> tuple[float, float]:
    """(bytes moved, FLOPs) the recorded steps need at least (labkit_course.roofline's count per step)."""
    from labkit_course.roofline import engine_step_cost

    costs = [engine_step_cost(config, q, k, scored, dtype_bytes) for q, k, scored in steps]
    return sum(c.bytes_moved for c in costs), sum(c.flops for c in costs)


def profile_lines(model, workload: Workload, prompts, params, tokens: int = 32) -> list[str]:
    """torch.profiler over the workload cut to `tokens` outputs each: the prompts and the first decode
    steps at full batch. Top kernels by GPU time, and how busy the GPU was."""
    from torch.profiler import ProfilerActivity, profile

    llm = LLM(model, tokenizer=placeholder_tokenizer(model.config.vocab_size), max_model_len=workload.max_model_len,
              max_num_seqs=workload.max_num_seqs, max_num_batched_tokens=workload.max_num_batched_tokens)
    short = [dataclasses.replace(p, max_tokens=min(p.max_tokens, tokens)) for p in params]
    llm.generate(prompts[:4], short[:4])
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if llm.device.type == "cuda" else [])
    with profile(activities=activities) as prof:
        wall = timed(lambda: llm.generate(prompts, short), llm.device)
    events = prof.key_averages()
    device_time = sum(e.self_device_time_total for e in events) / 1e6
    table = events.table(sort_by="self_cuda_time_total" if llm.device.type == "cuda" else "self_cpu_time_total",
                         row_limit=25, max_name_column_width=60)
    return [f"- {len(prompts)} requests cut to {tokens} output tokens: {wall:.2f} s under the profiler; "
            f"GPU kernels busy {device_time:.2f} s ({device_time / wall:.0%} of the wall time)", "", "```",
            *table.splitlines(), "```"]


class Report:
    """Lines printed as they come and, on a GPU, the report file rewritten with each: a run cut short by
    a time limit keeps what it measured."""

    def __init__(self, path: Path | None):
        self.path, self.lines = path, []

    def add(self, *lines: str) -> None:
        self.lines += lines
        print("\n".join(lines), flush=True)
        if self.path is not None:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            self.path.write_text("\n".join(self.lines) + "\n", encoding="utf-8")


def report_name(device: torch.device, args) -> str:
    """<date>-<time>-<gpu>-nanovllm-<model>[-nofusion].md: runs of one session never overwrite each other."""
    gpu = "-".join("".join(c if c.isalnum() else " " for c in torch.cuda.get_device_name(device).lower()).split())
    return (f"{datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d-%H%M}-{gpu}-nanovllm-{args.model}"
            f"{'-nofusion' if args.no_fusion else ''}.md")


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python bench/bench_nanovllm.py", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", choices=(*MODELS, "both"), default="both")
    parser.add_argument("--tiny", action="store_true", help="a scaled-down workload and model (runs on a CPU)")
    parser.add_argument("--hf-requests", type=int, default=64,
                        help="requests transformers runs, as one padded batch (0: skip transformers)")
    parser.add_argument("--hf-max-tokens", type=int, default=128,
                        help="transformers' outputs cut to this many tokens (0: the requested lengths; "
                             "a padded batch of 1024-token outputs takes minutes of GPU time)")
    parser.add_argument("--dtype", choices=("bfloat16", "float16", "float32"), default=None,
                        help="default: the engine's dtype on this device")
    parser.add_argument("--no-cuda-graph", action="store_true")
    parser.add_argument("--no-fusion", action="store_true",
                        help="run the element-wise chains op by op (labkit.model.layers.fused_on_gpu), to measure "
                             "what fusing them buys")
    parser.add_argument("--async-scheduling", choices=("off", "on", "both"), default="both",
                        help="run labkit with synchronous steps, overlapped ones (labkit/engine/overlap.py), or both")
    parser.add_argument("--profile", action="store_true", help="add torch.profiler's top kernels over a short run")
    parser.add_argument("--out", type=Path, default=ROOT / "reports" / "gpu", help="folder for the report")
    args = parser.parse_args(argv)

    from labkit.device import default_dtype, describe_device, pick_device

    device = pick_device(None)
    dtype = getattr(torch, args.dtype) if args.dtype else default_dtype(device)
    if device.type != "cuda" and not args.tiny:
        print("no CUDA device: the full benchmark needs a GPU (--tiny runs a scaled-down one here)", file=sys.stderr)
        return 2
    if args.no_fusion:
        layers.fuses = lambda args: False  # what fused_on_gpu asks before compiling
    workload = TINY if args.tiny else Workload()
    prompts, params = workload.draw()
    requested = sum(p.max_tokens for p in params)
    names = list(MODELS) if args.model == "both" else [args.model]
    versions = f"python {platform.python_version()}, torch {torch.__version__} (CUDA {torch.version.cuda})"
    try:
        import transformers
        import triton

        versions += f", triton {triton.__version__}, transformers {transformers.__version__}"
    except ImportError as missing:
        versions += f" ({missing.name} not installed)"
    report = Report(args.out / report_name(device, args) if device.type == "cuda" else None)
    report.add(f"# nano-vLLM's benchmark: {describe_device(device)}", "",
               f"{datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d %H:%M} UTC, `bench/bench_nanovllm.py"
               f"{' ' + ' '.join(argv if argv is not None else sys.argv[1:])}`", "",
               f"- {versions}",
               f"- workload: {len(prompts)} requests, prompts {workload.input_len[0]}-{workload.input_len[1]} tokens "
               f"({sum(map(len, prompts))} in all), outputs {workload.output_len[0]}-{workload.output_len[1]} "
               f"({requested} requested), temperature {workload.temperature}, ignore_eos; engine: max_model_len "
               f"{workload.max_model_len}, max_num_seqs {workload.max_num_seqs}, max_num_batched_tokens "
               f"{workload.max_num_batched_tokens}, {dtype}, CUDA graphs {'off' if args.no_cuda_graph else 'on'}, "
               f"element-wise fusion {'off' if args.no_fusion else 'on'}")
    if device.type == "cuda":
        bandwidth, flops = gpu_peaks(device)
        report.add(f"- this GPU, measured: copy {bandwidth / 1e9:.0f} GB/s (read + write), bf16 matmul "
                   f"{flops / 1e12:.0f} TFLOP/s")
    for name in names:
        config = tiny(MODELS[name]) if args.tiny else MODELS[name]
        model = random_model(config, seed=0, device=device, dtype=dtype)
        report.add("", f"## {name}{' (tiny)' if args.tiny else ''}, random weights (seed 0)", "")
        runs = []
        for overlapped in {"off": [False], "on": [True], "both": [False, True]}[args.async_scheduling]:
            run = run_labkit(model, workload, prompts, params, not args.no_cuda_graph, overlapped)
            free_gpu_memory()
            if run.tokens != requested:
                raise AssertionError(f"labkit generated {run.tokens} tokens, {requested} requested (ignore_eos)")
            report.add(f"- labkit, {'async scheduling' if overlapped else 'synchronous steps'}: {run.seconds:.2f} s, "
                       f"**{requested / run.seconds:.0f} output tok/s** ({len(run.steps)} steps, {run.preemptions} "
                       f"preemptions; fast path: {run.fast_path})",
                       f"- where its wall time went: {run.breakdown}")
            runs.append(run)
        if len(runs) == 2:
            report.add(f"- async scheduling / synchronous steps: {runs[0].seconds / runs[1].seconds:.2f}x")
        run = min(runs, key=lambda r: r.seconds)
        rate = requested / run.seconds
        moved, work = roofline(config, run.steps, dtype.itemsize)
        if device.type == "cuda":
            report.add(f"- roofline of the faster run: the steps must move {moved / 1e9:.0f} GB and do "
                       f"{work / 1e12:.0f} TFLOP: "
                       f"{moved / run.seconds / bandwidth:.0%} of the copy bandwidth, "
                       f"{work / run.seconds / flops:.0%} of the matmul peak, over the whole run")
        if args.profile:
            report.add("", "### Profile", "", *profile_lines(model, workload, prompts, params), "")
            free_gpu_memory()
        if args.hf_requests:
            hf = transformers_twin(model)
            n = min(args.hf_requests, len(prompts))
            cut = [dataclasses.replace(p, max_tokens=min(p.max_tokens, args.hf_max_tokens or p.max_tokens))
                   for p in params[:n]]
            hf_seconds = run_transformers(hf, prompts[:n], cut, workload.temperature, device)
            longest = max(p.max_tokens for p in cut)
            hf_rate = sum(p.max_tokens for p in cut) / hf_seconds
            report.add(f"- transformers generate, the first {n} requests as one padded batch"
                       + (f", outputs cut to {args.hf_max_tokens} tokens (its cost per token grows with the "
                          "context, so the cut flatters it)" if args.hf_max_tokens else "")
                       + f": {hf_seconds:.2f} s for {longest} steps, {hf_rate:.0f} output tok/s",
                       f"- **throughput ratio labkit/transformers: {rate / hf_rate:.1f}** (labkit's faster run: "
                       f"{'async scheduling' if run.async_scheduling else 'synchronous steps'})")
            del hf
            free_gpu_memory()
        del model
        free_gpu_memory()
    if report.path is not None:
        print(f"report written to {report.path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
