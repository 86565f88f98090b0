"""`python -m labkit.engine` (`make demo`): SmolLM2 answers a few questions through the engine.

All questions go in as one batch (continuous batching does the rest); the answers are printed in
order, each with its finish reason and timings, then the engine's metrics. Pass your own
questions as arguments, or `--stream` to watch one answer being generated.
"""

import argparse

import torch

from labkit.device import describe_device
from labkit.engine.llm import LLM
from labkit.sampling import SamplingParams

QUESTIONS = [
    "What is the capital of France?",
    "Give me three tips for writing clear code.",
    "Explain in two sentences what a KV cache is.",
    "Write a haiku about the sea.",
]


def main(argv=None):
    parser = argparse.ArgumentParser(prog="python -m labkit.engine", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("questions", nargs="*", help="questions to ask (default: a few examples)")
    parser.add_argument("--model", default="smollm2", help="a model name, a .gguf file or an HF folder")
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--temperature", type=float, default=0.0, help="0 = greedy")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--stream", action="store_true", help="stream the answer to the first question")
    args = parser.parse_args(argv)

    llm = LLM(args.model)
    print(f"{args.model} on {describe_device(llm.device)}, {llm.model.dtype}; KV cache: "
          f"{llm.block_manager.num_blocks} blocks of {llm.block_manager.block_size} tokens\n")
    params = SamplingParams(temperature=args.temperature, max_tokens=args.max_tokens, seed=args.seed)
    questions = args.questions or QUESTIONS
    if args.stream:
        print(f"> {questions[0]}")
        for piece in llm.stream(llm.tokenizer.apply_chat_template(
                [{"role": "user", "content": questions[0]}], add_generation_prompt=True), params):
            print(piece, end="", flush=True)
        print("\n")
    else:
        outputs = llm.chat([[{"role": "user", "content": q}] for q in questions], params)
        for question, out in zip(questions, outputs, strict=True):
            m = out.metrics
            tpot = "n/a" if m.tpot is None else f"{1000 * m.tpot:.0f} ms"
            print(f"> {question}\n{out.text.strip()}\n  [{len(out.token_ids)} tokens, {out.finish_reason}; "
                  f"TTFT {1000 * m.ttft:.0f} ms, TPOT {tpot}]\n")
    print(llm.metrics.summary())


if __name__ == "__main__":
    with torch.inference_mode():
        main()
