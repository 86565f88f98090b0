"""Read a llama.cpp GGUF file into a ModelConfig and plain float tensors.

GGUF stores quantized blocks (SmolLM2's file: Q4_1 matrices, a Q8_0 embedding) which the `gguf`
package dequantizes. llama.cpp's converter also reorders the rows of every Llama q/k projection so
that its rotary rotates interleaved pairs (x0, x1), (x2, x3)...; labkit rotates Hugging Face's
half-split pairs (x_i, x_{i+d/2}), so the loader undoes that permutation.
"""

import functools
from pathlib import Path

import gguf
import numpy as np
import torch

from labkit.model.config import SUPPORTED_ARCHITECTURES, ModelConfig
from labkit.registry import ModelFileError

T = gguf.GGMLQuantizationType
SUPPORTED_TYPES = frozenset({
    T.F32, T.F16, T.BF16, T.Q4_0, T.Q4_1, T.Q5_0, T.Q5_1, T.Q8_0,
    T.Q2_K, T.Q3_K, T.Q4_K, T.Q5_K, T.Q6_K,
})

# GGUF tensor name (after "blk.N.") -> labkit parameter name (after "layers.N.")
_LAYER_NAMES = {
    "attn_norm.weight": "input_layernorm.weight",
    "attn_q.weight": "self_attn.q_proj.weight",
    "attn_k.weight": "self_attn.k_proj.weight",
    "attn_v.weight": "self_attn.v_proj.weight",
    "attn_output.weight": "self_attn.o_proj.weight",
    "attn_q.bias": "self_attn.q_proj.bias",
    "attn_k.bias": "self_attn.k_proj.bias",
    "attn_v.bias": "self_attn.v_proj.bias",
    "attn_output.bias": "self_attn.o_proj.bias",
    "attn_q_norm.weight": "self_attn.q_norm.weight",
    "attn_k_norm.weight": "self_attn.k_norm.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
    "ffn_gate.weight": "mlp.gate_proj.weight",
    "ffn_up.weight": "mlp.up_proj.weight",
    "ffn_down.weight": "mlp.down_proj.weight",
}
_GLOBAL_NAMES = {
    "token_embd.weight": "embed_tokens.weight",
    "output_norm.weight": "norm.weight",
    "output.weight": "lm_head.weight",
}


def _field(reader: gguf.GGUFReader, key: str, default=None):
    field = reader.fields.get(key)
    return default if field is None else field.contents()


def config_from_gguf(reader: gguf.GGUFReader, path: Path) -> ModelConfig:
    """The ModelConfig in a GGUF file's metadata, checked against the tensors the file holds."""
    try:
        config = _read_config(reader, path)
    except ModelFileError:
        raise
    except (ValueError, TypeError, IndexError, KeyError, OverflowError) as err:  # random bytes as metadata
        raise ModelFileError(f"{path.name}: bad GGUF metadata: {type(err).__name__}: {err}") from err
    shapes = {t.name: tuple(int(d) for d in t.shape) for t in reader.tensors}
    layers = {int(name.split(".")[1]) for name in shapes if name.startswith("blk.") and name.split(".")[1].isdigit()}
    if layers != set(range(config.num_layers)):
        raise ModelFileError(f"{path.name}: metadata says {config.num_layers} layers but the file has tensors for "
                             f"{len(layers)} (blk.0 to blk.{max(layers, default=-1)})")
    embedding = shapes.get("token_embd.weight")
    if embedding != (config.hidden_size, config.vocab_size):
        raise ModelFileError(f"{path.name}: token_embd.weight has shape {embedding}, but the metadata implies "
                             f"{(config.hidden_size, config.vocab_size)} (embedding_length, vocab_size)")
    return config


