"""`EngineConfig`: every setting of an engine in one checked record.

    LLM("smollm2", max_num_seqs=16)                          # keywords become an EngineConfig (vLLM's EngineArgs)
    LLM("smollm2", config=EngineConfig(max_num_seqs=16))     # the same engine
    LLM("smollm2", kv_cache_dtype="int8")     # K/V as int8 with per-block scales: ~4x the fp32 blocks
    LLM("smollm2", dtype=torch.bfloat16)      # bf16 weights and K/V (fp32 is the CPU default)
    LLM("smollm2", weight_format="q4_1")      # the GGUF's own 4-bit weights (or "int8"), bf16 activations
    LLM("smollm2", speculative=SpeculativeConfig("ngram", num_speculative_tokens=4))  # see speculative.py
    LLM("smollm2", async_scheduling=True)     # schedule step n+1 while step n runs: see overlap.py

A setting that cannot work is refused when the config is made, by a message naming its field; the
settings that depend on the model (max_model_len's default, and whether it fits the model's
positions) are settled by `for_model` once the model is loaded. The scheduler's settings then make
its `SchedulerConfig` (`config.scheduler`).
"""

import dataclasses
import numbers

import torch

from labkit.attention.paged import BACKENDS
from labkit.cache.kv_quant import KV_CACHE_DTYPES
from labkit.cache.paged_storage import check_block_size
from labkit.engine.components import EngineComponents
from labkit.engine.memory import DEFAULT_CPU_KV_CACHE_BYTES
from labkit.engine.scheduler import SchedulerConfig
from labkit.engine.speculative import SpeculativeConfig
from labkit.model.weight_formats import WEIGHT_FORMATS

DEFAULT_MAX_MODEL_LEN = 2048  # when max_model_len is None: the model's positions, at most this many


