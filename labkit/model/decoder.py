"""A Llama-family decoder-only transformer over a flat batch of tokens.

`model(input_ids)` runs one sequence at positions 0..T-1 and returns its logits. The engine uses the
full form: the new tokens of many sequences concatenated, their positions, the step's attention
metadata and an attention backend (dense, contiguous KV cache, paged). Parameter names match
Hugging Face's Llama/Qwen3 checkpoints without the "model." prefix, so their state dicts load as is.
"""

import torch
from torch import nn

from labkit.attention.dense import dense_attention
from labkit.attention.metadata import AttentionBackend, AttentionMetadata
from labkit.model.config import ModelConfig
from labkit.model.layers import DecoderLayer, RMSNorm, residual_dtype, rope_cos_sin, rope_inv_freq
from labkit.registry import ModelFileError


class DecoderModel(nn.Module):
    def __init__(self, config: ModelConfig):
        super().__init__()
        self.config = config
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(config, i) for i in range(config.num_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        if config.tie_word_embeddings:
            self.lm_head.weight = self.embed_tokens.weight

    @property
    def device(self) -> torch.device:
        return self.embed_tokens.weight.device

    @property
    def dtype(self) -> torch.dtype:
        return self.embed_tokens.weight.dtype

    def forward_hidden(self, input_ids: torch.Tensor, positions: torch.Tensor,
                       attn_metadata: AttentionMetadata, backend: AttentionBackend) -> torch.Tensor:
        """Final-norm hidden states [T, hidden_size] of the T new tokens."""
        if input_ids.shape != positions.shape:
            raise ValueError(f"positions {tuple(positions.shape)} must match input_ids {tuple(input_ids.shape)}")
        inv_freq = rope_inv_freq(self.config.head_dim, self.config.rope_theta, self.config.rope_scaling,
                                 device=input_ids.device)
        cos, sin = rope_cos_sin(positions, inv_freq, self.dtype)
        x = self.embed_tokens(input_ids).to(residual_dtype(self.dtype))
        for layer in self.layers:
            x = layer(x, cos, sin, attn_metadata, backend)
        return self.norm(x)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Vocabulary scores [N, vocab_size] for the rows of `hidden` that need a next token."""
        return self.lm_head(hidden)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor | None = None,
                attn_metadata: AttentionMetadata | None = None,
                backend: AttentionBackend | None = None) -> torch.Tensor:
        """Logits [T, vocab_size]; with only input_ids, one causal sequence at positions 0..T-1."""
        if not isinstance(input_ids, torch.Tensor) or input_ids.dim() != 1 or input_ids.dtype != torch.long:
            got = (f"{input_ids.dtype} tensor of shape {tuple(input_ids.shape)}"
                   if isinstance(input_ids, torch.Tensor) else type(input_ids).__name__)
            raise TypeError(f"input_ids must be a 1-D LongTensor of token ids (a flat batch), got {got}")
        T = input_ids.shape[0]
        if T == 0:
            raise ValueError("input_ids is empty: there is nothing to run")
        if int(input_ids.min()) < 0 or int(input_ids.max()) >= self.config.vocab_size:
            raise ValueError(f"input_ids must lie in [0, {self.config.vocab_size}), "
                             f"got values from {int(input_ids.min())} to {int(input_ids.max())}")
        if positions is None:
            positions = torch.arange(T, device=input_ids.device)
        if attn_metadata is None:
            attn_metadata = AttentionMetadata.causal([T], device=input_ids.device)
        if backend is None:
            backend = dense_attention
        return self.compute_logits(self.forward_hidden(input_ids, positions, attn_metadata, backend))

    @classmethod
    def from_state_dict(cls, config: ModelConfig, state_dict: dict[str, torch.Tensor],
                        device: torch.device | str = "cpu", dtype: torch.dtype = torch.float32,
                        source: str = "checkpoint") -> "DecoderModel":
        """Build the model around loaded weights without first filling it with random ones.

        Every expected tensor must be present with its exact shape and finite values (random bytes
        in a file decode to NaN weights); a tied LM head may be absent.
        `source` names the file in error messages.
        """
        with torch.device("meta"):
            model = cls(config)
        expected = {name: tuple(p.shape) for name, p in model.state_dict().items()}
        if config.tie_word_embeddings:
            state_dict = {k: v for k, v in state_dict.items() if k != "lm_head.weight"}
            expected.pop("lm_head.weight")
        missing = sorted(expected.keys() - state_dict.keys())
        unexpected = sorted(state_dict.keys() - expected.keys())
        if missing or unexpected:
            raise ModelFileError(
                f"{source} does not match a {config.architecture} model with this config: "
                f"missing {missing[:5]}{' ...' if len(missing) > 5 else ''}, "
                f"unexpected {unexpected[:5]}{' ...' if len(unexpected) > 5 else ''}"
            )
        for name, shape in expected.items():
            if tuple(state_dict[name].shape) != shape:
                raise ModelFileError(
                    f"{source}: tensor {name} has shape {tuple(state_dict[name].shape)}, "
                    f"but the config implies {shape}"
                )
            if state_dict[name].is_floating_point() and not torch.isfinite(state_dict[name]).all():
                raise ModelFileError(f"{source}: tensor {name} holds NaN or infinite values: the file is corrupted")
        weights = {name: t.to(device=device, dtype=dtype) for name, t in state_dict.items()}
        model.load_state_dict(weights, strict=not config.tie_word_embeddings, assign=True)
        if config.tie_word_embeddings:
            model.lm_head.weight = model.embed_tokens.weight
        model.eval().requires_grad_(False)
        return model
