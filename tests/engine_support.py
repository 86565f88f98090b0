"""Helpers the engine tests share: a tiny model, the leak check every test ends with, a step loop
that survives interrupts, and what raises them."""

import torch

from labkit.engine import LLM
from labkit.model import DecoderModel, ModelConfig
from labkit.tokenizer import load_tokenizer


def tiny_model_and_tokenizer():
    """(model, tokenizer): 2 layers, hidden 32, SmolLM2's vocabulary (so its tokenizer detokenizes the
    outputs); the LM head scaled up so greedy choices are clear-cut."""
    torch.manual_seed(0)
    tokenizer = load_tokenizer("smollm2")
    config = ModelConfig(architecture="llama", vocab_size=len(tokenizer.vocab), hidden_size=32,
                         intermediate_size=64, num_layers=2, num_heads=4, num_kv_heads=2, head_dim=8,
                         max_position_embeddings=512, rms_norm_eps=1e-5, rope_theta=10000.0,
                         tie_word_embeddings=False)
    model = DecoderModel(config).eval()
    with torch.no_grad():
        model.lm_head.weight.mul_(20)
    return model, tokenizer


def engine(tiny, **kwargs):
    """An engine on the tiny model: 64 KV blocks of 8 tokens unless `kwargs` say otherwise."""
    model, tokenizer = tiny
    kwargs.setdefault("num_kvcache_blocks", 64)
    kwargs.setdefault("block_size", 8)
    return LLM(model, tokenizer=tokenizer, **kwargs)


def prompt(i, length=6):
    """Prompt i: `length` token ids, different for each i."""
    return [100 + (7 * i + j) % 900 for j in range(length)]


def assert_no_leak(llm):
    """Nothing left behind: no request, buffered output, claimed id or detokenizer, and every KV block free."""
    assert not llm.has_unfinished_requests()
    assert not llm._requests and not llm._outputs and not llm._claimed
    assert not llm.output_processor._text, "a detokenizer outlived its request"
    assert llm._overlap is None or (llm._overlap.pending is None and not llm._overlap.parked), (
        "an overlapped step outlived its requests")
    llm.block_manager.check_invariants([])
    assert llm.block_manager.num_free_blocks == llm.block_manager.num_blocks, "KV blocks leaked"


def step_through_interrupts(llm, max_steps):
    """Step until every request finishes, swallowing KeyboardInterrupt as a user pressing Ctrl-C would
    (and then stepping on); returns the last output of each request."""
    outputs, steps = {}, 0
    while llm.has_unfinished_requests():
        steps += 1
        assert steps < max_steps
        try:
            outputs.update((o.request_id, o) for o in llm.step())
        except KeyboardInterrupt:
            pass
    return outputs


class Interrupter:
    """Wraps a callable; every `every`-th call raises KeyboardInterrupt instead of (or, with
    `after=True`, after) doing its work."""

    def __init__(self, fn, every, after=False):
        self.fn, self.every, self.after, self.calls, self.fired = fn, every, after, 0, 0

    def __call__(self, *args, **kwargs):
        self.calls += 1
        fire = self.calls % self.every == 0
        if fire and not self.after:
            self.fired += 1
            raise KeyboardInterrupt
        result = self.fn(*args, **kwargs)
        if fire:
            self.fired += 1
            raise KeyboardInterrupt
        return result
