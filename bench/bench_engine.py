"""labkit's engine against transformers' `generate` on SmolLM2-135M, in one run on this machine.

nano-vLLM's benchmark shape, scaled to a CPU: N requests of random token ids with seeded random
prompt and output lengths in fixed ranges, every request generating exactly its output length
(labkit: ignore_eos; transformers: min_new_tokens = max_new_tokens). transformers runs the same
prompts as one left-padded batch per `--hf-batch` requests, each batch to its longest requested
output; throughput counts only requested tokens for both. Also printed: batch-1 decode speed of
both, and the prefix cache's TTFT gain on a shared-system-prompt workload.

    python bench/bench_engine.py            # ~3 minutes on a 2-core CPU
"""

import argparse
import os
import random
import time

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import torch  # noqa: E402

from labkit.engine import LLM  # noqa: E402
from labkit.model.transformers_oracle import load_transformers_model  # noqa: E402
from labkit.sampling import SamplingParams  # noqa: E402

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


def time_it(fn) -> float:
    """Seconds fn takes. With one torch thread, CPU seconds of this process: on a shared machine the
    wall clock also counts time spent waiting for a core, which says nothing about either library."""
    clock = time.process_time if torch.get_num_threads() == 1 else time.perf_counter
    start = clock()
    fn()
    return clock() - start


def decode_speeds(runs: dict, prompt: list[int], new_tokens: int, rounds: int = 3) -> dict:
    """Batch-1 decode tokens/s of each run: (time for 1 + n tokens - time for 1 token) / n, so the
    prefill cancels out. The runs take turns and each keeps its best time, so a burst of load on a
    shared machine does not land on one of them only."""
    best = {name: [float("inf"), float("inf")] for name in runs}
    for _ in range(rounds):
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


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--num-requests", type=int, default=64)
    parser.add_argument("--prompt-len", type=int, nargs=2, default=(16, 96))
    parser.add_argument("--output-len", type=int, nargs=2, default=(8, 128))
    parser.add_argument("--hf-batch", type=int, default=64, help="transformers batch size (labkit: max_num_seqs)")
    parser.add_argument("--threads", type=int, default=1,
                        help="torch threads for both (1 keeps figures stable on a shared CPU)")
    parser.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32",
                        help="weights and KV cache, the same for both")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)
    dtype = getattr(torch, args.dtype)

    prompts, outputs = workload(args.num_requests, args.seed, tuple(args.prompt_len), tuple(args.output_len))
    total_out = sum(outputs)
    batches = [range(i, min(i + args.hf_batch, len(prompts))) for i in range(0, len(prompts), args.hf_batch)]
    print(f"workload: {len(prompts)} requests, prompt lengths {args.prompt_len[0]}-{args.prompt_len[1]} "
          f"({sum(map(len, prompts))} tokens), output lengths {args.output_len[0]}-{args.output_len[1]} "
          f"({total_out} tokens); SmolLM2-135M {args.dtype} on {torch.get_num_threads()} CPU thread(s), timed in "
          f"{'CPU' if torch.get_num_threads() == 1 else 'wall-clock'} seconds")
    useful = sum(map(len, prompts)) + total_out
    padded = sum(len(b) * (max(len(prompts[i]) for i in b) + max(outputs[i] for i in b)) for b in batches)
    print(f"token positions computed: labkit {useful}, transformers {padded} with padding "
          f"({padded / useful:.2f}x: the ratio to expect if a position cost both the same)")

    llm = LLM("smollm2", device="cpu", dtype=dtype, max_num_seqs=args.hf_batch, max_num_batched_tokens=2048)
    params = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True) for n in outputs]
    llm.generate(prompts[:2], params[:2])  # warm-up
    t_labkit = time_it(lambda: llm.generate(prompts, params))
    tput_labkit = total_out / t_labkit
    print(f"labkit:       {t_labkit:7.1f} s, {tput_labkit:7.1f} output tok/s "
          f"({llm.metrics.num_preemptions} preemptions)")

    hf, _ = load_transformers_model("smollm2", dtype=dtype)
    hf_generate(hf, prompts[:2], 2)  # warm-up
    t_hf = sum(time_it(lambda b=b: hf_generate(hf, [prompts[i] for i in b], max(outputs[i] for i in b)))
               for b in batches)
    tput_hf = total_out / t_hf
    print(f"transformers: {t_hf:7.1f} s, {tput_hf:7.1f} output tok/s")

    prompt = prompts[0][:32]
    labkit_run = lambda p, n: llm.generate([p], SamplingParams(temperature=0, max_tokens=n, ignore_eos=True))  # noqa: E731
    hf_run = lambda p, n: hf_generate(hf, [p], n)  # noqa: E731
    speeds = decode_speeds({"labkit": labkit_run, "transformers": hf_run}, prompt, 64)
    d_labkit, d_hf = speeds["labkit"], speeds["transformers"]
    print(f"batch-1 decode: labkit {d_labkit:.1f} tok/s, transformers {d_hf:.1f} tok/s "
          f"(ratio {d_labkit / d_hf:.2f})")

    cached = LLM(llm.model, tokenizer=llm.tokenizer, enable_prefix_caching=True)
    uncached = LLM(llm.model, tokenizer=llm.tokenizer, enable_prefix_caching=False)
    ttft_on, ttft_off = prefix_ttft(cached), prefix_ttft(uncached)
    n_system = len(llm.tokenizer.encode(SYSTEM_PROMPT))
    print(f"prefix cache, shared {n_system}-token system prompt: mean TTFT {1000 * ttft_on:.1f} ms cached vs "
          f"{1000 * ttft_off:.1f} ms uncached ({ttft_off / ttft_on:.1f}x faster; hit rate "
          f"{cached.metrics.prefix_cache_hit_rate:.0%})")
    print(f"throughput ratio labkit/transformers: {tput_labkit / tput_hf:.2f}")


if __name__ == "__main__":
    main()
