"""Tiny random Llama and Qwen3 checkpoints saved by transformers, loaded by labkit's HF loader.

transformers is the oracle: same weights, same logits (fp32, 1e-4), same greedy continuations.
"""

import json

import pytest
import torch
from safetensors.torch import save_file
from transformers import LlamaConfig, LlamaForCausalLM, Qwen3Config, Qwen3ForCausalLM

from labkit.attention.dense import dense_attention
from labkit.attention.metadata import AttentionMetadata
from labkit.cache import KVCache, PreallocatedKVCache
from labkit.model import generate, load_config, load_model

TINY = dict(vocab_size=96, hidden_size=64, intermediate_size=128, num_hidden_layers=3, num_attention_heads=4,
            num_key_value_heads=2, max_position_embeddings=256, rms_norm_eps=1e-5,
            initializer_range=0.2,  # peaked logits, so greedy argmax has no near-ties
            bos_token_id=None, eos_token_id=None)  # no EOS: both sides generate all 64 tokens


def make_llama():
    # Llama 3 rope scaling with a short original context, so the scaling really bends some frequencies.
    rope = {"rope_type": "llama3", "rope_theta": 50000.0, "factor": 8.0, "low_freq_factor": 1.0,
            "high_freq_factor": 4.0, "original_max_position_embeddings": 32}
    return LlamaForCausalLM(LlamaConfig(**TINY, rope_parameters=rope, tie_word_embeddings=False))


def make_qwen3():
    return Qwen3ForCausalLM(Qwen3Config(**TINY, head_dim=24, rope_parameters={"rope_type": "default",
                                                                              "rope_theta": 1e6},
                                        tie_word_embeddings=True))


@pytest.fixture(scope="module", params=["llama", "qwen3-sharded"])
def pair(request, tmp_path_factory):
    """(transformers model, labkit model) sharing one checkpoint folder."""
    torch.manual_seed(0)
    hf = (make_llama() if request.param == "llama" else make_qwen3()).eval()
    folder = tmp_path_factory.mktemp(request.param)
    hf.save_pretrained(folder, max_shard_size="40KB" if "sharded" in request.param else "1GB")
    if "sharded" in request.param:
        assert (folder / "model.safetensors.index.json").is_file()
    return hf, load_model(folder, device="cpu"), folder


PROMPTS = [[5, 17, 42, 3, 88, 9, 61], [1], list(range(10, 60))]


def hf_logits(hf, ids):
    with torch.no_grad():
        return hf(torch.tensor([ids])).logits[0]


def test_config_is_read_from_config_json(pair):
    hf, model, _ = pair
    c = model.config
    assert (c.num_layers, c.num_heads, c.num_kv_heads, c.vocab_size) == (3, 4, 2, 96)
    assert c.head_dim == hf.config.head_dim
    assert c.tie_word_embeddings == hf.config.tie_word_embeddings
    assert (model.lm_head.weight is model.embed_tokens.weight) == c.tie_word_embeddings
    assert c.qk_norm == (c.architecture == "qwen3")
    assert load_config(pair[2]) == c


@pytest.mark.parametrize("ids", PROMPTS)
def test_logits_match_transformers(pair, ids):
    hf, model, _ = pair
    got = model(torch.tensor(ids))
    assert got.shape == (len(ids), 96)
    assert (got - hf_logits(hf, ids)).abs().max() < 1e-4


def test_flat_batch_of_several_sequences_matches_each_alone(pair):
    hf, model, _ = pair
    flat = torch.tensor([t for ids in PROMPTS for t in ids])
    positions = torch.cat([torch.arange(len(ids)) for ids in PROMPTS])
    meta = AttentionMetadata.causal([len(ids) for ids in PROMPTS])
    got = model(flat, positions, meta, dense_attention)
    expected = torch.cat([hf_logits(hf, ids) for ids in PROMPTS])
    assert (got - expected).abs().max() < 1e-4


