"""EngineConfig (labkit/engine/config.py): the keywords LLM takes are its fields, a setting that cannot
work is refused by name before any model is loaded, and the engine keeps the config it ran with
(max_model_len and the KV cache's size settled)."""

import dataclasses

import pytest
from engine_support import tiny_model_and_tokenizer

from labkit.engine import LLM
from labkit.engine.components import EngineComponents
from labkit.engine.config import EngineConfig
from labkit.engine.speculative import SpeculativeConfig
from labkit.sampling import SamplingParams


@pytest.mark.parametrize(("settings", "error", "message"), [
    ({"block_size": 0}, ValueError, "block_size must be a positive integer"),
    ({"block_size": 12}, ValueError, "block_size must be a power of two >= 8, got 12"),
    ({"num_kvcache_blocks": 2.5}, ValueError, "num_kvcache_blocks must be a positive integer or None"),
    ({"max_model_len": True}, ValueError, "max_model_len must be a positive integer or None"),
    ({"max_num_seqs": 0}, ValueError, "max_num_seqs must be a positive integer"),
    ({"preemption_mode": "evict"}, ValueError, "preemption_mode must be 'recompute' or 'swap'"),
    ({"gpu_memory_utilization": 1.5}, ValueError, r"gpu_memory_utilization must lie in \(0, 1\]"),
    ({"kv_cache_dtype": "int4"}, ValueError, "kv_cache_dtype must be one of"),
    ({"weight_format": "q8"}, ValueError, "weight_format must be one of"),
    ({"attention_backend": "flash"}, ValueError, "attention_backend must be one of"),
    ({"enable_prefix_caching": "yes"}, TypeError, "enable_prefix_caching must be True or False"),
    ({"dtype": "bfloat16"}, TypeError, "dtype must be a torch.dtype"),
    ({"components": {"scheduler": None}}, TypeError, "components must be an EngineComponents"),
    ({"speculative": {"method": "ngram"}}, TypeError, "speculative must be a SpeculativeConfig"),
    ({"speculative": SpeculativeConfig("ngram"), "kv_cache_dtype": "int8"}, ValueError, "unquantized KV cache"),
    ({"speculative": SpeculativeConfig("ngram"), "components": EngineComponents(scheduler=lambda *a: None)},
     ValueError, "not both"),
])
def test_a_setting_that_cannot_work_is_refused_by_name(settings, error, message):
    with pytest.raises(error, match=message):
        EngineConfig(**settings)
    with pytest.raises(error, match=message):
        LLM("no-such-model", **settings)  # refused before the model is looked for


def test_keywords_and_a_config_build_the_same_engine():
    model, tokenizer = tiny_model_and_tokenizer()
    settings = {"block_size": 8, "num_kvcache_blocks": 40, "max_num_seqs": 4, "max_model_len": 128}
    by_keywords = LLM(model, tokenizer=tokenizer, **settings)
    by_config = LLM(model, tokenizer=tokenizer, config=EngineConfig(**settings))
    assert by_keywords.config == by_config.config == EngineConfig(**settings, components=None)  # None: labkit's own
    assert by_keywords.scheduler.config == by_config.config.scheduler
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    assert by_keywords.generate([1, 2, 3], params)[0].token_ids == by_config.generate([1, 2, 3], params)[0].token_ids
    with pytest.raises(TypeError, match="not both"):
        LLM(model, tokenizer=tokenizer, config=EngineConfig(), max_num_seqs=4)
    with pytest.raises(TypeError, match="max_num_seq"):
        LLM(model, tokenizer=tokenizer, max_num_seq=4)  # a misspelt setting is no setting


def test_the_engine_keeps_the_settings_the_model_and_memory_settled():
    model, tokenizer = tiny_model_and_tokenizer()  # 512 positions
    llm = LLM(model, tokenizer=tokenizer, block_size=8, cpu_kv_cache_bytes=1 << 20)
    per_block = 2 * model.config.num_layers * 8 * model.config.num_kv_heads * model.config.head_dim * 4
    assert llm.config.max_model_len == 512 and llm.config.num_kvcache_blocks == llm.block_manager.num_blocks
    assert llm.config.num_kvcache_blocks == (1 << 20) // per_block
    assert dataclasses.replace(llm.config, max_model_len=None, num_kvcache_blocks=None) == EngineConfig(
        block_size=8, cpu_kv_cache_bytes=1 << 20)
    with pytest.raises(ValueError, match="settled by the model"):
        _ = EngineConfig().scheduler
