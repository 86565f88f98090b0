"""labkit's SmolLM2 tokenizer against the oracles: `tokenizers` and transformers, from the same GGUF.

SmolLM2's own tokenizer splits every digit off before the GPT-2 regex (llama.cpp calls this
pre-tokenizer "smollm"). transformers' GGUF importer drops that step, so its tokenizer differs
from SmolLM2's exactly where a run of 2+ whitespace characters precedes a digit ("a  1"). We
therefore check labkit against both: the true pipeline (`tokenizers` with Digits + ByteLevel)
everywhere, and transformers' GGUF tokenizer everywhere else and, with the GPT-2 pattern, everywhere.
"""

import os

import pytest
import regex
from hypothesis import given, settings
from hypothesis import strategies as st

from labkit.registry import resolve_model_path
from labkit.tokenizer import IncrementalDetokenizer, Tokenizer, load_tokenizer
from labkit_course.data import JARGON_FILE, data_path

os.environ.setdefault("HF_HUB_OFFLINE", "1")

JARGON_PATH = data_path(JARGON_FILE)
JARGON = JARGON_PATH.read_text(encoding="utf-8")
# Characters Python's Unicode database (14.0) assigns: `tokenizers`' regex engine knows Unicode 16.0 and
# ours a newer one, so letters assigned after 16.0 may be cut differently (see labkit/tokenizer/pretokenize.py).
ASSIGNED = st.characters(exclude_categories=("Cs", "Cn"))
SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<repo_name>", "<file_sep>", "<empty_output>"]

CORPUS = [
    "", "a", " ", "\n", "7", "é", "😀", "The capital of France is",
    "Hello, world! It's a beautiful day; isn't it? We'll see—they'd said so.",
    "def f(x):\n    return x ** 2  # square\n\n\nclass A:\n\tpass\n",
    "for (int i = 0; i < n; ++i) { sum += a[i]; }  // C\n",
    '{"key": [1, 2.5, -3e10], "nested": {"ok": true}}',
    "   leading spaces", "trailing spaces   ", "a    b\t\t\tc\n\n\n\nd", " \t \n \r\n x", "\r\n\r\n",
    "3.14159 2024-06-01 1,000,000 0x1F 12345678901234567890", "a  1", "x   42  7", "\n\n3", "  ½ ² Ⅻ ٣",
    "Ünïcödé façade naïve coöperate", "Привет, мир! Как дела?", "Γειά σου Κόσμε", "שלום עולם",
    "مرحبا بالعالم", "नमस्ते दुनिया", "你好，世界！今天天气很好。", "こんにちは世界、カタカナ",
    "안녕하세요 세계", "สวัสดีชาวโลก",
    # ZWJ families, skin tone, flags (regional indicators), variation selectors
    "\U0001F469\u200d\U0001F469\u200d\U0001F467\u200d\U0001F466 \U0001F468\U0001F3FD\u200d\U0001F4BB "
    "\U0001F3F3\ufe0f\u200d\U0001F308 \U0001F1EB\U0001F1F7\U0001F1EF\U0001F1F5 \u2764\ufe0f\u200d\U0001F525",
    "e\u0301 a\u0308\u0323 Z\u0324\u0354\u0367\u0311\u0313a\u0308\u0356\u032d\u0308\u0307",  # combining marks
    "zero\u200bwidth\ufeffBOM\u00a0nbsp\u2028line", "I'm HE'S they'RE you've we'LL 'd",
    "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n", "<|im_start|<|im_end|>>",
    "<|endoftext|><|endoftext|>", "<repo_name>x<file_sep>y<empty_output>", "~!@#$%^&*()_+-=[]{}|;':\",./<>?`",
    "....!!!???---___",
    JARGON[:20_000], JARGON[500_000:520_000],
]


@pytest.fixture(scope="module")
def labkit_tok():
    return load_tokenizer("smollm2")


@pytest.fixture(scope="module")
def hf_gguf():
    """The tokenizer transformers builds from the GGUF (GPT-2 regex only)."""
    from transformers import AutoTokenizer

    path = resolve_model_path("smollm2")
    return AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)


@pytest.fixture(scope="module")
def hf_true(hf_gguf):
    """SmolLM2's real pipeline in `tokenizers`: the same vocabulary, Digits(individual) then ByteLevel."""
    from tokenizers import Tokenizer as HFTokenizer
    from tokenizers import pre_tokenizers

    tok = HFTokenizer.from_str(hf_gguf.backend_tokenizer.to_str())
    tok.pre_tokenizer = pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True),
                                                 pre_tokenizers.ByteLevel(add_prefix_space=False)])
    return tok


def test_vocabulary_and_special_ids_match(labkit_tok, hf_gguf):
    assert labkit_tok.vocab_size == len(hf_gguf) == 49152
    assert (labkit_tok.bos_token_id, labkit_tok.eos_token_id) == (hf_gguf.bos_token_id, hf_gguf.eos_token_id)
    assert (labkit_tok.bos_token, labkit_tok.eos_token) == ("<|im_start|>", "<|im_end|>")
    assert labkit_tok.special_tokens == {t: i for t, i in hf_gguf.get_vocab().items() if i < 17}
    assert labkit_tok.encode("The capital of France is") == [504, 3575, 282, 4649, 314]


@pytest.mark.parametrize("index", range(len(CORPUS)))
def test_ids_match_smollm2_and_round_trip(labkit_tok, hf_true, index):
    text = CORPUS[index]
    ids = labkit_tok.encode(text)
    assert ids == hf_true.encode(text, add_special_tokens=False).ids
    assert labkit_tok.decode(ids) == text


