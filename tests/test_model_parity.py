"""SmolLM2-135M-Instruct from its GGUF file: labkit against transformers on the same weights.

transformers reads the same file with its own GGUF code (its own dequantization and q/k
un-permutation), so agreement checks labkit's loader as well as its decoder.
"""

import pytest
import torch

from labkit.cache import KVCache, PreallocatedKVCache
from labkit.model import generate, load_model
from labkit.model.perplexity import perplexity
from labkit.model.transformers_oracle import load_transformers_model
from labkit_course.data import HELDOUT_ESSAY, data_path

PROMPTS = [
    "The capital of France is",
    "def fibonacci(n):\n    ",
    "<|im_start|>user\nWhat is a KV cache?<|im_end|>\n<|im_start|>assistant\n",
]


@pytest.fixture(scope="module")
def smollm2():
    hf, tokenizer = load_transformers_model("smollm2", with_tokenizer=True)
    assert hf.lm_head.weight.data_ptr() == hf.model.embed_tokens.weight.data_ptr()
    return tokenizer, hf, load_model("smollm2", device="cpu")


def test_config_matches_the_published_architecture(smollm2):
    _, hf, model = smollm2
    c = model.config
    assert (c.num_layers, c.num_heads, c.num_kv_heads, c.head_dim, c.hidden_size) == (30, 9, 3, 64, 576)
    assert (c.vocab_size, c.intermediate_size, c.rope_theta, c.tie_word_embeddings) == (49152, 1536, 1e5, True)
    assert (c.bos_token_id, c.eos_token_id) == (hf.config.bos_token_id, hf.config.eos_token_id)
    assert c.kv_cache_bytes_per_token(dtype_bytes=2) == 22.5 * 1024  # Lab 02's SmolLM2 row
    assert model.dtype == torch.float32 and not any(p.requires_grad for p in model.parameters())


@pytest.mark.parametrize("text", PROMPTS)
def test_logits_match_transformers(smollm2, text):
    tokenizer, hf, model = smollm2
    ids = torch.tensor(tokenizer(text)["input_ids"])
    with torch.no_grad():
        expected = hf(ids[None]).logits[0]
    assert (model(ids) - expected).abs().max() < 1e-4


def test_perplexity_matches_transformers_loss(smollm2):
    """Lab 12's perplexity on (the start of) its held-out text: exp of transformers' own shifted loss."""
    tokenizer, hf, model = smollm2
    ids = tokenizer(data_path(HELDOUT_ESSAY).read_text())["input_ids"][:256]
    with torch.no_grad():
        loss = hf(torch.tensor([ids]), labels=torch.tensor([ids])).loss
    assert perplexity(model, ids) == pytest.approx(torch.exp(loss).item(), rel=1e-4)


def test_greedy_64_tokens_match_transformers(smollm2):
    tokenizer, hf, model = smollm2
    ids = tokenizer(PROMPTS[0])["input_ids"]
    with torch.no_grad():
        expected = hf.generate(torch.tensor([ids]), max_new_tokens=64, do_sample=False)[0, len(ids):]
    cache = PreallocatedKVCache.for_model(model, max_seq_len=len(ids) + 64)
    got = generate(model, ids, 64, kv_cache=cache, eos_token_id=model.config.eos_token_id)
    assert got.tolist() == expected.tolist()


def test_generation_with_and_without_cache_is_identical(smollm2):
    tokenizer, _, model = smollm2
    ids = tokenizer(PROMPTS[1])["input_ids"]
    without = generate(model, ids, 16)
    with_cache = generate(model, ids, 16, kv_cache=KVCache(model.config.num_layers))
    assert without.tolist() == with_cache.tolist()


def test_a_cache_that_is_not_empty_is_refused(smollm2):
    _, _, model = smollm2
    cache = KVCache(model.config.num_layers)
    generate(model, [1, 2, 3], 2, kv_cache=cache)
    with pytest.raises(ValueError, match="kv_cache must start empty"):
        generate(model, [1, 2, 3], 2, kv_cache=cache)


def test_a_full_preallocated_cache_says_so(smollm2):
    _, _, model = smollm2
    with pytest.raises(ValueError, match="KV cache full"):
        generate(model, [1, 2, 3], 8, kv_cache=PreallocatedKVCache.for_model(model, max_seq_len=6))
