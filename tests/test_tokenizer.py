"""labkit.tokenizer on its own: the BPE steps, training, special tokens, save/load, streaming, bad input."""

import json
from collections import Counter

import pytest
import regex
from hypothesis import given, settings
from hypothesis import strategies as st

from labkit.tokenizer import (
    IncrementalDetokenizer,
    Tokenizer,
    apply_merges,
    merge_pair,
    pair_counts,
    pretokenize,
    train,
    train_merges,
)
from labkit.tokenizer.pretokenize import PATTERNS
from labkit_course.data import JARGON_FILE, data_path

CORPUS = data_path(JARGON_FILE)
SAMPLE = CORPUS.read_text(encoding="utf-8")[:40_000]


@pytest.fixture(scope="module")
def tok():
    return train(SAMPLE[:20_000], 256 + 200, special_tokens=["<|endoftext|>"])


def naive_train_merges(words: Counter, num_merges: int):
    """The textbook trainer: recount every pair from scratch before each merge."""
    pieces = {word: list(word) for word in words}
    merges = []
    for step in range(num_merges):
        counts = Counter()
        for word, freq in words.items():
            for pair, n in pair_counts(pieces[word]).items():
                counts[pair] += n * freq
        if not counts:
            break
        best = min(counts, key=lambda pair: (-counts[pair], pair))
        merges.append(best)
        pieces = {word: merge_pair(ids, best, 256 + step) for word, ids in pieces.items()}
    return merges


def test_pair_counts_and_merge_pair():
    assert pair_counts([1, 2, 1, 2, 2]) == {(1, 2): 2, (2, 1): 1, (2, 2): 1}
    assert pair_counts([7]) == {}
    assert merge_pair([1, 2, 1, 2, 2], (1, 2), 9) == [9, 9, 2]
    assert merge_pair([5, 5, 5], (5, 5), 9) == [9, 5]  # non-overlapping, left to right


def test_apply_merges_follows_rank_not_position():
    merges = {(2, 3): (0, 10), (1, 2): (1, 11)}
    assert apply_merges([1, 2, 3], merges) == [1, 10]  # (2,3) was learned first, so it wins


def test_incremental_training_equals_recounting_from_scratch():
    words = Counter(piece.encode() for piece in pretokenize(SAMPLE[:8000]))
    assert train_merges(words, 150) == naive_train_merges(words, 150)


def test_training_stops_when_no_pair_is_left():
    tok = train("ab ab", 1000)  # pieces "ab" and " ab": merge a+b, then " "+ab, then nothing is left
    assert tok.merges == [(ord("a"), ord("b")), (ord(" "), 256)] and tok.vocab_size == 258
    assert tok.encode("ab ab") == [256, 257]


def test_trained_tokenizer_compresses_and_round_trips():
    tok = train(SAMPLE, 256 + 300)
    assert tok.vocab_size == 556 and len(tok.merges) == 300
    ids = tok.encode(SAMPLE)
    assert tok.decode(ids) == SAMPLE
    assert len(SAMPLE.encode()) / len(ids) > 2.0
    assert tok.encode("") == [] and tok.decode([]) == ""


@pytest.mark.parametrize("pattern", sorted(PATTERNS))
def test_patterns_cover_text_exactly(pattern):
    text = "It's 2024!  Don't   stop\n\n\tcafé 12,345.6 ½ 東京 🙂👍🏽"
    assert "".join(pretokenize(text, pattern)) == text


# Characters assigned in Python's Unicode database (14.0). `regex` follows a newer Unicode than
# `tokenizers`' Oniguruma (which knows 16.0), so only characters assigned after 16.0 are classified differently.
_ASSIGNED = st.characters(codec="utf-8", exclude_categories=("Cs", "Cn"))


def _tokenizers_pieces(pattern_name: str, text: str) -> list[str]:
    """The same pattern run by `tokenizers` (Rust, Oniguruma); SmolLM2 as its two real steps."""
    from tokenizers import Regex, pre_tokenizers

    gpt_pattern = PATTERNS["gpt4" if pattern_name == "gpt4" else "gpt2"]
    steps = [pre_tokenizers.Split(Regex(gpt_pattern), behavior="isolated")]
    if pattern_name == "smollm2":
        steps.insert(0, pre_tokenizers.Digits(individual_digits=True))
    return [piece for piece, _ in pre_tokenizers.Sequence(steps).pre_tokenize_str(text)]


@settings(max_examples=300, deadline=None)
@given(st.sampled_from(sorted(PATTERNS)),
       st.text(st.one_of(st.sampled_from(" \t\n\r1234'sStTdD!?.,é½²\u00a0\u3000"), _ASSIGNED), max_size=25))
def test_patterns_cut_text_as_tokenizers_does(pattern, text):
    assert pretokenize(text, pattern) == _tokenizers_pieces(pattern, text)


def test_gpt4_pattern_groups_digits_by_three_and_smollm2_splits_them():
    assert pretokenize("12345", "gpt4") == ["123", "45"]
    assert pretokenize("12345", "smollm2") == list("12345")
    assert pretokenize(" 12345", "gpt2") == [" 12345"]


