"""`python -m labkit.engine` (`make demo`): SmolLM2 answers a few questions through the engine.

All questions go in as one batch (continuous batching does the rest); the answers are printed in
order, each with its finish reason and timings, then the engine's metrics. Pass your own
questions as arguments, or `--stream` to watch one answer being generated.
"""

import argparse
import time

QUESTIONS = [
    "What is the capital of France?",
    "Give me three tips for writing clear code.",
    "Explain in two sentences what a KV cache is.",
    "Write a haiku about the sea.",
]


class _HelpFormatter(argparse.ArgumentDefaultsHelpFormatter, argparse.RawDescriptionHelpFormatter):
    """Every option shows its default; the description keeps its line breaks."""


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m labkit.engine", description=__doc__,
                                     formatter_class=_HelpFormatter)
    parser.add_argument("questions", nargs="*", default=QUESTIONS, help="questions to ask")
    parser.add_argument("--model", default="smollm2", help="a model name, a .gguf file or an HF folder")
    parser.add_argument("--max-tokens", type=int, default=64, help="most tokens generated per answer")
    parser.add_argument("--temperature", type=float, default=0.0, help="sampling temperature; 0 = greedy")
    parser.add_argument("--seed", type=int, default=0, help="sampling seed (used when temperature > 0)")
    parser.add_argument("--stream", action="store_true", help="stream the answer to the first question")
    parser.add_argument("--dtype", choices=("auto", "float32", "bfloat16", "float16"), default="auto",
                        help="weights and activations; auto: fp32 on a CPU, bf16/fp16 on a GPU")
    parser.add_argument("--weight-format", choices=("dequantized", "int8", "q4_1"), default="dequantized",
                        help="q4_1: the GGUF's own 4-bit weights; int8: per-row int8 (both bf16, CPU only)")
    return parser.parse_args(argv)


def main(argv=None):
    args = parse_args(argv)  # before torch is imported, so --help and mistakes answer at once
    print(f"loading {'SmolLM2-135M-Instruct' if args.model == 'smollm2' else args.model}… "
          "(importing torch, reading the weights)", flush=True)
    start = time.perf_counter()
    import torch

    from labkit.device import describe_device
    from labkit.engine.llm import LLM
    from labkit.sampling import SamplingParams

    llm = LLM(args.model, dtype=None if args.dtype == "auto" else getattr(torch, args.dtype),
              weight_format=args.weight_format)
    print(f"loaded in {time.perf_counter() - start:.1f} s: {describe_device(llm.device)}, {llm.model.dtype}; "
          f"KV cache: {llm.block_manager.num_blocks} blocks of {llm.block_manager.block_size} tokens\n", flush=True)
    params = SamplingParams(temperature=args.temperature, max_tokens=args.max_tokens, seed=args.seed)
    questions = args.questions
    if args.stream:
        print(f"> {questions[0]}")
        for piece in llm.stream(llm.tokenizer.apply_chat_template(
                [{"role": "user", "content": questions[0]}], add_generation_prompt=True), params):
            print(piece, end="", flush=True)
        print("\n")
    else:
        print(f"generating {len(questions)} answer{'s' * (len(questions) > 1)} as one batch…", flush=True)
        outputs = llm.chat([[{"role": "user", "content": q}] for q in questions], params, use_tqdm=True)
        for question, out in zip(questions, outputs, strict=True):
            m = out.metrics
            tpot = "n/a" if m.tpot is None else f"{1000 * m.tpot:.0f} ms"
            print(f"> {question}\n{out.text.strip()}\n  [{len(out.token_ids)} tokens, {out.finish_reason}; "
                  f"TTFT {1000 * m.ttft:.0f} ms, TPOT {tpot}]\n")
    print(llm.metrics.summary())


if __name__ == "__main__":
    main()
