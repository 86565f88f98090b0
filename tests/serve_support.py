"""What the serving tests share: a tiny random-weights model with SmolLM2's tokenizer.

Its weights are random (seeded), so its text is gibberish, but it runs the engine's real code at
a millisecond a step, and greedy decoding makes its text deterministic: the server's answers can
be compared token for token with the offline engine's.
"""

import functools
import threading
import time

import torch

from labkit.engine import LLM
from labkit.model.config import ModelConfig
from labkit.model.decoder import DecoderModel
from labkit.tokenizer import load_tokenizer

MODEL_NAME = "tiny-random"


@functools.cache
def tiny_model() -> tuple[DecoderModel, object]:
    tokenizer = load_tokenizer("smollm2")
    config = ModelConfig("llama", vocab_size=len(tokenizer.vocab), hidden_size=32, intermediate_size=64,
                         num_layers=2, num_heads=4, num_kv_heads=2, head_dim=8, max_position_embeddings=2048,
                         rms_norm_eps=1e-5, rope_theta=10000.0, tie_word_embeddings=True,
                         eos_token_id=tokenizer.eos_token_id)
    torch.manual_seed(0)
    model = DecoderModel(config).eval()
    return model, tokenizer


def tiny_llm(**kwargs) -> LLM:
    model, tokenizer = tiny_model()
    kwargs.setdefault("num_kvcache_blocks", 256)
    kwargs.setdefault("max_num_seqs", 16)
    kwargs.setdefault("max_model_len", 1024)
    return LLM(model, tokenizer=tokenizer, **kwargs)


def wait_until(condition, timeout: float = 30.0, what: str = "condition") -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout:.0f} s waiting for {what}")
        time.sleep(0.01)


def assert_engine_idle(llm: LLM) -> None:
    """Nothing queued, running or swapped, and every KV block back in the pool."""
    wait_until(lambda: not llm.has_unfinished_requests() and llm.block_manager.num_used_blocks == 0,
               what="the engine to release every request and block")
    llm.block_manager.check_invariants([])


def server_threads() -> set[threading.Thread]:
    """The threads a server runs in (uvicorn's and the engine loop's) that are alive now."""
    return {t for t in threading.enumerate() if t.name in ("labkit-engine", "labkit-serve")}
