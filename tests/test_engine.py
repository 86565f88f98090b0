"""The whole engine on SmolLM2-135M against transformers, plus its API's behaviour and failure paths.

SmolLM2 (labkit's and transformers') is loaded once for the module; every engine below shares
labkit's copy. Outputs are short so the module stays well under a minute and a half.
"""

import copy

import pytest
import torch
from engine_support import assert_no_leak

from labkit.engine import LLM, FinishReason
from labkit.model import load_model
from labkit.model.transformers_oracle import load_transformers_model
from labkit.sampling import SamplingParams
from labkit.tokenizer import load_tokenizer

PROMPTS = [
    "The capital of France is",
    "def fibonacci(n):\n    ",
    "<|im_start|>user\nWhat is a KV cache? Answer briefly.<|im_end|>\n<|im_start|>assistant\n",
    "1, 2, 3, 4,",
    "Once upon a time, in a small village at the edge of a large forest, there lived an old",
    "Hi",
]
MAX_TOKENS = 12
GREEDY = SamplingParams(temperature=0, max_tokens=MAX_TOKENS)


@pytest.fixture(scope="module")
def smollm2():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # 2 threads on a busy 2-core machine are many times slower than 1
    hf, _ = load_transformers_model("smollm2")
    model, tokenizer = load_model("smollm2", device="cpu"), load_tokenizer("smollm2")
    expected = []
    with torch.inference_mode():
        for text in PROMPTS:
            ids = tokenizer.encode(text)
            out = hf.generate(torch.tensor([ids]), attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                              max_new_tokens=MAX_TOKENS, do_sample=False, eos_token_id=model.config.eos_token_id,
                              pad_token_id=model.config.eos_token_id)
            expected.append(out[0, len(ids):].tolist())
    yield model, tokenizer, expected
    torch.set_num_threads(threads)


def engine(smollm2, **kwargs):
    model, tokenizer, _ = smollm2
    kwargs.setdefault("num_kvcache_blocks", 64)
    return LLM(model, tokenizer=tokenizer, **kwargs)




def test_greedy_matches_transformers_and_prefix_cache_hits_agree(smollm2):
    _, tokenizer, expected = smollm2
    llm = engine(smollm2)
    outputs = llm.generate(PROMPTS, GREEDY)
    assert [o.token_ids for o in outputs] == expected
    for out, text in zip(outputs, PROMPTS, strict=True):
        assert out.prompt == text and out.text == tokenizer.decode(out.token_ids, skip_special_tokens=True)
        ended_on_eos = out.token_ids[-1] == llm.eos_token_id
        assert out.finish_reason is (FinishReason.EOS if ended_on_eos else FinishReason.MAX_TOKENS)
        assert out.metrics.ttft > 0 and out.metrics.num_output_tokens == len(out.token_ids)
    assert_no_leak(llm)
    again = llm.generate(PROMPTS, GREEDY)  # now served partly from the prefix cache
    assert llm.block_manager.stats.hit_tokens > 0 and llm.metrics.prefix_cache_hit_rate > 0
    assert [o.token_ids for o in again] == expected
    assert sum(o.metrics.num_prefix_cached_tokens for o in again) > 0
    assert_no_leak(llm)


@pytest.mark.parametrize("mode", ["recompute", "swap"])
def test_greedy_matches_with_a_cache_small_enough_to_preempt(smollm2, mode):
    _, _, expected = smollm2
    # 8 blocks of 8 tokens hold the longest request (21 + 12 tokens) but not all six at once; a
    # 16-token budget also splits the longer prompts into chunks.
    llm = engine(smollm2, block_size=8, num_kvcache_blocks=8, max_num_batched_tokens=16, preemption_mode=mode)
    outputs = llm.generate(PROMPTS, GREEDY)
    assert [o.token_ids for o in outputs] == expected
    if mode == "swap":
        assert llm.metrics.num_swaps > 0
    else:
        assert llm.metrics.num_preemptions > 0
    assert sum(o.metrics.num_preemptions for o in outputs) > 0
    assert_no_leak(llm)


def test_seeded_sampling_does_not_depend_on_the_batch(smollm2):
    llm = engine(smollm2)
    seeded = SamplingParams(temperature=0.9, top_p=0.95, top_k=50, max_tokens=8, seed=1234, ignore_eos=True)
    alone = llm.generate([PROMPTS[4]], seeded)[0].token_ids
    others = [SamplingParams(temperature=1.0, max_tokens=6, seed=s) for s in range(3)]
    batch = llm.generate(PROMPTS[:3] + [PROMPTS[4]], others + [seeded])
    assert batch[3].token_ids == alone
    different_seed = llm.generate([PROMPTS[4]], SamplingParams(temperature=0.9, top_p=0.95, top_k=50,
                                                               max_tokens=8, seed=99, ignore_eos=True))
    assert different_seed[0].token_ids != alone
    assert_no_leak(llm)


