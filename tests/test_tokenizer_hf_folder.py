"""A Hugging Face folder's tokenizer.json read by labkit, checked id for id against `tokenizers`.

The folders are built here: transformers writes SmolLM2's vocabulary (from the GGUF) as a standard
folder, and each variant rewrites its pre-tokenizer, merges spelling or normalizer the way the
hub's SmolLM2, GPT-2 and Qwen2/3 files spell them. Random-weight Llama and Qwen3 checkpoints saved
beside the tokenizer make folders that `LLM(path)` loads like any downloaded model.
"""

import json
import os
import shutil

import pytest
import torch
from test_tokenizer_smollm2 import CORPUS
from tokenizers import Tokenizer as HFTokenizer

from labkit.registry import ModelFileError, resolve_model_path
from labkit.tokenizer import load_tokenizer

os.environ.setdefault("HF_HUB_OFFLINE", "1")

# Qwen2/3's pre-tokenizer regex, as their tokenizer.json spells it (Split, then ByteLevel without regex).
QWEN_REGEX = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"
              r"|\s*[\r\n]+|\s+(?!\S)|\s+")
BYTE_LEVEL = {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": True, "use_regex": True}
VARIANTS = {
    "smollm2": {"pre_tokenizer": {"type": "Sequence", "pretokenizers": [
        {"type": "Digits", "individual_digits": True}, BYTE_LEVEL]}},
    "gpt2, merges as strings": {"pre_tokenizer": BYTE_LEVEL, "string_merges": True},
    "qwen, NFC": {"pre_tokenizer": {"type": "Sequence", "pretokenizers": [
        {"type": "Split", "pattern": {"Regex": QWEN_REGEX}, "behavior": "Isolated", "invert": False},
        BYTE_LEVEL | {"use_regex": False}]}, "normalizer": {"type": "NFC"}},
}
MESSAGES = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "What is 12 + 30?"}]


@pytest.fixture(scope="module")
def saved_folder(tmp_path_factory):
    """SmolLM2's tokenizer as transformers saves it: tokenizer.json, tokenizer_config.json, chat_template.jinja."""
    from transformers import AutoTokenizer

    path = resolve_model_path("smollm2")
    folder = tmp_path_factory.mktemp("smollm2-tokenizer")
    AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name).save_pretrained(folder)
    return folder


def variant(saved_folder, tmp_path, name):
    folder = tmp_path / "model"
    shutil.copytree(saved_folder, folder)
    spec = json.loads((folder / "tokenizer.json").read_text())
    change = VARIANTS[name]
    spec["pre_tokenizer"] = change["pre_tokenizer"]
    spec["normalizer"] = change.get("normalizer")
    if change.get("string_merges"):
        spec["model"]["merges"] = [" ".join(pair) for pair in spec["model"]["merges"]]
    (folder / "tokenizer.json").write_text(json.dumps(spec, ensure_ascii=False))
    return folder


@pytest.mark.parametrize("name", VARIANTS)
def test_ids_match_tokenizers_on_every_text(saved_folder, tmp_path, name):
    folder = variant(saved_folder, tmp_path, name)
    ours, theirs = load_tokenizer(folder), HFTokenizer.from_file(str(folder / "tokenizer.json"))
    assert ours.vocab_size == theirs.get_vocab_size() == 49152
    texts = CORPUS + ["e\u0301 cafe\u0301 A\u030a", "I'LL SEE you'RE 12 345 6789"]  # NFC composes these
    for text in texts:
        assert ours.encode(text) == theirs.encode(text, add_special_tokens=False).ids, text[:60]
    assert ours.normalization == ("NFC" if "NFC" in name else None)


def test_specials_and_chat_template_match_transformers(saved_folder):
    from transformers import AutoTokenizer

    ours, theirs = load_tokenizer(saved_folder), AutoTokenizer.from_pretrained(saved_folder)
    assert (ours.bos_token_id, ours.eos_token_id) == (theirs.bos_token_id, theirs.eos_token_id) == (1, 2)
    assert ours.special_tokens == {t: i for t, i in theirs.get_vocab().items() if i < 17}
    prompt = ours.apply_chat_template(MESSAGES, add_generation_prompt=True)
    assert prompt == theirs.apply_chat_template(MESSAGES, tokenize=False, add_generation_prompt=True)


def test_the_chat_template_may_live_in_tokenizer_config(saved_folder, tmp_path):
    folder = tmp_path / "model"
    shutil.copytree(saved_folder, folder)
    template = (folder / "chat_template.jinja").read_text()
    (folder / "chat_template.jinja").unlink()
    config = json.loads((folder / "tokenizer_config.json").read_text())
    (folder / "tokenizer_config.json").write_text(json.dumps(config | {"chat_template": template}))
    assert load_tokenizer(folder).chat_template == template


@pytest.mark.parametrize("architecture", ["llama", "qwen3"])
def test_llm_loads_a_standard_folder(saved_folder, tmp_path, architecture):
    from transformers import LlamaConfig, LlamaForCausalLM, Qwen3Config, Qwen3ForCausalLM

    from labkit import LLM, SamplingParams

    folder = variant(saved_folder, tmp_path, "smollm2")
    shape = dict(vocab_size=49152, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=2, max_position_embeddings=128, bos_token_id=1, eos_token_id=2)
    torch.manual_seed(0)
    model = (LlamaForCausalLM(LlamaConfig(**shape)) if architecture == "llama"
             else Qwen3ForCausalLM(Qwen3Config(**shape, head_dim=16)))  # head_dim != hidden / heads
    model.save_pretrained(folder)
    llm = LLM(str(folder), num_kvcache_blocks=8)
    [out] = llm.chat(MESSAGES, SamplingParams(temperature=0, max_tokens=4, ignore_eos=True))
    assert out.prompt_token_ids == load_tokenizer(folder).encode(llm.tokenizer.apply_chat_template(
        MESSAGES, add_generation_prompt=True))
    assert len(out.outputs[0].token_ids) == 4


@pytest.mark.parametrize(("change", "message"), [
    (lambda folder: (folder / "tokenizer.json").rename(folder / "config.json"), "has no tokenizer.json"),
    (lambda folder: (folder / "tokenizer.json").write_text("{not json"), "not JSON"),
    (lambda folder: _edit(folder, model={"type": "WordPiece", "vocab": {}}), "'WordPiece' is not byte-level BPE"),
    (lambda folder: _edit(folder, pre_tokenizer={"type": "Metaspace"}), "pre-tokenizer Metaspace is not one"),
    (lambda folder: _edit(folder, normalizer={"type": "Lowercase"}), "normalizer 'Lowercase'"),
])
def test_a_tokenizer_labkit_cannot_read_is_named(saved_folder, tmp_path, change, message):
    folder = tmp_path / "model"
    shutil.copytree(saved_folder, folder)
    change(folder)
    with pytest.raises(ModelFileError, match=message):
        load_tokenizer(folder)


def _edit(folder, **fields):
    spec = json.loads((folder / "tokenizer.json").read_text())
    (folder / "tokenizer.json").write_text(json.dumps(spec | fields))
