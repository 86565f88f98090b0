"""labkit's engine against transformers' `generate` on SmolLM2-135M, in one run on this machine.

nano-vLLM's benchmark shape, scaled to a CPU: N requests of random token ids with seeded random
prompt and output lengths in fixed ranges, every request generating exactly its output length
(labkit: ignore_eos; transformers: min_new_tokens = max_new_tokens). transformers runs the same
prompts as one left-padded batch per `--hf-batch` requests, each batch to its longest requested
output; throughput counts only requested tokens for both, in bf16 and then fp32 (the last line),
each the best of two rounds taken in turns.

Each run is also placed on this machine's roofline, measured at start: the best GEMM rate per dtype
on the model's own matrix shapes (torch's default GEMM or oneDNN's prepacked one, whichever is
faster) and the streaming read bandwidth. A step's floor is max(FLOPs / peak, bytes / bandwidth),
counted from its shape (labkit_course.roofline.engine_step_cost); the fraction printed is the sum of the
floors over the engine's measured time. Also printed: the kernels chosen for this CPU, batch-1
decode of every weight format against transformers, and the prefix cache's TTFT gain.

    python bench/bench_engine.py            # ~10 minutes on a 2-core CPU
"""

import argparse
import os
import random
import time
from functools import partial

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import torch  # noqa: E402

from labkit import kernels  # noqa: E402
from labkit.engine import LLM  # noqa: E402
from labkit.kernels import gemm  # noqa: E402
from labkit.model import load_config  # noqa: E402
from labkit.model.fused_decode import FusedDecoder  # noqa: E402
from labkit.model.packed_linear import PackedBf16Linear, PackedF32Linear  # noqa: E402
from labkit.model.transformers_oracle import load_transformers_model  # noqa: E402
from labkit.model.weight_formats import PrepackedLinear  # noqa: E402
from labkit.sampling import SamplingParams  # noqa: E402
from labkit.timing import measure  # noqa: E402
from labkit_course.roofline import engine_step_cost, measure_read_bandwidth  # noqa: E402

SYSTEM_PROMPT = (
    "You are a careful assistant for a course on LLM inference engines. Answer in one short paragraph. "
    "Prefer concrete numbers, name the data structure involved (block table, slot mapping, KV cache, "
    "scheduler queue), say what is computed once and what is reused, and never invent an API. "
    "If a question is ambiguous, state the assumption you make before answering it. "
) * 3
QUESTIONS = ["What is a KV cache?", "Why do blocks help?", "What does the scheduler do?", "What is TTFT?",
             "Why is decode memory-bound?", "What is prefix caching?", "What is preemption?",
             "What is chunked prefill?"]


def workload(n: int, seed: int, prompt_lens: tuple[int, int], output_lens: tuple[int, int]):
    rng = random.Random(seed)
    prompts = [[rng.randint(100, 10000) for _ in range(rng.randint(*prompt_lens))] for _ in range(n)]
    outputs = [rng.randint(*output_lens) for _ in range(n)]
    return prompts, outputs


@torch.inference_mode()
def hf_generate(hf, prompts: list[list[int]], max_new: int) -> None:
    """One left-padded batch, every row generating exactly max_new tokens."""
    width = max(len(p) for p in prompts)
    pad = 0
    ids = torch.tensor([[pad] * (width - len(p)) + p for p in prompts], device=hf.device)
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts], device=hf.device)
    hf.generate(input_ids=ids, attention_mask=mask, max_new_tokens=max_new, min_new_tokens=max_new,
                do_sample=False, pad_token_id=pad)


def time_it(fn, repeats: int = 1, warmup: int = 0) -> float:
    """fn's best seconds over `repeats` calls after `warmup` untimed ones (labkit.timing.measure). With
    one torch thread, CPU seconds of this process: on a shared machine the wall clock also counts time
    spent waiting for a core, which says nothing about either library."""
    clock = time.process_time if torch.get_num_threads() == 1 else time.perf_counter
    return measure(fn, repeats, warmup, clock=clock).best