def _read_config(reader: gguf.GGUFReader, path: Path) -> ModelConfig:
    arch = _field(reader, "general.architecture")
    if arch not in SUPPORTED_ARCHITECTURES:
        raise ModelFileError(f"{path.name}: unsupported architecture {arch!r}; "
                         f"labkit runs {', '.join(SUPPORTED_ARCHITECTURES)}")

    def need(key):
        value = _field(reader, f"{arch}.{key}")
        if value is None:
            raise ModelFileError(f"{path.name}: GGUF metadata lacks {arch}.{key}")
        return value

    if f"{arch}.rope.scaling.type" in reader.fields or any(t.name == "rope_freqs.weight" for t in reader.tensors):
        raise ModelFileError(f"{path.name}: rotary scaling in GGUF files (rope_freqs) is not supported; "
                         "load the Hugging Face folder instead")
    hidden, heads = need("embedding_length"), need("attention.head_count")
    names = {t.name for t in reader.tensors}
    vocab = _field(reader, f"{arch}.vocab_size") or len(reader.fields["tokenizer.ggml.tokens"].data)
    return ModelConfig(
        architecture=arch,
        vocab_size=int(vocab),
        hidden_size=int(hidden),
        intermediate_size=int(need("feed_forward_length")),
        num_layers=int(need("block_count")),
        num_heads=int(heads),
        num_kv_heads=int(_field(reader, f"{arch}.attention.head_count_kv", heads)),
        head_dim=int(_field(reader, f"{arch}.attention.key_length", hidden // heads)),
        max_position_embeddings=int(need("context_length")),
        rms_norm_eps=float(need("attention.layer_norm_rms_epsilon")),
        rope_theta=float(_field(reader, f"{arch}.rope.freq_base", 10000.0)),
        tie_word_embeddings="output.weight" not in names,
        attention_bias="blk.0.attn_q.bias" in names,
        bos_token_id=_field(reader, "tokenizer.ggml.bos_token_id"),
        eos_token_id=_field(reader, "tokenizer.ggml.eos_token_id"),
    )


def unpermute_rotary_rows(weight: torch.Tensor, num_heads: int) -> torch.Tensor:
    """Undo llama.cpp's q/k row order: within each head, interleaved pairs back to two halves."""
    out_features = weight.shape[0]
    head_dim = out_features // num_heads
    return (weight.reshape(num_heads, head_dim // 2, 2, *weight.shape[1:])
            .transpose(1, 2).reshape(weight.shape))


def _labkit_name(gguf_name: str, path: Path) -> str:
    if gguf_name in _GLOBAL_NAMES:
        return _GLOBAL_NAMES[gguf_name]
    parts = gguf_name.split(".", 2)
    if parts[0] == "blk" and len(parts) == 3 and parts[2] in _LAYER_NAMES:
        return f"layers.{parts[1]}.{_LAYER_NAMES[parts[2]]}"
    raise ModelFileError(f"{path.name}: unexpected tensor {gguf_name!r}")


def open_gguf(path: str | Path) -> gguf.GGUFReader:
    """A reader over a GGUF file; a file it cannot parse raises ModelFileError naming the file.

    Readers are shared: parsing the metadata (the tokenizer's 49,152 tokens and merges, field by
    field in Python) takes seconds, and loading one engine reads the file's config, weights, Q4_1
    blocks and vocabulary. A file rewritten since (new size or modification time) is parsed again."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"no GGUF file at {path}")
    stat = path.stat()
    return _parsed_gguf(path.resolve(), stat.st_size, stat.st_mtime_ns)


@functools.lru_cache(maxsize=2)
def _parsed_gguf(path: Path, size: int, mtime_ns: int) -> gguf.GGUFReader:
    try:
        return gguf.GGUFReader(path)
    except OSError:
        raise
    except Exception as err:  # noqa: BLE001 - the parser meets random bytes in many ways (IndexError, numpy...)
        raise ModelFileError(f"{path} is not a readable GGUF file (truncated or corrupted?): "
                             f"{type(err).__name__}: {err}") from err


def read_gguf_config(path: str | Path) -> ModelConfig:
    """Only the architecture numbers of a GGUF file (no weights are dequantized)."""
    return config_from_gguf(open_gguf(path), Path(path))


def load_gguf(path: str | Path) -> tuple[ModelConfig, dict[str, torch.Tensor]]:
    """The config and the dequantized fp32 weights (labkit names, [out, in] layout) of a GGUF file."""
    path = Path(path)
    reader = open_gguf(path)
    config = config_from_gguf(reader, path)
    state_dict = {}
    for tensor in reader.tensors:
        if tensor.tensor_type not in SUPPORTED_TYPES:
            raise ModelFileError(f"{path.name}: tensor {tensor.name} uses quantization type "
                             f"{tensor.tensor_type.name}, which labkit cannot dequantize "
                             f"(supported: {', '.join(sorted(t.name for t in SUPPORTED_TYPES))})")
        name = _labkit_name(tensor.name, path)
        # GGUF lists dimensions innermost first; numpy wants them outermost first.
        shape = tuple(int(d) for d in reversed(tensor.shape))
        try:
            values = gguf.quants.dequantize(tensor.data, tensor.tensor_type).reshape(shape)
        except ValueError as err:
            raise ModelFileError(f"{path.name}: tensor {tensor.name}'s data does not fill its shape {shape} "
                                 f"(truncated or corrupted file): {err}") from err
        state_dict[name] = _labkit_rows(torch.from_numpy(np.array(values, dtype=np.float32)), name, config)
    return config, state_dict


def _labkit_rows(weight: torch.Tensor, name: str, config: ModelConfig) -> torch.Tensor:
    """A tensor's rows in labkit's order: Llama q/k rows back from llama.cpp's rotary order."""
    if config.architecture == "llama" and name.endswith(("q_proj.weight", "q_proj.bias")):
        return unpermute_rotary_rows(weight, config.num_heads)
    if config.architecture == "llama" and name.endswith(("k_proj.weight", "k_proj.bias")):
        return unpermute_rotary_rows(weight, config.num_kv_heads)
    return weight


Q4_1_BLOCK_BYTES = 20  # fp16 d, fp16 m, then 16 bytes: weight j in the low nibble of byte j, j + 16 in its high


def load_q4_1_blocks(path: str | Path) -> dict[str, tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
    """The file's Q4_1 tensors as stored, by labkit name: (codes uint8 0..15 [out, in], d, m [out, in/32] fp32),
    rows in labkit's order. d * codes + m (per group of 32) is exactly what `load_gguf` dequantizes."""
    path = Path(path)
    reader = open_gguf(path)
    config = config_from_gguf(reader, path)
    blocks = {}
    for tensor in reader.tensors:
        if tensor.tensor_type != T.Q4_1:
            continue
        out_features, in_features = (int(d) for d in reversed(tensor.shape))
        raw = np.asarray(tensor.data, dtype=np.uint8).reshape(out_features, in_features // 32, Q4_1_BLOCK_BYTES)
        scales = raw[..., :4].copy().view(np.float16).astype(np.float32)  # [out, groups, 2]: d, m
        qs = raw[..., 4:]
        codes = np.concatenate((qs & 0x0F, qs >> 4), axis=-1).reshape(out_features, in_features)
        name = _labkit_name(tensor.name, path)
        blocks[name] = tuple(_labkit_rows(torch.from_numpy(np.ascontiguousarray(a)), name, config)
                             for a in (codes, scales[..., 0], scales[..., 1]))
    return blocks
