"""Import a tokenizer from a GGUF file: tokens, merges, token types, special ids, chat template.

GGUF stores the vocabulary the way `tokenizers` does (GPT-2 printable tokens, "left right"
merge lines). Token type 3 (control) and 4 (user-defined) mark special tokens. The pre-tokenizer
is only named ("tokenizer.ggml.pre"), so the names we know map to our patterns.
"""

from pathlib import Path

from labkit.registry import ModelFileError

from .tokenizer import Tokenizer

# GGUF pre-tokenizer name -> our pattern name (llama.cpp's table, for the names we support).
GGUF_PRE_PATTERNS = {"smollm": "smollm2", "gpt-2": "gpt2", "default": "gpt2"}
SPECIAL_TOKEN_TYPES = {3, 4}  # control, user-defined


def load_gguf_tokenizer(path: str | Path) -> Tokenizer:
    from labkit.model.gguf_loader import open_gguf

    reader = open_gguf(path)
    try:
        return _tokenizer_from_gguf(reader, path)
    except ModelFileError:
        raise
    except (ValueError, IndexError, KeyError, TypeError, OverflowError) as err:  # random bytes as metadata
        raise ModelFileError(f"{path}: bad tokenizer metadata: {type(err).__name__}: {err}") from err


def _tokenizer_from_gguf(reader, path: str | Path) -> Tokenizer:

    def field(name, default=None):
        value = reader.fields.get(name)
        return default if value is None else value.contents()

    model = field("tokenizer.ggml.model")
    if model != "gpt2":
        raise ModelFileError(f"{path}: tokenizer model {model!r} is not byte-level BPE ('gpt2')")
    pre = field("tokenizer.ggml.pre", "default")
    if pre not in GGUF_PRE_PATTERNS:
        raise ModelFileError(f"{path}: unknown pre-tokenizer {pre!r}; known: {sorted(GGUF_PRE_PATTERNS)}")
    tokens = field("tokenizer.ggml.tokens")
    types = field("tokenizer.ggml.token_type")
    kinds = dict(enumerate(types))
    special = {token: i for i, token in enumerate(tokens) if kinds[i] in SPECIAL_TOKEN_TYPES}
    return Tokenizer.from_printable(
        tokens, field("tokenizer.ggml.merges"), GGUF_PRE_PATTERNS[pre], special,
        bos_token_id=field("tokenizer.ggml.bos_token_id"),
        eos_token_id=field("tokenizer.ggml.eos_token_id"),
        add_bos_token=bool(field("tokenizer.ggml.add_bos_token", False)),
        add_eos_token=bool(field("tokenizer.ggml.add_eos_token", False)),
        chat_template=field("tokenizer.chat_template"),
    )
