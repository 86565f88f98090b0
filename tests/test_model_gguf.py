"""The GGUF loader on tiny files written with the `gguf` package the way llama.cpp's converter does.

A tiny transformers Llama supplies the weights; the file stores them Q8_0-quantized with q/k rows
permuted for llama.cpp's interleaved rotary. Loading must give transformers' logits on the
dequantized weights, and every broken file must fail with an error that names the problem.
"""

import gguf
import numpy as np
import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from labkit.model import load_config, load_model
from labkit.model.gguf_loader import unpermute_rotary_rows

Q = gguf.GGMLQuantizationType
CFG = dict(vocab_size=96, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
           num_key_value_heads=2, max_position_embeddings=128, rms_norm_eps=1e-5, initializer_range=0.2,
           rope_parameters={"rope_type": "default", "rope_theta": 10000.0}, tie_word_embeddings=True)
GGUF_NAMES = {
    "embed_tokens.weight": "token_embd.weight", "norm.weight": "output_norm.weight",
    "input_layernorm.weight": "attn_norm.weight", "post_attention_layernorm.weight": "ffn_norm.weight",
    "self_attn.q_proj.weight": "attn_q.weight", "self_attn.k_proj.weight": "attn_k.weight",
    "self_attn.v_proj.weight": "attn_v.weight", "self_attn.o_proj.weight": "attn_output.weight",
    "mlp.gate_proj.weight": "ffn_gate.weight", "mlp.up_proj.weight": "ffn_up.weight",
    "mlp.down_proj.weight": "ffn_down.weight",
}


def llama_cpp_permute(w: np.ndarray, n_head: int) -> np.ndarray:
    """What llama.cpp's convert_hf_to_gguf.py does to q/k rows (LlamaModel.permute)."""
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def gguf_name(name: str) -> str:
    if name in GGUF_NAMES:
        return GGUF_NAMES[name]
    _, i, rest = name.split(".", 2)
    return f"blk.{i}.{GGUF_NAMES[rest]}"


def write_gguf(path, hf_state, arch="llama", qtype=Q.Q8_0, omit=(), ffn_length=128, extra=None):
    writer = gguf.GGUFWriter(path, arch)
    writer.add_block_count(2)
    writer.add_context_length(128)
    writer.add_embedding_length(64)
    writer.add_feed_forward_length(ffn_length)
    writer.add_head_count(4)
    writer.add_head_count_kv(2)
    writer.add_rope_freq_base(10000.0)
    writer.add_layer_norm_rms_eps(1e-5)
    writer.add_vocab_size(96)
    for hf_name, tensor in hf_state.items():
        name = hf_name.removeprefix("model.")
        if name == "lm_head.weight" or name in omit:
            continue
        w = tensor.numpy().astype(np.float32)
        if name.endswith("q_proj.weight"):
            w = llama_cpp_permute(w, 4)
        elif name.endswith("k_proj.weight"):
            w = llama_cpp_permute(w, 2)
        if w.ndim == 2:
            if qtype == Q.IQ4_NL:  # gguf-py cannot quantize it: any bytes of the right size will do
                data = np.zeros(gguf.quants.quant_shape_to_byte_shape(w.shape, qtype), dtype=np.uint8)
            else:
                data = gguf.quants.quantize(w, qtype)
            writer.add_tensor(gguf_name(name), data, raw_dtype=qtype)
        else:
            writer.add_tensor(gguf_name(name), w)
    for name, array in (extra or {}).items():
        writer.add_tensor(name, array)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


@pytest.fixture(scope="module")
def hf_state():
    torch.manual_seed(0)
    return LlamaForCausalLM(LlamaConfig(**CFG)).state_dict()


@pytest.fixture(scope="module")
def tiny_gguf(hf_state, tmp_path_factory):
    return write_gguf(tmp_path_factory.mktemp("gguf") / "tiny.gguf", hf_state)


def test_unpermute_inverts_llama_cpp_permute():
    w = np.arange(8 * 6 * 3, dtype=np.float32).reshape(48, 3)
    for heads in (1, 2, 4):
        back = unpermute_rotary_rows(torch.from_numpy(llama_cpp_permute(w, heads)), heads)
        assert torch.equal(back, torch.from_numpy(w))


def test_logits_match_transformers_on_the_dequantized_weights(hf_state, tiny_gguf):
    model = load_model(tiny_gguf, device="cpu")
    assert model.config.tie_word_embeddings and model.config.architecture == "llama"
    assert load_config(tiny_gguf) == model.config
    # the oracle: transformers with every matrix replaced by dequantize(quantize(w)), in HF row order
    oracle = LlamaForCausalLM(LlamaConfig(**CFG)).eval()
    dequantized = {k: torch.from_numpy(gguf.quants.dequantize(gguf.quants.quantize(v.numpy(), Q.Q8_0), Q.Q8_0))
                   if v.dim() == 2 else v for k, v in hf_state.items()}
    oracle.load_state_dict(dequantized)
    for ids in ([3, 14, 15, 92, 65], list(range(40))):
        with torch.no_grad():
            expected = oracle(torch.tensor([ids])).logits[0]
        assert (model(torch.tensor(ids)) - expected).abs().max() < 1e-4


def test_missing_file(tmp_path):
    with pytest.raises(FileNotFoundError, match="no GGUF file"):
        from labkit.model import load_gguf

        load_gguf(tmp_path / "absent.gguf")


def test_not_a_gguf_file(tmp_path):
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(b"this is not a GGUF file at all" * 10)
    with pytest.raises(ValueError, match="not a readable GGUF file"):
        load_model(bad)


def test_unsupported_architecture(hf_state, tmp_path):
    with pytest.raises(ValueError, match="unsupported architecture 'gpt2'"):
        load_model(write_gguf(tmp_path / "m.gguf", hf_state, arch="gpt2"))


def test_unsupported_quantization_type(hf_state, tmp_path):
    with pytest.raises(ValueError, match="quantization type IQ4_NL"):
        load_model(write_gguf(tmp_path / "m.gguf", hf_state, qtype=Q.IQ4_NL))


def test_shape_mismatch_names_the_tensor(hf_state, tmp_path):
    with pytest.raises(ValueError, match=r"mlp\.\w+_proj\.weight has shape"):
        load_model(write_gguf(tmp_path / "m.gguf", hf_state, ffn_length=96))


def test_missing_tensor_is_named(hf_state, tmp_path):
    with pytest.raises(ValueError, match=r"missing \['norm.weight'\]"):
        load_model(write_gguf(tmp_path / "m.gguf", hf_state, omit=("norm.weight",)))


def test_unexpected_tensor_is_named(hf_state, tmp_path):
    extra = {"blk.0.attn_qkv.weight": np.zeros((4, 4), dtype=np.float32)}
    with pytest.raises(ValueError, match="unexpected tensor 'blk.0.attn_qkv.weight'"):
        load_model(write_gguf(tmp_path / "m.gguf", hf_state, extra=extra))


def test_the_random_weights_shape_is_smollm2s():
    from labkit.model.random_weights import SMOLLM2_135M

    assert load_config("smollm2") == SMOLLM2_135M