def test_stop_strings_stream_and_chat(smollm2):
    llm = engine(smollm2)
    full = llm.generate(PROMPTS[3], SamplingParams(temperature=0, max_tokens=10))[0]
    assert full.text.startswith(" 5, 6")
    stopped = llm.generate(PROMPTS[3], SamplingParams(temperature=0, max_tokens=10, stop=[" 7"]))[0]
    assert stopped.finish_reason is FinishReason.STOP and stopped.stop_reason == " 7"
    assert stopped.text == full.text[: full.text.index(" 7")]
    pieces = list(llm.stream(PROMPTS[3], SamplingParams(temperature=0, max_tokens=10)))
    assert len(pieces) > 1 and "".join(pieces) == full.text
    chat = llm.chat([{"role": "user", "content": "What is the capital of France?"}],
                    SamplingParams(temperature=0, max_tokens=8))[0]
    assert chat.prompt.startswith("<|im_start|>") and chat.prompt.endswith("<|im_start|>assistant\n")
    assert "Paris" in chat.text
    assert_no_leak(llm)


def test_abort_and_closing_a_stream_release_everything(smollm2):
    llm = engine(smollm2)
    request = llm.add_request(PROMPTS[4], SamplingParams(temperature=0, max_tokens=50))
    llm.step()
    llm.abort(request)
    with pytest.raises(ValueError, match="no unfinished request"):
        llm.abort(request)
    stream = llm.stream(PROMPTS[0], SamplingParams(temperature=0, max_tokens=50))
    next(stream)
    stream.close()
    assert_no_leak(llm)
    assert llm.metrics.finished[0].num_output_tokens == 1


def test_bad_inputs_get_clear_errors_and_leave_the_engine_usable(smollm2):
    _, _, expected = smollm2
    llm = engine(smollm2, block_size=8, num_kvcache_blocks=8, max_model_len=96)  # the cache holds 64 tokens
    with pytest.raises(ValueError, match="prompt is empty"):
        llm.generate("", GREEDY)
    with pytest.raises(TypeError, match="prompt must be a str"):
        llm.generate([PROMPTS[0], 42], GREEDY)  # the good prompt is not left queued either
    with pytest.raises(TypeError, match="prompt must be a str"):
        llm.generate([None], GREEDY)
    with pytest.raises(ValueError, match="max_tokens"):
        llm.generate(PROMPTS[0], SamplingParams(max_tokens=0))
    with pytest.raises(ValueError, match="max_model_len"):
        llm.generate("word " * 100, GREEDY)
    with pytest.raises(ValueError, match="KV blocks"):
        llm.generate(PROMPTS[0], SamplingParams(max_tokens=70))  # 5 + 70 tokens: more than the whole cache
    with pytest.raises(ValueError, match="3 entries for 2 prompts"):
        llm.generate(PROMPTS[:2], [GREEDY] * 3)
    with pytest.raises(FileNotFoundError, match="unknown model"):
        LLM("no-such-model")
    assert not llm.has_unfinished_requests()
    assert llm.generate(PROMPTS[0], GREEDY)[0].token_ids == expected[0]
    assert_no_leak(llm)


def test_bfloat16_engine_follows_its_own_dense_forward_where_the_choice_is_clear(smollm2):
    """The engine in bf16 (bench_engine's --dtype): KV storage, paged attention and sampling in that
    dtype pick the same first token as the same bf16 weights run densely, for every prompt whose
    top two logits are clearly apart (a near tie may flip either way under bf16 rounding)."""
    model, tokenizer, _ = smollm2
    bf16 = copy.deepcopy(model).to(torch.bfloat16)
    llm = LLM(bf16, tokenizer=tokenizer, num_kvcache_blocks=64)
    assert llm.storage.kv.dtype == torch.bfloat16
    outputs = llm.generate(PROMPTS, SamplingParams(temperature=0, max_tokens=4, ignore_eos=True))
    clear = 0
    with torch.inference_mode():
        for text, out in zip(PROMPTS, outputs, strict=True):
            top2 = bf16(torch.tensor(tokenizer.encode(text)))[-1].float().topk(2)
            if top2.values[0] - top2.values[1] > 0.5:
                clear += 1
                assert out.token_ids[0] == int(top2.indices[0]), text
            assert len(out.token_ids) == 4
    assert clear >= 3
    assert_no_leak(llm)
