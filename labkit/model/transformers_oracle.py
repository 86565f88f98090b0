"""transformers' own model on the same GGUF file: the oracle labkit is compared with.

Tests, benchmarks and Lab 11 all need it. `from_pretrained(..., gguf_file=)` would pull in the
`accelerate` package; building the model from the file's config and loading the tensors that
transformers' own GGUF reader dequantizes gives the same weights without it. transformers parses
the file once for the config, once for the tensors (and once for a tokenizer) and rebuilds gguf's
tensor-name map each time: caching both during the load turns about a minute into seconds.
"""

import functools
from unittest import mock

import torch

from labkit.registry import resolve_model_path


def load_transformers_model(name_or_path="smollm2", with_tokenizer: bool = False,
                            dtype: torch.dtype = torch.float32, device: torch.device | str = "cpu"):
    """(model, tokenizer or None): transformers' model from a GGUF file, in eval mode."""
    import gguf
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer
    from transformers.initialization import no_init_weights
    from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

    path = resolve_model_path(name_or_path)
    if path.suffix != ".gguf":
        raise ValueError(f"the transformers oracle reads GGUF files; {path} is not one")
    tokenizer = None
    with (mock.patch("gguf.GGUFReader", functools.cache(gguf.GGUFReader)),
          mock.patch("gguf.get_tensor_name_map", functools.cache(gguf.get_tensor_name_map)),
          # no progress bar: a notebook cell would keep it in its stored output
          mock.patch("transformers.modeling_gguf_pytorch_utils.tqdm", lambda items, **_: items)):
        config = AutoConfig.from_pretrained(str(path.parent), gguf_file=path.name)
        with no_init_weights():  # every weight comes from the file
            model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
        weights = load_gguf_checkpoint(str(path), return_tensors=True, model_to_load=model)["tensors"]
        if with_tokenizer:
            tokenizer = AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
    missing = model.load_state_dict(weights, strict=False).missing_keys
    expected_missing = ["lm_head.weight"] if config.tie_word_embeddings else []
    if missing != expected_missing:
        raise RuntimeError(f"transformers' model is missing weights from {path.name}: {missing}")
    model.tie_weights()  # from_config leaves a tied head untied until asked
    return model.to(device=device, dtype=dtype).eval(), tokenizer


def transformers_twin(model, device: torch.device | str | None = None, dtype: torch.dtype | None = None):
    """transformers' Llama or Qwen3 model (LlamaForCausalLM, Qwen3ForCausalLM) holding a labkit model's
    own weights (e.g. random ones), in eval mode.

    The oracle for a model that has no file, such as `labkit.model.random_weights.random_model`.
    """
    from transformers import LlamaConfig, LlamaForCausalLM, Qwen3Config, Qwen3ForCausalLM
    from transformers.initialization import no_init_weights

    c = model.config
    classes = {"llama": (LlamaConfig, LlamaForCausalLM), "qwen3": (Qwen3Config, Qwen3ForCausalLM)}
    if c.architecture not in classes:
        raise ValueError(f"transformers_twin builds Llama and Qwen3 models, got a {c.architecture!r} config")
    if c.rope_scaling is not None:
        raise ValueError("transformers_twin does not carry Llama-3 rope scaling over")
    config_class, model_class = classes[c.architecture]
    hf_config = config_class(
        vocab_size=c.vocab_size, hidden_size=c.hidden_size, intermediate_size=c.intermediate_size,
        num_hidden_layers=c.num_layers, num_attention_heads=c.num_heads, num_key_value_heads=c.num_kv_heads,
        head_dim=c.head_dim, max_position_embeddings=c.max_position_embeddings, rms_norm_eps=c.rms_norm_eps,
        rope_theta=c.rope_theta, tie_word_embeddings=c.tie_word_embeddings, attention_bias=c.attention_bias,
        bos_token_id=c.bos_token_id, eos_token_id=c.eos_token_id,
    )
    with no_init_weights():
        hf = model_class(hf_config)
    state = {name if name == "lm_head.weight" else f"model.{name}": tensor
             for name, tensor in model.state_dict().items()}
    hf.load_state_dict(state, strict=not c.tie_word_embeddings, assign=True)
    hf.tie_weights()
    return hf.to(device=device or model.device, dtype=dtype or model.dtype).eval().requires_grad_(False)
