"""SmolLM2 on this machine: load time and greedy decode speed, labkit against transformers.

Both read the same GGUF file and run in fp32 on the CPU; figures are ratios measured in one run.
The course's target: labkit loads SmolLM2 in under 15 s.
"""

import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch  # noqa: E402

from labkit.cache import PreallocatedKVCache  # noqa: E402
from labkit.model import generate, load_model  # noqa: E402
from labkit.model.transformers_oracle import load_transformers_model  # noqa: E402
from labkit.timing import measure  # noqa: E402

NEW_TOKENS = 32


def timed(fn):
    """fn()'s result and the seconds of that one call: a first load or generate, no warm-up."""
    results = []
    seconds = measure(lambda: results.append(fn()), repeats=1, warmup=0).best
    return results[0], seconds


def main():
    torch.manual_seed(0)
    model, labkit_load = timed(lambda: load_model("smollm2", device="cpu"))
    (hf, _), hf_load = timed(lambda: load_transformers_model("smollm2"))
    print(f"load SmolLM2 (GGUF -> fp32): labkit {labkit_load:.1f} s, transformers {hf_load:.1f} s "
          f"(ratio {labkit_load / hf_load:.2f}; target: labkit < 15 s -> {'met' if labkit_load < 15 else 'MISSED'})")

    prompt = list(range(100, 132))
    cache = PreallocatedKVCache.for_model(model, max_seq_len=len(prompt) + NEW_TOKENS)
    ours, t_ours = timed(lambda: generate(model, prompt, NEW_TOKENS, kv_cache=cache))
    with torch.no_grad():
        theirs, t_hf = timed(lambda: hf.generate(torch.tensor([prompt]), max_new_tokens=NEW_TOKENS, do_sample=False,
                                                 min_new_tokens=NEW_TOKENS))
    _, t_nocache = timed(lambda: generate(model, prompt, NEW_TOKENS))
    same = ours.tolist() == theirs[0, len(prompt):].tolist()
    print(f"greedy, {len(prompt)}-token prompt + {NEW_TOKENS} new tokens: labkit+KV cache "
          f"{1000 * t_ours / NEW_TOKENS:.0f} ms/token, transformers {1000 * t_hf / NEW_TOKENS:.0f} ms/token "
          f"(ratio {t_ours / t_hf:.2f}), labkit without cache {1000 * t_nocache / NEW_TOKENS:.0f} ms/token; "
          f"same tokens: {same}")


if __name__ == "__main__":
    main()
