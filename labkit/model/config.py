"""The numbers that define a Llama-family decoder, whichever file they were read from.

One dataclass covers Llama (1/2/3, SmolLM2) and Qwen3; the only architectural switch is `qk_norm`
(Qwen3 normalises each head's query and key before rotary). Loaders fill it from GGUF metadata or a
Hugging Face config.json; the engine sizes its KV cache from it.
"""

from dataclasses import dataclass

SUPPORTED_ARCHITECTURES = ("llama", "qwen3")


@dataclass(frozen=True)
class RopeScaling:
    """Llama-3's frequency-dependent stretch of the rotary wavelengths (rope_type "llama3")."""

    factor: float
    low_freq_factor: float
    high_freq_factor: float
    original_max_position_embeddings: int


@dataclass(frozen=True)
class ModelConfig:
    architecture: str  # "llama" or "qwen3"
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    max_position_embeddings: int
    rms_norm_eps: float
    rope_theta: float
    tie_word_embeddings: bool
    rope_scaling: RopeScaling | None = None
    attention_bias: bool = False
    bos_token_id: int | None = None
    eos_token_id: int | None = None

    def __post_init__(self):
        if self.architecture not in SUPPORTED_ARCHITECTURES:
            raise ValueError(
                f"unsupported architecture {self.architecture!r}; labkit runs {', '.join(SUPPORTED_ARCHITECTURES)}"
            )
        for name in ("vocab_size", "hidden_size", "intermediate_size", "num_layers", "num_heads",
                     "num_kv_heads", "head_dim", "max_position_embeddings"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be a positive integer, got {value!r}")
        if self.num_heads % self.num_kv_heads:
            raise ValueError(
                f"num_heads ({self.num_heads}) must be a multiple of num_kv_heads ({self.num_kv_heads}) "
                "for grouped-query attention"
            )
        if self.head_dim % 2:
            raise ValueError(f"head_dim must be even for rotary embeddings, got {self.head_dim}")

    @property
    def qk_norm(self) -> bool:
        """Qwen3 applies an RMSNorm to every query and key head before rotary."""
        return self.architecture == "qwen3"

    def kv_cache_bytes_per_token(self, dtype_bytes: int = 2) -> int:
        """K and V, every layer, every KV head: 2 * L * H_kv * D_h * bytes."""
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim * dtype_bytes

    @classmethod
    def from_hf_dict(cls, cfg: dict) -> "ModelConfig":
        """Read a Hugging Face config.json (old `rope_theta`/`rope_scaling` or new `rope_parameters`)."""
        arch = cfg.get("model_type")
        if arch not in SUPPORTED_ARCHITECTURES:
            raise ValueError(
                f"unsupported model_type {arch!r} in config.json (architectures={cfg.get('architectures')}); "
                f"labkit runs {', '.join(SUPPORTED_ARCHITECTURES)}"
            )
        if cfg.get("use_sliding_window"):
            raise ValueError("sliding-window attention (use_sliding_window=true) is not supported")
        rope = dict(cfg.get("rope_scaling") or {})
        rope.update(cfg.get("rope_parameters") or {})
        rope_theta = rope.get("rope_theta", cfg.get("rope_theta", 10000.0))
        rope_type = rope.get("rope_type", rope.get("type", "default"))
        if rope_type == "llama3":
            scaling = RopeScaling(
                factor=float(rope["factor"]),
                low_freq_factor=float(rope["low_freq_factor"]),
                high_freq_factor=float(rope["high_freq_factor"]),
                original_max_position_embeddings=int(rope["original_max_position_embeddings"]),
            )
        elif rope_type == "default":
            scaling = None
        else:
            raise ValueError(f"unsupported rope_type {rope_type!r}; labkit supports 'default' and 'llama3'")
        num_heads = cfg["num_attention_heads"]
        eos = cfg.get("eos_token_id")
        return cls(
            architecture=arch,
            vocab_size=cfg["vocab_size"],
            hidden_size=cfg["hidden_size"],
            intermediate_size=cfg["intermediate_size"],
            num_layers=cfg["num_hidden_layers"],
            num_heads=num_heads,
            num_kv_heads=cfg.get("num_key_value_heads") or num_heads,
            head_dim=cfg.get("head_dim") or cfg["hidden_size"] // num_heads,
            max_position_embeddings=cfg.get("max_position_embeddings", 2048),
            rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
            rope_theta=float(rope_theta),
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
            rope_scaling=scaling,
            attention_bias=bool(cfg.get("attention_bias", False)),
            bos_token_id=cfg.get("bos_token_id"),
            eos_token_id=eos[0] if isinstance(eos, list) else eos,
        )