def decode_speeds(runs: dict, prompt: list[int], new_tokens: int, rounds: int = 3) -> dict:
    """Batch-1 decode tokens/s of each run: (time for 1 + n tokens - time for 1 token) / n, so the
    prefill cancels out. The runs take turns and each keeps its best time, so a burst of load on a
    shared machine does not land on one of them only."""
    best = {name: [float("inf"), float("inf")] for name in runs}
    for _ in range(rounds):  # one timed call of each run a round, not time_it's repeats: the turns matter
        for name, run in runs.items():
            for i, n in enumerate((1, 1 + new_tokens)):
                best[name][i] = min(best[name][i], time_it(lambda run=run, n=n: run(prompt, n)))
    return {name: new_tokens / (tn - t1) for name, (t1, tn) in best.items()}


def prefix_ttft(llm: LLM) -> float:
    """Mean TTFT over the questions, sent one at a time after a warm-up request."""
    greedy1 = SamplingParams(temperature=0, max_tokens=1)
    llm.chat([{"role": "system", "content": SYSTEM_PROMPT}, {"role": "user", "content": "Hi"}], greedy1)
    ttfts = []
    for q in QUESTIONS:
        out = llm.chat([{"role": "system", "content": SYSTEM_PROMPT}, {"role": "user", "content": q}], greedy1)
        ttfts.append(out[0].metrics.ttft)
    return sum(ttfts) / len(ttfts)


def gemm_peak(config, dtype: torch.dtype, rows: int = 512, repeats: int = 15) -> float:
    """The best FLOP/s this machine reaches on the model's weight shapes [rows, in] x [in, out], over
    torch's default GEMM and the engine's own where it has one: oneDNN's prepacked bf16 (CPUs with
    native bf16), the packed C bf16 GEMM (AMX or AVX512-BF16) and the packed C fp32 GEMM (AVX-512).
    Best of `repeats`: a call of AMX's oneDNN bf16 GEMM took either ~0.28 or ~0.6 ms here, and
    best-of-5 missed the fast one about half the time."""
    c = config
    shapes = {(c.hidden_size, c.num_heads * c.head_dim), (c.hidden_size, c.num_kv_heads * c.head_dim),
              (c.hidden_size, c.intermediate_size), (c.intermediate_size, c.hidden_size),
              (c.hidden_size, c.vocab_size)}
    best = 0.0
    for k, n in sorted(shapes):
        x, linear = torch.randn(rows, k, dtype=dtype), torch.nn.Linear(k, n, bias=False, dtype=dtype)
        calls = [linear]
        if dtype == torch.bfloat16 and gemm.prepacks_bf16():
            calls.append(PrepackedLinear(linear))
        if dtype == torch.bfloat16 and gemm.load_bf16() is not None:
            calls.append(PackedBf16Linear(linear))
        if dtype == torch.float32 and gemm.f32_serves_this_cpu():
            calls.append(PackedF32Linear(linear))
        for call in calls:
            seconds = time_it(partial(call, x), repeats, warmup=1)
            best = max(best, 2 * rows * k * n / seconds)
    return best


class StepRecorder:
    """Stands in for the engine's `runner.forward` and notes each step's shape for the roofline."""

    def __init__(self, runner):
        self.forward, self.steps = runner.forward, []

    def __call__(self, seqs, num_new_tokens, num_scored=None):
        k_lens = [seq.num_cached_tokens + n for seq, n in zip(seqs, num_new_tokens, strict=True)]
        out = self.forward(seqs, num_new_tokens, num_scored)
        self.steps.append((list(num_new_tokens), k_lens, len(out.logits) if out.logits is not None else 0))
        return out


def roofline_seconds(config, steps, dtype_bytes: int, peak: float, bandwidth: float) -> float:
    """The machine's floor for these steps: each costs max(FLOPs / peak, bytes / bandwidth)."""
    costs = (engine_step_cost(config, q, k, scored, dtype_bytes) for q, k, scored in steps)
    return sum(max(cost.flops / peak, cost.bytes_moved / bandwidth) for cost in costs)


def hf_batches(num_requests: int, size: int) -> list[range]:
    return [range(i, min(i + size, num_requests)) for i in range(0, num_requests, size)]


