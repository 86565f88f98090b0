"""Encode throughput of labkit's tokenizer against HF `tokenizers`, and BPE training time.

Both encode the same ~1 MB English text (datasets/jargon_file_4.4.7.txt) with SmolLM2's
vocabulary, single-threaded, as one string per line; the best of several runs counts.
Goal: labkit at least 1/3 of HF's speed. Run: `python bench/bench_tokenizer.py`.
"""

import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ["RAYON_NUM_THREADS"] = "1"
os.environ["TOKENIZERS_PARALLELISM"] = "false"

from tokenizers import Tokenizer as HFTokenizer  # noqa: E402
from tokenizers import pre_tokenizers  # noqa: E402
from transformers import AutoTokenizer  # noqa: E402

from labkit.registry import resolve_model_path  # noqa: E402
from labkit.timing import measure  # noqa: E402
from labkit.tokenizer import load_tokenizer, train  # noqa: E402
from labkit_course.data import JARGON_FILE, data_path  # noqa: E402

CORPUS = data_path(JARGON_FILE)


def best_time(runs, fn, reset=None):
    """The fastest of `runs` calls of fn(), each after reset() (not timed), no warm-up; also fn()'s result."""
    results = []
    timing = measure(lambda: results.append(fn()), repeats=runs, warmup=0, setup=reset)
    return timing.best, results[-1]


def smollm2_reference() -> HFTokenizer:
    """SmolLM2's tokenizer in `tokenizers`: built from the GGUF, with its digit-splitting pre-tokenizer."""
    path = resolve_model_path("smollm2")
    hf = HFTokenizer.from_str(AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
                              .backend_tokenizer.to_str())
    hf.pre_tokenizer = pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True),
                                                pre_tokenizers.ByteLevel(add_prefix_space=False)])
    return hf


def main():
    text = CORPUS.read_text(encoding="utf-8")
    megabytes = len(text.encode("utf-8")) / 1e6
    reference, labkit = smollm2_reference(), load_tokenizer("smollm2")
    hf_json = reference.to_str()
    hf = {}

    def fresh_hf():  # a new HF tokenizer: an empty BPE cache, as labkit's after clear()
        hf["tok"] = HFTokenizer.from_str(hf_json)

    print(f"encode {megabytes:.2f} MB of English text with SmolLM2's vocabulary, single thread, best of 3")
    print(f"  {'input':<22}{'cache':<7}{'HF tokenizers':>15}{'labkit':>12}{'labkit / HF':>13}")
    lines = text.splitlines(keepends=True)
    cases = {
        "one 1 MB string": (lambda: hf["tok"].encode(text, add_special_tokens=False).ids,
                            lambda: labkit.encode(text)),
        f"{len(lines):,} lines": (lambda: [i for line in lines for i in hf["tok"].encode(line).ids],
                                  lambda: [i for line in lines for i in labkit.encode(line)]),
    }
    for name, (hf_encode, labkit_encode) in cases.items():
        for cache in ("cold", "warm"):
            hf_reset = fresh_hf if cache == "cold" else None
            labkit_reset = labkit._piece_cache.clear if cache == "cold" else None
            hf_time, hf_ids = best_time(3, hf_encode, hf_reset)
            labkit_time, labkit_ids = best_time(3, labkit_encode, labkit_reset)
            assert labkit_ids == hf_ids, f"labkit and HF disagree on {name}"
            print(f"  {name:<22}{cache:<7}{megabytes / hf_time:>10.2f} MB/s"
                  f"{megabytes / labkit_time:>7.2f} MB/s{hf_time / labkit_time:>13.2f}")
    print("  (ids identical in every case; goal: labkit / HF >= 0.33)")

    seconds, trained = best_time(1, lambda: train(text, 256 + 2000))
    ratio = len(text.encode("utf-8")) / len(trained.encode(text))
    print(f"train 2,000 merges on {megabytes:.2f} MB: {seconds:.1f} s ({ratio:.2f} bytes/token afterwards)")


if __name__ == "__main__":
    main()