@pytest.mark.parametrize("index", range(len(CORPUS)))
def test_ids_match_transformers_gguf_tokenizer(labkit_tok, hf_gguf, index):
    text = CORPUS[index]
    expected = hf_gguf.encode(text, add_special_tokens=True)  # SmolLM2 adds no BOS/EOS
    assert labkit_tok.encode(text, add_special_tokens=True) == labkit_tok.encode(text)
    if not regex.search(r"\s\s\p{N}", text):
        assert labkit_tok.encode(text) == expected
    gpt2_only = Tokenizer(labkit_tok.vocab, labkit_tok.merges, "gpt2", labkit_tok.special_tokens)
    assert gpt2_only.encode(text) == expected


def test_the_one_known_difference_from_transformers(labkit_tok, hf_gguf):
    # SmolLM2: "a", "  " (one token), "1".  transformers' GGUF import: "a", " ", " 1" -> a, Ġ, Ġ, 1.
    ours, theirs = labkit_tok.encode("a  1"), hf_gguf.encode("a  1")
    assert [labkit_tok.id_to_token(i) for i in ours] == ["a", "ĠĠ", "1"]
    assert [labkit_tok.id_to_token(i) for i in theirs] == ["a", "Ġ", "Ġ", "1"]


@settings(max_examples=300, deadline=None)
@given(st.lists(st.one_of(st.text(ASSIGNED, max_size=12), st.sampled_from(SPECIALS)), max_size=6).map("".join))
def test_any_text_matches_smollm2(labkit_tok, hf_true, text):
    assert labkit_tok.encode(text) == hf_true.encode(text, add_special_tokens=False).ids
    if not set(text.encode()) & set(labkit_tok.missing_bytes):
        assert labkit_tok.decode(labkit_tok.encode(text)) == text


@pytest.mark.parametrize("text", ["<|im_start|>user\nhi<|im_end|>", "a<|endoftext|>b", "<file_sep>x"])
def test_special_looking_text_as_plain_text(labkit_tok, hf_gguf, text):
    ids = labkit_tok.encode(text, allowed_special="none")
    assert ids == hf_gguf.encode(text, split_special_tokens=True)
    assert not set(ids) & set(labkit_tok.special_tokens.values())
    assert labkit_tok.decode(ids) == text


def test_bytes_missing_from_the_vocabulary_are_dropped_as_transformers_does(labkit_tok, hf_gguf):
    control, planes_4_to_11 = [4, 6, 19, 20, 22, 29], [0xF1, 0xF2]
    never_in_utf8 = [0xC0, 0xC1, *range(0xF5, 0x100)]
    assert labkit_tok.missing_bytes == bytes(sorted(control + never_in_utf8 + planes_4_to_11))
    for text in ["\x04", "!\x04!", "a\x13 \x14b", "\U00050000x"]:
        assert labkit_tok.encode(text) == hf_gguf.encode(text)
    assert labkit_tok.decode(labkit_tok.encode("!\x04!")) == "!!"


@settings(max_examples=200, deadline=None)
@given(st.lists(st.integers(0, 49151), max_size=12), st.booleans())
def test_decode_matches_transformers_even_for_broken_utf8(labkit_tok, hf_gguf, ids, skip):
    assert labkit_tok.decode(ids, skip_special_tokens=skip) == hf_gguf.decode(ids, skip_special_tokens=skip)


def test_streaming_a_multi_token_character(labkit_tok):
    ids = labkit_tok.encode("Paris 🇫🇷 is lovely 👩‍👩‍👧")
    stream = IncrementalDetokenizer(labkit_tok)
    pieces = [stream.push(i) for i in ids] + [stream.flush()]
    assert "".join(pieces) == labkit_tok.decode(ids)
    assert all("\ufffd" not in piece for piece in pieces)
    assert pieces.count("") > 0  # some tokens complete no character on their own


CONVERSATIONS = [
    [{"role": "user", "content": "What is the capital of France?"}],
    [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}],
    [{"role": "user", "content": "2+2?"}, {"role": "assistant", "content": "4"},
     {"role": "user", "content": "And 3+3?\n  Show work."}],
]


@pytest.mark.parametrize("messages", CONVERSATIONS)
@pytest.mark.parametrize("add_generation_prompt", [True, False])
def test_chat_template_renders_as_transformers(labkit_tok, hf_gguf, messages, add_generation_prompt):
    ours = labkit_tok.apply_chat_template(messages, add_generation_prompt=add_generation_prompt)
    theirs = hf_gguf.apply_chat_template(messages, add_generation_prompt=add_generation_prompt, tokenize=False)
    assert ours == theirs
    assert labkit_tok.encode(ours) == hf_gguf.encode(theirs)


@pytest.mark.parametrize("messages, error, words", [
    ("hello", TypeError, "messages must be a list"),
    ([], ValueError, "messages is empty"),
    ([{"role": "user"}], ValueError, "messages[0] must be a dict with 'role' and 'content'"),
    ([{"role": "user", "content": 3}], TypeError, "messages[0]['content'] must be a str"),
])
def test_chat_template_rejects_bad_messages(labkit_tok, messages, error, words):
    with pytest.raises(error, match=regex.escape(words)):
        labkit_tok.apply_chat_template(messages)


def test_save_and_load_smollm2_keeps_every_id(labkit_tok, tmp_path):
    path = tmp_path / "smollm2.json"
    labkit_tok.save(path)
    loaded = load_tokenizer(path)
    assert loaded.vocab == labkit_tok.vocab and loaded.merges == labkit_tok.merges
    assert loaded.chat_template == labkit_tok.chat_template
    text = CORPUS[-2] + CORPUS[-6]
    assert loaded.encode(text) == labkit_tok.encode(text)


def test_unknown_model_name_is_a_clear_error():
    with pytest.raises(FileNotFoundError, match="unknown model 'nosuchmodel'"):
        load_tokenizer("nosuchmodel")