def throughput(dtype, args, prompts, outputs, machine):
    """labkit and transformers on the workload in one dtype: (labkit/transformers, labkit's engine,
    transformers' model), the two reused by the batch-1 and prefix-cache figures. The two take turns
    for `args.rounds` rounds and each keeps its best time, so that a burst of load on the shared
    machine (which moved transformers' fp32 time between 66 and 84 s from run to run) does not land
    on one side only. The prefix cache is off: the rounds repeat the same prompts, which it would
    serve from the previous round's blocks."""
    name = str(dtype).removeprefix("torch.")
    total_out = sum(outputs)
    batches = hf_batches(len(prompts), args.hf_batch)
    llm = LLM("smollm2", device="cpu", dtype=dtype, max_num_seqs=args.hf_batch, max_num_batched_tokens=2048,
              enable_prefix_caching=False)
    params = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True) for n in outputs]
    llm.generate(prompts[:2], params[:2])  # warm-up
    hf, _ = load_transformers_model("smollm2", dtype=dtype)
    hf_generate(hf, prompts[:2], 2)  # warm-up
    t_labkit = t_hf = float("inf")
    for _ in range(args.rounds):  # one timed call of each side a round, not time_it's repeats: the turns matter
        recorder = llm.runner.forward = StepRecorder(llm.runner)
        t_labkit = min(t_labkit, time_it(lambda: llm.generate(prompts, params)))
        del llm.runner.forward
        t_hf = min(t_hf, sum(time_it(lambda b=b: hf_generate(hf, [prompts[i] for i in b], max(outputs[i] for i in b)))
                             for b in batches))
    floor = roofline_seconds(llm.model.config, recorder.steps, dtype.itemsize, machine[dtype], machine["bandwidth"])
    print(f"{name} labkit:       {t_labkit:7.1f} s, {total_out / t_labkit:7.1f} output tok/s "
          f"({llm.metrics.num_preemptions} preemptions, {len(recorder.steps)} steps); roofline floor {floor:.1f} s: "
          f"{floor / t_labkit:.0%} of the roofline")
    print(f"{name} transformers: {t_hf:7.1f} s, {total_out / t_hf:7.1f} output tok/s; "
          f"labkit/transformers {t_hf / t_labkit:.2f}")
    return t_hf / t_labkit, llm, hf


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--num-requests", type=int, default=64)
    parser.add_argument("--prompt-len", type=int, nargs=2, default=(16, 96))
    parser.add_argument("--output-len", type=int, nargs=2, default=(8, 128))
    parser.add_argument("--hf-batch", type=int, default=64, help="transformers batch size (labkit: max_num_seqs)")
    parser.add_argument("--threads", type=int, default=1,
                        help="torch threads for both (1 keeps figures stable on a shared CPU)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--rounds", type=int, default=2,
                        help="timed rounds of the workload per library and dtype, the best kept")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)
    config = load_config("smollm2")

    prompts, outputs = workload(args.num_requests, args.seed, tuple(args.prompt_len), tuple(args.output_len))
    print(f"workload: {len(prompts)} requests, prompt lengths {args.prompt_len[0]}-{args.prompt_len[1]} "
          f"({sum(map(len, prompts))} tokens), output lengths {args.output_len[0]}-{args.output_len[1]} "
          f"({sum(outputs)} tokens); SmolLM2-135M on {torch.get_num_threads()} CPU thread(s), timed in "
          f"{'CPU' if torch.get_num_threads() == 1 else 'wall-clock'} seconds")
    useful = sum(map(len, prompts)) + sum(outputs)
    padded = sum(len(b) * (max(len(prompts[i]) for i in b) + max(outputs[i] for i in b))
                 for b in hf_batches(len(prompts), args.hf_batch))
    print(f"token positions computed: labkit {useful}, transformers {padded} with padding "
          f"({padded / useful:.2f}x: the ratio to expect if a position cost both the same)")
    fp32, bf16 = (kernels.describe("cpu", dtype) for dtype in (torch.float32, torch.bfloat16))
    print(f"CPU: {fp32.cpu}; linear kernels: fp32 {fp32.linear}, bf16 {bf16.linear}; decode attention: "
          f"{fp32.attention}; fused step: fp32 {fp32.fused_step}, bf16 {bf16.fused_step}")
    # Twice over, the best kept: the first sweep of a fresh process measured up to 15% low (a core
    # still ramping its clock), which would flatter every fraction of the roofline printed below.
    machine = {dtype: max(gemm_peak(config, dtype) for _ in range(2)) for dtype in (torch.float32, torch.bfloat16)}
    machine["bandwidth"] = measure_read_bandwidth()
    print(f"roofline of this machine: GEMM peak on the model's shapes fp32 {machine[torch.float32] / 1e9:.0f} "
          f"GFLOP/s, bf16 {machine[torch.bfloat16] / 1e9:.0f} GFLOP/s; streaming read "
          f"{machine['bandwidth'] / 1e9:.1f} GB/s")

    throughput(torch.bfloat16, args, prompts, outputs, machine)
    ratio, llm, hf = throughput(torch.float32, args, prompts, outputs, machine)

    # Batch-1 decode of every weight format; the bandwidth bound is the bytes a step reads / bandwidth.
    engines = {("dequantized", torch.float32): llm}
    for fmt in ("int8", "q4_1"):
        engines[(fmt, torch.bfloat16)] = LLM("smollm2", device="cpu", weight_format=fmt)
    runs = {"transformers": lambda p, n: hf_generate(hf, [p], n)}
    for key, engine in engines.items():
        runs[key] = lambda p, n, e=engine: e.generate([p], SamplingParams(temperature=0, max_tokens=n,
                                                                        ignore_eos=True))
    speeds = decode_speeds(runs, prompts[0][:32], 64)
    for (fmt, dtype), engine in engines.items():
        speed, read, linear = speeds[(fmt, dtype)], decode_bytes(engine), kernels.describe("cpu", dtype, fmt).linear
        print(f"batch-1 decode labkit {fmt} {str(dtype).removeprefix('torch.')}: {speed:6.1f} tok/s "
              f"({speed / speeds['transformers']:.2f}x transformers fp32; {read / 1e6:.0f} MB read a token, "
              f"{speed * read / machine['bandwidth']:.0%} of the bandwidth bound; {linear}; "
              f"{'fused C decode step' if isinstance(engine.runner.fast_path, FusedDecoder) else 'eager decode'})")
    print(f"batch-1 decode transformers fp32: {speeds['transformers']:6.1f} tok/s")

    cached = LLM(llm.model, tokenizer=llm.tokenizer, enable_prefix_caching=True)
    uncached = LLM(llm.model, tokenizer=llm.tokenizer, enable_prefix_caching=False)
    ttft_on, ttft_off = prefix_ttft(cached), prefix_ttft(uncached)
    n_system = len(llm.tokenizer.encode(SYSTEM_PROMPT))
    print(f"prefix cache, shared {n_system}-token system prompt: mean TTFT {1000 * ttft_on:.1f} ms cached vs "
          f"{1000 * ttft_off:.1f} ms uncached ({ttft_off / ttft_on:.1f}x faster; hit rate "
          f"{cached.metrics.prefix_cache_hit_rate:.0%})")
    print(f"throughput ratio labkit/transformers: {ratio:.2f}")


def decode_bytes(llm: LLM) -> int:
    """Bytes a batch-1 decode step reads at least: every weight once, in the layout its kernel reads
    (the C int8 dot kernel's packed codes and scales live outside the module's buffers). The embedding
    table counts only when the LM head multiplies by it (tied); a lookup alone reads one row of it."""
    model = llm.model
    embedding = model.embed_tokens.weight
    tied = getattr(model.lm_head, "weight", None) is embedding
    tensors = [*model.parameters(), *model.buffers()]  # parameters() lists a tied weight once
    tensors += [t for module in model.modules() if getattr(module, "native", None) for t in module.native.tensors]
    return sum(t.numel() * t.element_size() for t in tensors if tied or t is not embedding)


if __name__ == "__main__":
    main()
