"""Broken model files fail with a ModelFileError naming the file and the problem, never a bare
IndexError or numpy message; and every loader resolves a model path the same way.

The GGUF cases are corrupted copies of a tiny GGUF laid out like SmolLM2's (parsing the real
file's 49,152-token vocabulary takes seconds), plus truncated copies of the real file; the Hugging
Face cases are tiny folders saved with safetensors.
"""

import json
import os
import random
import shutil
import struct

import gguf
import numpy as np
import pytest
import torch
from safetensors.torch import save_file

from labkit.model import load_config, load_model
from labkit.registry import ModelFileError, resolve_model_path
from labkit.tokenizer import load_tokenizer
from labkit.tokenizer.byte_level import BYTE_TO_CHAR

SMOLLM2 = resolve_model_path("smollm2")
TOKENS = [BYTE_TO_CHAR[b] for b in range(256)] + ["Ġt", "<|endoftext|>"]
HIDDEN, VOCAB = 16, len(TOKENS)


def tiny_gguf(path):
    """A 1-layer Llama GGUF with a 258-token byte-level vocabulary: SmolLM2's layout in miniature."""
    rng = np.random.default_rng(0)
    writer = gguf.GGUFWriter(path, "llama")
    for add, value in [(writer.add_block_count, 1), (writer.add_context_length, 64),
                       (writer.add_embedding_length, HIDDEN), (writer.add_feed_forward_length, 32),
                       (writer.add_head_count, 2), (writer.add_head_count_kv, 1), (writer.add_rope_freq_base, 1e4),
                       (writer.add_layer_norm_rms_eps, 1e-5), (writer.add_vocab_size, VOCAB),
                       (writer.add_tokenizer_model, "gpt2"), (writer.add_tokenizer_pre, "smollm"),
                       (writer.add_token_list, TOKENS), (writer.add_token_types, [1] * (VOCAB - 1) + [3]),
                       (writer.add_token_merges, ["Ġ t"]), (writer.add_eos_token_id, VOCAB - 1)]:
        add(value)
    shapes = {"token_embd.weight": (VOCAB, HIDDEN), "output_norm.weight": (HIDDEN,),
              "blk.0.attn_norm.weight": (HIDDEN,), "blk.0.ffn_norm.weight": (HIDDEN,),
              "blk.0.attn_q.weight": (HIDDEN, HIDDEN), "blk.0.attn_k.weight": (8, HIDDEN),
              "blk.0.attn_v.weight": (8, HIDDEN), "blk.0.attn_output.weight": (HIDDEN, HIDDEN),
              "blk.0.ffn_gate.weight": (32, HIDDEN), "blk.0.ffn_up.weight": (32, HIDDEN),
              "blk.0.ffn_down.weight": (HIDDEN, 32)}
    for name, shape in shapes.items():
        writer.add_tensor(name, rng.standard_normal(shape).astype(np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


@pytest.fixture
def tiny(tmp_path):
    """(path of a sound tiny GGUF, its layout: where the tensor data starts, each tensor's offset)."""
    path = tiny_gguf(tmp_path / "tiny.gguf")
    reader = gguf.GGUFReader(path)
    tensors = {t.name: int(t.data_offset) for t in reader.tensors}
    return path, min(tensors.values()), tensors


def edited(path, edit, name):
    """A copy of `path` with `edit(file)` applied in place."""
    copy = path.with_name(name)
    shutil.copyfile(path, copy)
    with open(copy, "r+b") as f:
        edit(f)
    return copy


def overwrite(offset, data):
    def edit(f):
        f.seek(offset)
        f.write(data)
    return edit


def assert_names_the_file(call, path, match):
    with pytest.raises(ModelFileError, match=match) as caught:
        call(path)
    assert path.name in str(caught.value)


def test_the_tiny_gguf_loads(tiny):
    path, _, _ = tiny
    assert load_model(path, device="cpu").config.vocab_size == VOCAB
    assert load_tokenizer(path).encode("a t") == [ord("a"), VOCAB - 2]  # the merge " t"


@pytest.mark.parametrize("offset", [8, 16], ids=["tensor count", "metadata count"])
def test_a_huge_count_in_the_header_is_a_model_file_error(tiny, offset):
    path = edited(tiny[0], overwrite(offset, struct.pack("<Q", 2**60)), "huge.gguf")
    for load in (load_config, load_tokenizer, load_model):
        assert_names_the_file(load, path, "not a readable GGUF file")


def test_random_metadata_never_escapes_as_a_bare_error(tiny):
    """Random bytes over parts of the metadata: every load either works or raises ModelFileError."""
    path, data_start, _ = tiny
    rng = random.Random(0)
    refused = 0
    for trial in range(40):
        start, length = rng.randrange(24, data_start - 8), rng.choice([1, 4, 8, 64])
        noisy = edited(path, overwrite(start, rng.randbytes(length)), f"noisy{trial}.gguf")
        for load in (load_config, load_tokenizer, lambda p: load_model(p, device="cpu")):
            try:
                load(noisy)
            except ModelFileError as err:
                assert noisy.name in str(err)
                refused += 1
    assert refused > 20


def test_random_bytes_in_tensor_data_are_caught_and_the_tensor_named(tiny):
    path, _, tensors = tiny
    noisy = edited(path, overwrite(tensors["blk.0.ffn_up.weight"] + 40, b"\xff" * 8), "nan.gguf")  # F32 NaNs
    assert_names_the_file(lambda p: load_model(p, device="cpu"), noisy,
                          r"tensor layers\.0\.mlp\.up_proj\.weight holds NaN or infinite values")


def test_metadata_that_disagrees_with_the_tensors_is_refused(tiny):
    """A block_count the tensors do not back (here 10**6 layers) must not build a huge model."""
    path = tiny[0]
    reader = gguf.GGUFReader(path)
    field = reader.fields["llama.block_count"]
    offset = int(field.parts[field.data[0]].ctypes.data - reader.data.ctypes.data)
    noisy = edited(path, overwrite(offset, struct.pack("<I", 10**6)), "layers.gguf")
    assert_names_the_file(load_model, noisy, "metadata says 1000000 layers but the file has tensors for 1")


def test_a_truncated_copy_of_the_real_file_names_itself(tmp_path):
    head = tmp_path / "head.gguf"
    with open(SMOLLM2, "rb") as f:
        head.write_bytes(f.read(4096))  # the header and the start of the metadata
    for load in (load_config, load_tokenizer, load_model):
        assert_names_the_file(load, head, "not a readable GGUF file")


def test_a_real_file_cut_inside_its_tensor_data_names_itself(tmp_path):
    cut = tmp_path / "cut.gguf"
    shutil.copyfile(SMOLLM2, cut)
    os.truncate(cut, SMOLLM2.stat().st_size - 4096)
    assert_names_the_file(load_config, cut, "not a readable GGUF file .truncated or corrupted")


def test_model_and_tokenizer_resolve_a_folder_the_same_way(tmp_path, tiny):
    folder = tmp_path / "one"
    folder.mkdir()
    (folder / SMOLLM2.name).symlink_to(SMOLLM2)
    assert resolve_model_path(folder) == folder / SMOLLM2.name
    assert load_tokenizer(folder).encode("The capital of France is") == [504, 3575, 282, 4649, 314]
    tiny_folder = tmp_path / "tiny"
    tiny_folder.mkdir()
    shutil.copyfile(tiny[0], tiny_folder / "model.gguf")
    assert load_model(tiny_folder, device="cpu").config.vocab_size == VOCAB  # refused before: "don't know how"
    (tiny_folder / "copy.gguf").symlink_to(tiny[0])
    for load in (load_model, load_tokenizer, load_config):
        with pytest.raises(ModelFileError, match="it has 2"):
            load(tiny_folder)


@pytest.mark.parametrize("path", ["", "   "])
def test_an_empty_path_is_refused_everywhere(path):
    for load in (load_model, load_tokenizer, load_config):
        with pytest.raises(ValueError, match="model is empty"):
            load(path)


# --- Hugging Face folders ---------------------------------------------------------------------
CONFIG = {"model_type": "llama", "vocab_size": 32, "hidden_size": 16, "intermediate_size": 32,
          "num_hidden_layers": 1, "num_attention_heads": 2, "num_key_value_heads": 1,
          "max_position_embeddings": 64, "rms_norm_eps": 1e-5, "tie_word_embeddings": True}


def hf_folder(tmp_path, config=CONFIG, poison=None):
    """A tiny Llama folder; `poison` names a tensor to fill with NaN."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    state = LlamaForCausalLM(LlamaConfig(**CONFIG)).state_dict()
    state = {k: v.contiguous() for k, v in state.items() if k != "lm_head.weight"}
    if poison:
        state[poison][0, 0] = float("nan")
    folder = tmp_path / "hf"
    folder.mkdir(exist_ok=True)
    save_file(state, folder / "model.safetensors")
    (folder / "config.json").write_text(json.dumps(config) if isinstance(config, dict) else config)
    return folder


def test_a_sound_tiny_folder_loads(tmp_path):
    assert load_model(hf_folder(tmp_path), device="cpu").config.num_layers == 1


def test_a_partial_config_names_the_missing_key(tmp_path):
    partial = {k: v for k, v in CONFIG.items() if k != "num_attention_heads"}
    with pytest.raises(ModelFileError, match=r"config\.json lacks the key 'num_attention_heads'"):
        load_model(hf_folder(tmp_path, partial), device="cpu")


def test_a_config_that_is_not_json_is_named(tmp_path):
    with pytest.raises(ModelFileError, match=r"config\.json is not valid JSON"):
        load_config(hf_folder(tmp_path, '{"model_type": "llama", '))
    with pytest.raises(ModelFileError, match=r"config\.json holds a list"):
        load_config(hf_folder(tmp_path, "[1, 2]"))


def test_a_truncated_safetensors_file_is_named(tmp_path):
    folder = hf_folder(tmp_path)
    weights = folder / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:-100])
    with pytest.raises(ModelFileError, match=r"model\.safetensors is not a readable safetensors file"):
        load_model(folder, device="cpu")


def test_nan_weights_in_a_folder_name_the_tensor(tmp_path):
    folder = hf_folder(tmp_path, poison="model.layers.0.mlp.up_proj.weight")
    with pytest.raises(ModelFileError, match=r"tensor layers\.0\.mlp\.up_proj\.weight holds NaN"):
        load_model(folder, device="cpu")


def test_a_gguf_rewritten_in_place_is_read_again(tmp_path):
    """Parsed readers are shared between loads, keyed by the file's size and modification time: a
    file replaced since is parsed again, not served from the earlier parse."""
    from labkit.model.gguf_loader import open_gguf

    path = tiny_gguf(tmp_path / "tiny.gguf")
    assert open_gguf(path) is open_gguf(path)
    first = load_model(path, device="cpu").embed_tokens.weight.clone()
    shutil.copyfile(SMOLLM2, path)
    assert load_config(path).num_layers == 30 and load_config(path).vocab_size == 49152
    tiny_gguf(path)
    torch.testing.assert_close(load_model(path, device="cpu").embed_tokens.weight, first)
