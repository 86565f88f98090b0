"""The Tokenizer: text <-> token ids with a byte-level BPE vocabulary, plus training one.

Special tokens (e.g. SmolLM2's <|im_start|>) are whole tokens that BPE never produces. By
default `encode` turns their literal text into their ids, as transformers does, so an encoded
chat-template prompt gets the control tokens the model was trained on. Text from an untrusted
source can be encoded with `allowed_special="none"`: then "<|im_end|>" in it is ordinary text
(several ordinary tokens) and cannot close a turn. A set of names allows just those.
"""

import json
import operator
import unicodedata
from collections import Counter
from collections.abc import Collection, Iterable
from pathlib import Path

import regex

from .bpe import Pair, apply_merges, learned_vocab, train_merges
from .byte_level import bytes_to_printable, printable_to_bytes
from .chat_template import render_chat_template
from .pretokenize import resolve_pattern

SAVE_FORMAT = "labkit-bpe-1"
_PIECE_CACHE_LIMIT = 200_000


class Tokenizer:
    """Byte-level BPE: a regex pre-tokenizer, merges applied in rank order, special tokens.

    vocab[i] is the bytes of token i (for a special token, its text in UTF-8); merges lists the
    merged pairs of ids in the order they were learned.
    """

    def __init__(self, vocab: list[bytes], merges: list[Pair], pattern: str = "gpt2",
                 special_tokens: dict[str, int] | None = None, bos_token_id: int | None = None,
                 eos_token_id: int | None = None, add_bos_token: bool = False,
                 add_eos_token: bool = False, chat_template: str | None = None, normalization: str | None = None):
        if normalization not in (None, "NFC"):
            raise ValueError(f"normalization must be None or 'NFC', got {normalization!r}")
        self.normalization = normalization  # Qwen's tokenizers compose characters (NFC) before anything else
        self.vocab = list(vocab)
        self.pattern = resolve_pattern(pattern)
        self._regex = regex.compile(self.pattern)
        self.special_tokens = dict(special_tokens or {})
        for name, token_id in self.special_tokens.items():
            self._check_id(token_id, f"special token {name!r}")
        self._special_ids = frozenset(self.special_tokens.values())
        self.bos_token_id = None if bos_token_id is None else self._check_id(bos_token_id, "bos_token_id")
        self.eos_token_id = None if eos_token_id is None else self._check_id(eos_token_id, "eos_token_id")
        self.add_bos_token, self.add_eos_token = add_bos_token, add_eos_token
        self.chat_template = chat_template

        ids_by_bytes = {data: i for i, data in enumerate(self.vocab) if i not in self._special_ids}
        # A vocabulary may lack a few bytes: SmolLM2 has no token for 6 ASCII control characters,
        # for 13 byte values that never occur in UTF-8, nor for 0xF1/0xF2 (which start only code
        # points in the unassigned planes 4-11). Like `tokenizers` without an unknown token,
        # encoding drops such bytes; they are listed in `missing_bytes`.
        self._byte_ids = [ids_by_bytes.get(bytes([b])) for b in range(256)]
        self.missing_bytes = bytes(b for b in range(256) if self._byte_ids[b] is None)
        self.merges = [tuple(pair) for pair in merges]
        self._merge_ranks: dict[Pair, tuple[int, int]] = {}
        for rank, (first, second) in enumerate(self.merges):
            first, second = self._check_id(first, f"merge {rank}"), self._check_id(second, f"merge {rank}")
            merged = ids_by_bytes.get(self.vocab[first] + self.vocab[second])
            if merged is None:
                raise ValueError(f"merge {rank} {(first, second)} makes a token that is not in the vocab")
            self._merge_ranks[(first, second)] = (rank, merged)
        self._special_splitters: dict[frozenset, regex.Pattern | None] = {}
        self._piece_cache: dict[str, list[int]] = {}

    # ---- encoding -------------------------------------------------------------------------
    def encode(self, text: str, add_special_tokens: bool = False,
               allowed_special: str | Collection[str] = "all") -> list[int]:
        """Token ids of `text`. add_special_tokens adds BOS/EOS where the vocabulary asks for them
        (SmolLM2 asks for neither). allowed_special: "all", "none", or a set of special-token
        strings whose literal text becomes their id; other text is encoded as ordinary bytes."""
        if not isinstance(text, str):
            raise TypeError(f"text must be a str, got {type(text).__name__}")
        if self.normalization:
            text = unicodedata.normalize(self.normalization, text)
        ids = []
        if add_special_tokens and self.add_bos_token and self.bos_token_id is not None:
            ids.append(self.bos_token_id)
        splitter = self._special_splitter(allowed_special)
        chunks = splitter.split(text) if splitter is not None else [text]
        for index, chunk in enumerate(chunks):
            if index % 2:  # split() with a capture group alternates text, special, text, ...
                ids.append(self.special_tokens[chunk])
            elif chunk:
                for piece in self._regex.findall(chunk):
                    ids.extend(self.encode_piece(piece))
        if add_special_tokens and self.add_eos_token and self.eos_token_id is not None:
            ids.append(self.eos_token_id)
        return ids

    def encode_piece(self, piece: str) -> list[int]:
        """The ids of one pre-tokenized piece: its bytes merged by rank (apply_merges), cached per piece."""
        ids = self._piece_cache.get(piece)
        if ids is None:
            byte_ids = self._byte_ids
            ids = [byte_ids[b] for b in piece.encode("utf-8")]
            if self.missing_bytes:
                ids = [i for i in ids if i is not None]
            ids = apply_merges(ids, self._merge_ranks)
            if len(self._piece_cache) >= _PIECE_CACHE_LIMIT:
                self._piece_cache.clear()
            self._piece_cache[piece] = ids
        return ids

    def _special_splitter(self, allowed_special) -> regex.Pattern | None:
        if allowed_special == "all":
            allowed = frozenset(self.special_tokens)
        elif allowed_special == "none":
            allowed = frozenset()
        elif isinstance(allowed_special, str) or not isinstance(allowed_special, Iterable):
            raise ValueError(f'allowed_special must be "all", "none" or a set of special tokens, '
                             f"got {allowed_special!r}")
        else:
            allowed = frozenset(allowed_special)
            unknown = sorted(allowed - self.special_tokens.keys())
            if unknown:
                raise ValueError(f"allowed_special names unknown special tokens {unknown}; "
                                 f"known: {sorted(self.special_tokens)}")
        if allowed not in self._special_splitters:
            # Longest first, so that of two specials where one is a prefix the longer one wins.
            alternatives = "|".join(regex.escape(s) for s in sorted(allowed, key=len, reverse=True))
            self._special_splitters[allowed] = regex.compile(f"({alternatives})") if allowed else None
        return self._special_splitters[allowed]

    # ---- decoding -------------------------------------------------------------------------
    def decode_bytes(self, ids: Iterable[int], skip_special_tokens: bool = False) -> bytes:
        """The raw bytes of `ids` (a token may end in the middle of a UTF-8 character)."""
        checked = self._check_ids(ids)
        if skip_special_tokens:
            checked = [i for i in checked if i not in self._special_ids]
        vocab = self.vocab
        return b"".join([vocab[i] for i in checked])

    def decode(self, ids: Iterable[int], skip_special_tokens: bool = False) -> str:
        """The text of `ids`; bytes that do not form valid UTF-8 become U+FFFD."""
        return self.decode_bytes(ids, skip_special_tokens).decode("utf-8", errors="replace")

    def _check_ids(self, ids) -> list[int]:
        if isinstance(ids, (str, bytes)) or not isinstance(ids, Iterable):
            raise TypeError(f"ids must be a sequence of ints, got {type(ids).__name__}")
        return [self._check_id(i) for i in ids]

    def _check_id(self, token_id, what: str = "token id") -> int:
        try:
            token_id = operator.index(token_id)
        except TypeError:
            raise TypeError(f"{what} must be an int, got {token_id!r} ({type(token_id).__name__})") from None
        if not 0 <= token_id < len(self.vocab):
            raise ValueError(f"{what} {token_id} is outside the vocabulary (0..{len(self.vocab) - 1})")
        return token_id

    # ---- vocabulary -----------------------------------------------------------------------
    @property
    def vocab_size(self) -> int:
        return len(self.vocab)

    @property
    def bos_token(self) -> str | None:
        return None if self.bos_token_id is None else self.id_to_token(self.bos_token_id)

    @property
    def eos_token(self) -> str | None:
        return None if self.eos_token_id is None else self.id_to_token(self.eos_token_id)

    def id_to_token(self, token_id: int) -> str:
        """A token as the vocabulary spells it: a special's text, else GPT-2's printable bytes ('Ġthe')."""
        token_id = self._check_id(token_id)
        data = self.vocab[token_id]
        return data.decode("utf-8") if token_id in self._special_ids else bytes_to_printable(data)

    def apply_chat_template(self, messages, add_generation_prompt: bool = False) -> str:
        """The prompt text for `messages`, rendered exactly as transformers renders this template."""
        if self.chat_template is None:
            raise ValueError("this tokenizer has no chat template")
        return render_chat_template(self.chat_template, messages, add_generation_prompt,
                                    bos_token=self.bos_token, eos_token=self.eos_token)

    # ---- saving ---------------------------------------------------------------------------
    def save(self, path: str | Path) -> None:
        """Write a JSON file a person can read: tokens and merges in GPT-2's printable spelling."""
        tokens = [self.id_to_token(i) for i in range(len(self.vocab))]
        data = {
            "format": SAVE_FORMAT, "pattern": self.pattern, "special_tokens": self.special_tokens,
            "bos_token_id": self.bos_token_id, "eos_token_id": self.eos_token_id,
            "add_bos_token": self.add_bos_token, "add_eos_token": self.add_eos_token,
            "chat_template": self.chat_template, "normalization": self.normalization, "tokens": tokens,
            "merges": [f"{tokens[a]} {tokens[b]}" for a, b in self.merges],
        }
        Path(path).write_text(json.dumps(data, indent=0, ensure_ascii=False) + "\n", encoding="utf-8")

    @classmethod
    def load(cls, path: str | Path) -> "Tokenizer":
        data = json.loads(Path(path).read_text(encoding="utf-8"))
        if not isinstance(data, dict) or data.get("format") != SAVE_FORMAT:
            raise ValueError(f"{path} is not a labkit tokenizer file (format {SAVE_FORMAT!r})")
        options = {k: data[k] for k in ("bos_token_id", "eos_token_id", "add_bos_token", "add_eos_token",
                                         "chat_template")}
        options["normalization"] = data.get("normalization")  # absent in files saved before it existed
        return cls.from_printable(data["tokens"], data["merges"], data["pattern"], data["special_tokens"],
                                  **options)

    @classmethod
    def from_printable(cls, tokens: list[str], merges: list[str], pattern: str,
                       special_tokens: dict[str, int], **options) -> "Tokenizer":
        """Build from GPT-2-style printable tokens and "left right" merge lines (GGUF, HF, saved files)."""
        special_ids = set(special_tokens.values())
        vocab = [t.encode("utf-8") if i in special_ids else printable_to_bytes(t)
                 for i, t in enumerate(tokens)]
        ids = {t: i for i, t in enumerate(tokens) if i not in special_ids}
        pairs = []
        for rank, line in enumerate(merges):
            parts = line.split(" ")
            if len(parts) != 2 or parts[0] not in ids or parts[1] not in ids:
                raise ValueError(f"merge {rank} {line!r} is not two known tokens separated by a space")
            pairs.append((ids[parts[0]], ids[parts[1]]))
        return cls(vocab, pairs, pattern, special_tokens, **options)


