"""labkit.tokenizer: byte-level BPE that reproduces SmolLM2's tokenizer, and trains small ones.

    tok = load_tokenizer("smollm2")          # or a GGUF path, a Hugging Face folder, or a Tokenizer.save file
    tok.encode("The capital of France is")   # -> [504, 3575, 282, 4649, 314]
"""

from pathlib import Path

from .bpe import apply_merges, merge_pair, pair_counts, train_merges
from .pretokenize import PATTERNS, pretokenize
from .streaming import IncrementalDetokenizer
from .tokenizer import Tokenizer, placeholder_tokenizer, train

__all__ = ["PATTERNS", "IncrementalDetokenizer", "Tokenizer", "apply_merges", "load_tokenizer", "merge_pair",
           "pair_counts", "placeholder_tokenizer", "pretokenize", "train", "train_merges"]


def load_tokenizer(name_or_path: str | Path = "smollm2") -> Tokenizer:
    """A model's tokenizer: a known model name, a GGUF file, a Hugging Face folder (its tokenizer.json),
    or a saved labkit tokenizer (.json)."""
    from labkit.registry import resolve_model_path

    from .gguf_vocab import load_gguf_tokenizer
    from .hf_folder import load_hf_tokenizer

    path = resolve_model_path(name_or_path)
    if path.suffix == ".json":
        return Tokenizer.load(path)
    if path.is_dir():
        return load_hf_tokenizer(path)
    return load_gguf_tokenizer(path)