def test_greedy_64_tokens_match_transformers_with_and_without_cache(pair):
    hf, model, _ = pair
    prompt = PROMPTS[0]
    with torch.no_grad():
        ref = hf.generate(torch.tensor([prompt]), max_new_tokens=64, do_sample=False,
                          pad_token_id=0)[0, len(prompt):]
    no_cache = generate(model, prompt, 64)
    concat = generate(model, prompt, 64, kv_cache=KVCache(model.config.num_layers))
    prealloc = generate(model, prompt, 64, kv_cache=PreallocatedKVCache.for_model(model, max_seq_len=80))
    assert ref.tolist() == no_cache.tolist() == concat.tolist() == prealloc.tolist()


def test_equal_length_batch_in_a_cache_matches_each_prompt_alone(pair):
    _, model, _ = pair
    prompts = torch.tensor([[5, 17, 42, 3], [60, 2, 2, 71], [9, 9, 9, 9]])
    batched = generate(model, prompts, 12, kv_cache=PreallocatedKVCache.for_model(model, 3, 16))
    alone = torch.stack([generate(model, p, 12) for p in prompts])
    assert torch.equal(batched, alone)


def test_cache_memory_matches_the_formula(pair):
    _, model, _ = pair
    cache = KVCache(model.config.num_layers)
    generate(model, [4, 5, 6], 5, kv_cache=cache)
    # the last generated token is never fed back, so 3 + 5 - 1 tokens are cached
    assert cache.seq_len == 7
    assert cache.nbytes == 7 * model.config.kv_cache_bytes_per_token(dtype_bytes=4)


# ---- failure paths ---------------------------------------------------------------------------------------


def copy_folder(src, dst):
    dst.mkdir()
    for f in src.iterdir():
        (dst / f.name).write_bytes(f.read_bytes())
    return dst


def test_missing_config_json(tmp_path):
    with pytest.raises(FileNotFoundError, match="no config.json"):
        load_model(tmp_path)


def test_missing_weights(pair, tmp_path):
    folder = tmp_path / "m"
    folder.mkdir()
    (folder / "config.json").write_bytes((pair[2] / "config.json").read_bytes())
    with pytest.raises(FileNotFoundError, match="no \\*.safetensors"):
        load_model(folder)


def test_missing_shard(tmp_path):
    make_qwen3().save_pretrained(tmp_path, max_shard_size="40KB")
    next(tmp_path.glob("model-00002-*.safetensors")).unlink()
    with pytest.raises(FileNotFoundError, match="shards that are missing"):
        load_model(tmp_path)


def test_unsupported_architecture(pair, tmp_path):
    folder = copy_folder(pair[2], tmp_path / "m")
    cfg = json.loads((folder / "config.json").read_text())
    cfg["model_type"] = "gpt2"
    (folder / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match="unsupported model_type 'gpt2'"):
        load_model(folder)


def test_shape_mismatch_names_the_tensor(pair, tmp_path):
    folder = copy_folder(pair[2], tmp_path / "m")
    cfg = json.loads((folder / "config.json").read_text())
    cfg["intermediate_size"] = 100
    (folder / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match=r"mlp\.\w+_proj\.weight has shape"):
        load_model(folder)


def test_missing_tensor_is_named(tmp_path):
    torch.manual_seed(0)
    hf = make_llama()
    hf.save_pretrained(tmp_path)
    weights = {k: v for k, v in hf.state_dict().items() if k != "model.norm.weight"}
    save_file(weights, tmp_path / "model.safetensors")
    with pytest.raises(ValueError, match=r"missing \['norm.weight'\]"):
        load_model(tmp_path)


def test_bad_inputs_are_rejected(pair):
    _, model, _ = pair
    with pytest.raises(TypeError, match="input_ids must be a 1-D LongTensor"):
        model(torch.tensor([[1, 2]]))
    with pytest.raises(TypeError, match="input_ids must be a 1-D LongTensor"):
        model([1, 2])
    with pytest.raises(ValueError, match="input_ids must lie in"):
        model(torch.tensor([1, 96]))
    with pytest.raises(ValueError, match="max_new_tokens"):
        generate(model, [1, 2], -1)
    with pytest.raises(TypeError, match="dtype"):
        load_model(pair[2], dtype="float32")
