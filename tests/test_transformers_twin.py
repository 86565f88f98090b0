"""transformers_twin: transformers' own Llama and Qwen3 classes holding a labkit model's random weights give
that model's logits, so a model without a file still has an oracle (make gpu-check, bench_nanovllm)."""

import dataclasses

import pytest
import torch

from labkit.model.config import ModelConfig
from labkit.model.random_weights import random_model
from labkit.model.transformers_oracle import transformers_twin

SMALL = ModelConfig(architecture="llama", vocab_size=300, hidden_size=64, intermediate_size=96, num_layers=2,
                    num_heads=4, num_kv_heads=2, head_dim=32, max_position_embeddings=256, rms_norm_eps=1e-6,
                    rope_theta=10000.0, tie_word_embeddings=True)


@pytest.mark.parametrize("config", [SMALL, dataclasses.replace(SMALL, architecture="qwen3", tie_word_embeddings=False),
                                    dataclasses.replace(SMALL, architecture="qwen3", head_dim=48)],
                         ids=["llama", "qwen3-untied", "qwen3-head_dim-48"])
def test_twin_gives_the_models_logits(config):
    model = random_model(config, seed=1)
    twin = transformers_twin(model)
    assert type(twin).__name__ == {"llama": "LlamaForCausalLM", "qwen3": "Qwen3ForCausalLM"}[config.architecture]
    ids = torch.randint(0, config.vocab_size, (19,), generator=torch.Generator().manual_seed(0))
    with torch.inference_mode():
        torch.testing.assert_close(twin(ids[None]).logits[0], model(ids), atol=2e-5, rtol=1e-4)


def test_q_k_norm_weights_reach_the_twin():
    """Qwen3's q/k-norm weights are carried over, not left at transformers' ones."""
    model = random_model(dataclasses.replace(SMALL, architecture="qwen3"), seed=1)
    with torch.no_grad():
        for layer in model.layers:
            layer.self_attn.q_norm.weight.uniform_(0.5, 1.5)
            layer.self_attn.k_norm.weight.uniform_(0.5, 1.5)
    ids = torch.arange(12)
    with torch.inference_mode():
        torch.testing.assert_close(transformers_twin(model)(ids[None]).logits[0], model(ids), atol=2e-5, rtol=1e-4)


def test_rope_scaling_is_refused():
    from labkit.model.config import RopeScaling

    config = dataclasses.replace(SMALL, rope_scaling=RopeScaling(8.0, 1.0, 4.0, 128))
    with pytest.raises(ValueError, match="rope scaling"):
        transformers_twin(random_model(config))