@dataclasses.dataclass(frozen=True)
class EngineConfig:
    # the KV cache
    block_size: int = 16  # tokens per KV block
    num_kvcache_blocks: int | None = None  # None: as many as the memory budget holds (memory.py)
    gpu_memory_utilization: float = 0.9  # the share of GPU memory the engine may fill, KV cache included
    cpu_kv_cache_bytes: int = DEFAULT_CPU_KV_CACHE_BYTES  # the KV cache's budget on a CPU
    kv_cache_dtype: str = "auto"  # "auto" (the model's dtype), "int8" or "fp8": see labkit/cache/kv_quant.py
    enable_prefix_caching: bool = True
    # the scheduler (its SchedulerConfig: labkit/engine/scheduler.py)
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 1024
    max_model_len: int | None = None  # prompt + output tokens; None: the model's positions, at most 2048
    enable_chunked_prefill: bool = True
    preemption_mode: str = "recompute"
    long_prefill_token_threshold: int = 0
    priority_aging_steps: int | None = 50
    # the model and how its steps run
    device: str | torch.device | None = None  # None: CUDA when there is one, else the CPU
    dtype: torch.dtype | None = None  # None: float32 on a CPU (labkit.model.load_model says more)
    weight_format: str = "dequantized"  # or "int8", "q4_1": labkit/model/weight_formats.py
    attention_backend: str = "auto"  # "torch", "triton" or "auto" (triton on CUDA)
    use_cuda_graph: bool = True  # capture the decode steps on CUDA (with the triton backend)
    async_scheduling: bool = False  # launch a decode step before the last one's tokens reach the host: overlap.py
    speculative: SpeculativeConfig | None = None  # speculative decoding: labkit/engine/speculative.py
    components: EngineComponents = dataclasses.field(default_factory=EngineComponents)  # components.py; None: ours

    def __post_init__(self):
        for name in ("block_size", "cpu_kv_cache_bytes"):
            _check_positive_int(name, getattr(self, name))
        check_block_size(self.block_size)  # the paged storage's rule, before any weight is loaded
        for name in ("num_kvcache_blocks", "max_model_len"):
            if getattr(self, name) is not None:
                _check_positive_int(name, getattr(self, name), " or None")
        for name in ("enable_prefix_caching", "enable_chunked_prefill", "use_cuda_graph", "async_scheduling"):
            if not isinstance(getattr(self, name), bool):
                raise TypeError(f"{name} must be True or False, got {getattr(self, name)!r}")
        utilization = self.gpu_memory_utilization
        if isinstance(utilization, bool) or not isinstance(utilization, numbers.Real) or not 0 < utilization <= 1:
            raise ValueError(f"gpu_memory_utilization must lie in (0, 1], got {utilization!r}")
        for name, choices in [("kv_cache_dtype", KV_CACHE_DTYPES), ("weight_format", WEIGHT_FORMATS),
                              ("attention_backend", BACKENDS)]:
            if getattr(self, name) not in choices:
                raise ValueError(f"{name} must be one of {choices}, got {getattr(self, name)!r}")
        if self.dtype is not None and not isinstance(self.dtype, torch.dtype):
            raise TypeError(f"dtype must be a torch.dtype (e.g. torch.bfloat16) or None, got {self.dtype!r}")
        if self.components is None:
            object.__setattr__(self, "components", EngineComponents())
        if not isinstance(self.components, EngineComponents):
            raise TypeError(f"components must be an EngineComponents (labkit.engine.components), "
                            f"got {type(self.components).__name__}")
        self._check_speculative()
        if self.async_scheduling and (self.speculative is not None or self.components != EngineComponents()):
            raise ValueError("async_scheduling runs labkit's own block manager, scheduler and model runner, "
                             "without speculative decoding: pass async_scheduling=True alone")
        self._scheduler_config(self.max_model_len or DEFAULT_MAX_MODEL_LEN)  # the scheduler's own checks

    def _check_speculative(self) -> None:
        if self.speculative is None:
            return
        if not isinstance(self.speculative, SpeculativeConfig):
            raise TypeError(f"speculative must be a SpeculativeConfig or None, got {type(self.speculative).__name__}")
        if self.components != EngineComponents():
            raise ValueError("speculative decoding runs with labkit's own block manager, scheduler and model "
                             "runner: pass speculative= or components=, not both")
        if self.kv_cache_dtype != "auto":
            # A rejected draft may have grown its block's scale and re-rounded the codes before it:
            # rolling back the tokens would not roll back the cache.
            raise ValueError(f"speculative decoding needs an unquantized KV cache, got kv_cache_dtype="
                             f"{self.kv_cache_dtype!r}: rejected drafts would leave their mark on the block scales")

    def for_model(self, max_position_embeddings: int) -> "EngineConfig":
        """This config with max_model_len settled for a model of that many positions."""
        if self.max_model_len is None:
            return dataclasses.replace(self, max_model_len=min(max_position_embeddings, DEFAULT_MAX_MODEL_LEN))
        if self.max_model_len > max_position_embeddings:
            raise ValueError(f"max_model_len={self.max_model_len} is beyond the model's {max_position_embeddings} "
                             "positions (max_position_embeddings): its position embeddings end there")
        return self

    @property
    def scheduler(self) -> SchedulerConfig:
        """The scheduler's settings (after `for_model`, which settles max_model_len)."""
        if self.max_model_len is None:
            raise ValueError("max_model_len is settled by the model: call for_model(...) first")
        return self._scheduler_config(self.max_model_len)

    def _scheduler_config(self, max_model_len: int) -> SchedulerConfig:
        return SchedulerConfig(self.max_num_seqs, self.max_num_batched_tokens, max_model_len,
                               self.enable_chunked_prefill, self.preemption_mode,
                               self.long_prefill_token_threshold, self.priority_aging_steps)


def _check_positive_int(name: str, value, alternative: str = "") -> None:
    if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value < 1:
        raise ValueError(f"{name} must be a positive integer{alternative}, got {value!r}")