def train(text: str, vocab_size: int, pattern: str = "gpt2",
          special_tokens: Collection[str] = ()) -> Tokenizer:
    """Learn a byte-level BPE tokenizer of `vocab_size` tokens (256 bytes + merges + specials).

    Special tokens get the last ids; their occurrences in `text` are cut out before counting.
    If the text runs out of pairs first, the vocabulary is smaller than asked.
    """
    if not isinstance(text, str):
        raise TypeError(f"text must be a str, got {type(text).__name__}")
    specials = list(special_tokens)
    if isinstance(special_tokens, str) or not all(isinstance(s, str) and s for s in specials):
        raise TypeError(f"special_tokens must be a collection of non-empty strings, got {special_tokens!r}")
    if len(set(specials)) != len(specials):
        raise ValueError(f"special_tokens has duplicates: {specials}")
    if isinstance(vocab_size, bool) or not isinstance(vocab_size, int):
        raise TypeError(f"vocab_size must be an int, got {type(vocab_size).__name__}")
    if vocab_size < 256 + len(specials):
        raise ValueError(f"vocab_size must be at least 256 (one token per byte) + {len(specials)} special "
                         f"tokens = {256 + len(specials)}, got {vocab_size}")
    source = resolve_pattern(pattern)
    splitter = regex.compile("|".join(regex.escape(s) for s in specials)) if specials else None
    words: Counter = Counter()
    for chunk in splitter.split(text) if splitter else [text]:
        words.update(piece.encode("utf-8") for piece in regex.findall(source, chunk))
    merges = train_merges(words, vocab_size - 256 - len(specials))
    vocab = learned_vocab(merges)
    special_ids = {s: len(vocab) + i for i, s in enumerate(specials)}
    return Tokenizer(vocab + [s.encode("utf-8") for s in specials], merges, source, special_ids)


def placeholder_tokenizer(vocab_size: int) -> Tokenizer:
    """Byte-level ids 0..255 for text, and "<id>" for every other id, so any id a random-weight model
    (labkit.model.random_weights) generates decodes."""
    vocab = [bytes([b]) for b in range(256)] + [f"<{i}>".encode() for i in range(256, vocab_size)]
    return Tokenizer(vocab, merges=[])