def test_special_tokens_are_explicit():
    tok = train(SAMPLE, 256 + 50, special_tokens=["<|end|>", "<|end|>x"])
    end, endx = tok.special_tokens["<|end|>"], tok.special_tokens["<|end|>x"]
    assert (end, endx) == (256 + 48, 256 + 49)
    text = "a<|end|>xb<|end|>"
    assert tok.encode(text) == tok.encode("a") + [endx] + tok.encode("b") + [end]  # longest match wins
    as_text = tok.encode(text, allowed_special="none")
    assert end not in as_text and endx not in as_text and tok.decode(as_text) == text
    only_end = tok.encode(text, allowed_special={"<|end|>"})
    assert only_end.count(end) == 2 and endx not in only_end
    assert tok.decode(tok.encode(text)) == text
    assert tok.decode(tok.encode(text), skip_special_tokens=True) == "ab"


def test_save_load_round_trip_is_human_readable(tmp_path):
    tok = train(SAMPLE, 256 + 100, pattern="gpt4", special_tokens=["<|eot|>"])
    path = tmp_path / "tok.json"
    tok.save(path)
    data = json.loads(path.read_text(encoding="utf-8"))
    assert data["merges"][0].count(" ") == 1 and "<|eot|>" in data["tokens"]
    assert any(t.startswith("Ġ") for t in data["tokens"])  # spaces spelled as GPT-2 does
    loaded = Tokenizer.load(path)
    assert loaded.merges == tok.merges and loaded.vocab == tok.vocab and loaded.pattern == tok.pattern
    text = SAMPLE[:3000] + "<|eot|>"
    assert loaded.encode(text) == tok.encode(text)


@settings(max_examples=150, deadline=None)
@given(st.text(max_size=40))
def test_round_trip_on_any_text(tok, text):
    assert tok.decode(tok.encode(text, allowed_special="none")) == text


@settings(max_examples=150, deadline=None)
@given(st.text(max_size=30), st.lists(st.integers(1, 5), max_size=10))
def test_streaming_never_emits_broken_utf8(tok, text, cuts):
    ids = tok.encode(text)
    stream = IncrementalDetokenizer(tok)
    pieces, start = [], 0
    for step in cuts + [len(ids)]:
        pieces.append(stream.push(ids[start:start + step]))
        start += step
    pieces.append(stream.flush())
    assert "".join(pieces) == text
    assert all("\ufffd" not in piece for piece in pieces) or "\ufffd" in text


def test_decode_accepts_numpy_and_torch_ids(tok):
    import numpy as np
    import torch

    ids = tok.encode("tensors of ids")
    assert tok.decode(np.array(ids)) == tok.decode(torch.tensor(ids)) == "tensors of ids"
    stream = IncrementalDetokenizer(tok)
    assert "".join(stream.push(i) for i in np.array(ids)) + stream.flush() == "tensors of ids"


def test_streaming_one_id_at_a_time_holds_back_partial_characters(tok):
    text = "€🙂"
    stream = IncrementalDetokenizer(tok)
    pieces = [stream.push(i) for i in tok.encode(text)]
    assert "".join(pieces) == text and all(p in ("", "€", "🙂") for p in pieces)
    stream = IncrementalDetokenizer(tok)
    assert stream.push(tok.encode("€")[:1]) == ""
    assert stream.flush() == "\ufffd"  # an unfinished character at the end becomes U+FFFD


@pytest.mark.parametrize("call, error, words", [
    (lambda t: t.encode(b"bytes"), TypeError, "text must be a str"),
    (lambda t: t.encode(None), TypeError, "text must be a str"),
    (lambda t: t.encode("lone \ud800 surrogate"), UnicodeEncodeError, "surrogates not allowed"),
    (lambda t: t.decode([1, 10**6]), ValueError, "token id 1000000 is outside the vocabulary"),
    (lambda t: t.decode([-1]), ValueError, "token id -1 is outside"),
    (lambda t: t.decode(["a"]), TypeError, "token id must be an int"),
    (lambda t: t.decode("abc"), TypeError, "ids must be a sequence of ints"),
    (lambda t: t.encode("x", allowed_special={"<|no|>"}), ValueError, "unknown special tokens ['<|no|>']"),
    (lambda t: t.encode("x", allowed_special="some"), ValueError, "allowed_special must be"),
    (lambda t: t.apply_chat_template([{"role": "user", "content": "hi"}]), ValueError, "no chat template"),
    (lambda t: train("abc", 257, special_tokens=["<a>", "<b>"]), ValueError, "vocab_size must be at least"),
    (lambda t: train("abc", "300"), TypeError, "vocab_size must be an int"),
    (lambda t: train(["abc"], 300), TypeError, "text must be a str"),
    (lambda t: train("abc", 300, pattern="(unclosed"), ValueError, "neither a known name"),
    (lambda t: train("abc", 300, special_tokens=["<a>", "<a>"]), ValueError, "duplicates"),
])
def test_bad_input_gets_a_clear_error(tok, call, error, words):
    with pytest.raises(error, match=regex.escape(words)):
        call(tok)


def test_constructor_rejects_merges_outside_the_vocabulary():
    vocab = [bytes([b]) for b in range(256)]
    with pytest.raises(ValueError, match="merge 0 300 is outside the vocabulary"):
        Tokenizer(vocab, [(97, 300)])
    with pytest.raises(ValueError, match="makes a token that is not in the vocab"):
        Tokenizer(vocab, [(97, 98)])


def test_load_rejects_a_file_of_another_format(tmp_path):
    path = tmp_path / "x.json"
    path.write_text('{"model": {}}')
    with pytest.raises(ValueError, match="not a labkit tokenizer file"):
        Tokenizer.load(path)


