"""Pre-tokenization: the regex that cuts text into pieces that BPE never merges across.

BPE runs inside each piece, so a pattern decides which tokens can exist at all: with the
GPT-2 pattern no token spans a letter/digit boundary or swallows the space after a word.

The `regex` module follows a newer Unicode version than `tokenizers`' Oniguruma (16.0), so the two
can cut text differently only around characters assigned after Unicode 16.0.
"""

import regex

# GPT-2's pattern (also what `tokenizers`' ByteLevel pre-tokenizer uses): contractions, a run
# of letters / digits / other symbols with at most one leading space, then whitespace runs
# (all but the last space when a word follows, so the word keeps its leading space).
GPT2_PATTERN = r"""'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"""

# GPT-4's (cl100k) pattern: case-insensitive contractions, a letter run may take one leading
# symbol, digits in groups of at most three, newlines kept apart from other whitespace.
GPT4_PATTERN = (
    r"""'(?i:[sdmt]|ll|ve|re)|[^\r\n\p{L}\p{N}]?+\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]++[\r\n]*"""
    r"""|\s*[\r\n]|\s+(?!\S)|\s+"""
)

# SmolLM2 splits every digit off on its own first (`tokenizers`' Digits(individual_digits=True),
# llama.cpp's "smollm" pre-type), then applies the GPT-2 pattern to what is left. This single
# regex does both at once: a digit is its own piece, and a whitespace run that ends right before
# a digit stays whole (in the two-step version that digit was the end of the piece).
SMOLLM2_PATTERN = r"""\p{N}|'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?[^\s\p{L}\p{N}]+|\s+(?![^\s\p{N}])|\s+"""

PATTERNS = {"gpt2": GPT2_PATTERN, "gpt4": GPT4_PATTERN, "smollm2": SMOLLM2_PATTERN}


def resolve_pattern(pattern: str) -> str:
    """A pattern name from PATTERNS, or a regex given as is (which must compile)."""
    if not isinstance(pattern, str):
        raise TypeError(f"pattern must be a name ({', '.join(PATTERNS)}) or a regex string, "
                        f"got {type(pattern).__name__}")
    source = PATTERNS.get(pattern, pattern)
    try:
        regex.compile(source)
    except regex.error as err:
        raise ValueError(f"pattern {pattern!r} is neither a known name ({', '.join(PATTERNS)}) "
                         f"nor a valid regex: {err}") from None
    return source


def pretokenize(text: str, pattern: str = "gpt2") -> list[str]:
    """The pieces `pattern` cuts `text` into; joined back together they give `text` again."""
    return regex.findall(resolve_pattern(pattern), text)
