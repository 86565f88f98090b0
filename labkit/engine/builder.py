"""Building an engine from its config: load the model and tokenizer, size the KV cache, make the
paged storage, block manager, scheduler and model runner, and pick the fast path of the steps.

`LLM.__init__` is `build_engine` plus the engine's bookkeeping; everything here happens once.
"""

import dataclasses
import warnings

import torch

from labkit.attention.paged import PagedAttentionBackend, resolve_backend
from labkit.cache.paged_storage import PagedKVStorage
from labkit.device import pick_device
from labkit.engine.config import EngineConfig
from labkit.engine.cuda_graph import capture_sizes
from labkit.engine.memory import num_blocks_for_memory, profile_cuda_memory
from labkit.engine.speculative import SpeculativeDecoder
from labkit.model import DecoderModel, load_model
from labkit.model.fused_decode import FusedDecoder
from labkit.tokenizer import load_tokenizer


@dataclasses.dataclass(frozen=True)
class BuiltEngine:
    config: EngineConfig  # as given, with max_model_len and num_kvcache_blocks settled
    model: DecoderModel
    tokenizer: object
    storage: PagedKVStorage
    block_manager: object
    scheduler: object
    runner: object
    speculative: SpeculativeDecoder | None
    eos_token_id: int | None


def build_engine(model, tokenizer, config: EngineConfig) -> BuiltEngine:
    """`model`: a name, a .gguf path or an HF folder, or an already-loaded DecoderModel (several
    engines can share one), which then needs its `tokenizer`."""
    if isinstance(model, DecoderModel):
        if tokenizer is None:
            raise ValueError("an already-loaded model needs its tokenizer: pass tokenizer=")
        if config.weight_format != "dequantized":
            raise ValueError(f"weight_format={config.weight_format!r} is chosen when the model is loaded: pass its "
                             f"name or path, or load it with labkit.model.load_model(..., weight_format=...)")
        loaded = model
    else:
        device = pick_device(None if config.device is None else str(config.device))
        loaded = load_model(model, device=device, dtype=config.dtype, weight_format=config.weight_format,
                            prepack=True)
        tokenizer = load_tokenizer(model) if tokenizer is None else tokenizer
    model_config = loaded.config
    config = config.for_model(model_config.max_position_embeddings)
    use_graphs = (config.use_cuda_graph and loaded.device.type == "cuda"
                  and resolve_backend(config.attention_backend, loaded.device) == "triton")
    if config.num_kvcache_blocks is None:
        config = dataclasses.replace(config, num_kvcache_blocks=_num_blocks(loaded, config, use_graphs))
    storage = PagedKVStorage(model_config.num_layers, config.num_kvcache_blocks, config.block_size,
                             model_config.num_kv_heads, model_config.head_dim, dtype=loaded.dtype,
                             device=loaded.device, kv_cache_dtype=config.kv_cache_dtype)
    components = config.components
    block_manager = components.block_manager(config.num_kvcache_blocks, config.block_size,
                                             enable_prefix_caching=config.enable_prefix_caching)
    scheduler = components.scheduler(config.scheduler, block_manager, storage)
    backend = PagedAttentionBackend(storage, config.attention_backend)
    runner = components.model_runner(loaded, storage, backend, _fast_path(loaded, storage, backend, config, use_graphs))
    speculative = None if config.speculative is None else SpeculativeDecoder(
        config.speculative, runner, block_manager, storage, scheduler.config, model_config.vocab_size)
    eos_token_id = model_config.eos_token_id if model_config.eos_token_id is not None else tokenizer.eos_token_id
    return BuiltEngine(config, loaded, tokenizer, storage, block_manager, scheduler, runner, speculative, eos_token_id)


def _num_blocks(model: DecoderModel, config: EngineConfig, use_graphs: bool) -> int:
    """As many KV blocks as the memory budget holds (memory.py): on CUDA, after vLLM's profile run,
    since the largest step's activations must fit too."""
    profile = None
    if model.device.type == "cuda":
        largest_decode = min(config.max_num_seqs, config.max_num_batched_tokens) if use_graphs else 0
        profile = profile_cuda_memory(model, config.max_num_batched_tokens, config.max_num_seqs, largest_decode)
    return num_blocks_for_memory(model.config, config.block_size, model.dtype, profile=profile,
                                 gpu_memory_utilization=config.gpu_memory_utilization,
                                 cpu_kv_cache_bytes=config.cpu_kv_cache_bytes, max_model_len=config.max_model_len,
                                 kv_cache_dtype=config.kv_cache_dtype)


def _fast_path(model, storage, backend, config: EngineConfig, use_graphs: bool):
    """What runs the steps instead of the eager model, if anything: CUDA graphs of the decode steps,
    or the fused C step on a CPU (fused_decode.py says when it applies)."""
    if use_graphs:
        sizes = capture_sizes(config.max_num_seqs, config.max_num_batched_tokens, config.num_kvcache_blocks)
        return _capture_decode_graphs(model, backend, sizes, -(-config.max_model_len // config.block_size),
                                      config.max_model_len)
    if backend.reads_pool_in_c and FusedDecoder.unsupported(model, storage) is None:
        return FusedDecoder(model, storage, backend)
    return None


def _capture_decode_graphs(model, backend, sizes, max_blocks, max_model_len):
    """CUDA graphs for decode steps, or None (with a warning) if capturing fails: eager still works."""
    from labkit.engine.cuda_graph import DecodeGraphs

    try:
        with torch.inference_mode():
            return DecodeGraphs(model, backend, sizes, max_blocks, max_model_len)
    except Exception as error:  # noqa: BLE001 - any capture failure means: run without graphs
        warnings.warn(f"CUDA graph capture failed, decoding without graphs: {error}", stacklevel=5)
        return None
