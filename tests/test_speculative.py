"""Speculative decoding against the engine without it: greedy output identical (a random-weights model
and SmolLM2, batches, prefix caching, tight caches), rejection sampling keeping the target's
distribution (a chi-square test), rollback freeing every block, and the errors for bad options."""

import pytest
import torch
from engine_support import assert_no_leak
from serve_support import tiny_model

from labkit.engine import LLM, SpeculativeConfig
from labkit.engine.speculative import first_layers, ngram_lookup, verify_greedy, verify_sampled
from labkit.model import load_model
from labkit.sampling import BeamSearchParams, SamplingParams
from labkit.tokenizer import load_tokenizer
from labkit_course.engine_parts import EngineParts

PROMPTS = ["1, 2, 3, 1, 2, 3, 1, 2,", "Hello there, hello there, hello", "The capital of France is",
           "a b a b a b a b a b", "The capital of France is Paris. The capital of"]
GREEDY = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)


def tiny_engine(**kwargs):
    model, tokenizer = tiny_model()
    kwargs.setdefault("num_kvcache_blocks", 64)
    return LLM(model, tokenizer=tokenizer, block_size=8, **kwargs)


@pytest.fixture(scope="module")
def plain_tokens():
    return [o.token_ids for o in tiny_engine().generate(PROMPTS, GREEDY)]


@pytest.mark.parametrize("spec", [SpeculativeConfig("ngram", 3), SpeculativeConfig("ngram", 1, prompt_lookup_max=1),
                                  SpeculativeConfig("draft_model", 4, draft_model=first_layers(tiny_model()[0], 1))],
                         ids=["ngram-k3", "unigram-k1", "draft-model-k4"])
@pytest.mark.parametrize("engine_kwargs", [{}, {"num_kvcache_blocks": 12, "max_num_seqs": 3},
                                           {"max_num_batched_tokens": 8, "enable_prefix_caching": False}],
                         ids=["roomy", "tight-cache", "small-budget"])
def test_greedy_output_is_the_plain_engines(plain_tokens, spec, engine_kwargs):
    llm = tiny_engine(speculative=spec, **engine_kwargs)
    assert [o.token_ids for o in llm.generate(PROMPTS, GREEDY)] == plain_tokens
    m = llm.metrics
    assert m.num_draft_tokens > 0 and 0 < m.num_accepted_draft_tokens <= m.num_draft_tokens
    assert 1 < m.tokens_per_target_forward <= spec.num_speculative_tokens + 1
    assert_no_leak(llm)


def test_metrics_count_each_run_after_a_reset():
    llm = tiny_engine(speculative=SpeculativeConfig("ngram", 3))
    llm.generate(PROMPTS, GREEDY)
    first = (llm.metrics.num_draft_tokens, llm.metrics.num_accepted_draft_tokens, llm.metrics.num_verify_passes)
    llm.reset_metrics()
    llm.generate(PROMPTS, GREEDY)  # the same work again: the same counts, not twice them
    assert (llm.metrics.num_draft_tokens, llm.metrics.num_accepted_draft_tokens,
            llm.metrics.num_verify_passes) == first
    assert_no_leak(llm)


def test_rollback_leaves_each_table_no_longer_than_its_tokens_need():
    model, _ = tiny_model()
    llm = tiny_engine(speculative=SpeculativeConfig("draft_model", 4, draft_model=first_layers(model, 1)))
    ids = [llm.add_request(p, GREEDY) for p in PROMPTS]
    while llm.has_unfinished_requests():
        llm.step()
        live = [s for s in llm.scheduler.running]
        llm.block_manager.check_invariants(live)
        for seq in live:
            assert len(seq.block_table) <= llm.block_manager.blocks_needed(seq.num_tokens)
    assert llm.metrics.num_accepted_draft_tokens < llm.metrics.num_draft_tokens, "no draft was ever rejected"
    assert len(ids) == llm.metrics.num_finished
    assert_no_leak(llm)


def test_greedy_smollm2_with_a_truncated_draft_model_and_prompt_lookup():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        model, tokenizer = load_model("smollm2", device="cpu"), load_tokenizer("smollm2")
        prompts = ["1, 2, 3, 4, 5, 6,", "def add(a, b):\n    return a + b\n\ndef sub(a, b):\n"]
        params = SamplingParams(temperature=0, max_tokens=8)
        plain = LLM(model, tokenizer=tokenizer, num_kvcache_blocks=32).generate(prompts, params)
        # A quarter of the layers guesses poorly (it may have every draft rejected): the output must not change.
        draft = first_layers(model, 8)
        for spec in (SpeculativeConfig("ngram", 3), SpeculativeConfig("draft_model", 3, draft_model=draft)):
            llm = LLM(model, tokenizer=tokenizer, num_kvcache_blocks=32, speculative=spec)
            assert [o.token_ids for o in llm.generate(prompts, params)] == [o.token_ids for o in plain]
            assert llm.metrics.num_draft_tokens > 0
            if spec.method == "ngram":  # the counting and the repeated code are found in the prompt
                assert llm.metrics.num_accepted_draft_tokens > 0
            assert_no_leak(llm)
    finally:
        torch.set_num_threads(threads)


def chi_square(counts: torch.Tensor, probs: torch.Tensor) -> float:
    expected = probs * counts.sum()
    return float(((counts - expected) ** 2 / expected).sum())


# The 0.999 quantile of chi-square with 4 degrees of freedom (five categories), from a standard table:
# a correct sampler fails this test once in a thousand seeds; this seed is fixed.
CHI2_4DOF_999 = 18.467


@pytest.mark.parametrize("drafter", ["model", "deterministic"])
def test_rejection_sampling_keeps_the_target_distribution(drafter):
    """The first token verify_sampled emits, over many draws, follows p (not q) in both cases."""
    generator = torch.Generator().manual_seed(0)
    p = torch.tensor([[0.1, 0.4, 0.2, 0.25, 0.05], [0.3, 0.1, 0.2, 0.2, 0.2]])
    q = torch.tensor([[0.5, 0.1, 0.1, 0.1, 0.2]])
    counts = torch.zeros(5)
    for _ in range(6000):
        if drafter == "model":
            guess = int(torch.multinomial(q[0], 1, generator=generator))
            first = verify_sampled(p, [guess], q, generator)[0]
        else:  # a fixed guess, as prompt lookup makes: q is one-hot
            first = verify_sampled(p, [0], None, generator)[0]
        counts[first] += 1
    assert chi_square(counts, p[0]) < CHI2_4DOF_999, counts
    # Against a wrong target the same statistic is huge: the test can fail.
    assert chi_square(counts, q[0]) > 10 * CHI2_4DOF_999


def test_verification_rules():
    logits = torch.tensor([[0.0, 5, 0], [0, 0, 5], [5, 0, 0]])
    assert verify_greedy(logits, [1, 2]) == [1, 2, 0]  # both kept, then the bonus token
    assert verify_greedy(logits, [1, 0]) == [1, 2]  # the mismatch is replaced by the target's choice
    assert verify_greedy(logits[:1], []) == [1]
    g = torch.Generator().manual_seed(0)
    certain = torch.tensor([[0.0, 1, 0], [1, 0, 0]])
    assert verify_sampled(certain, [1], None, g) == [1, 0]
    assert verify_sampled(certain, [2], None, g) == [1]  # p(2) = 0: always rejected


def test_ngram_lookup():
    assert ngram_lookup([1, 2, 3, 9, 1, 2, 3], 2, max_n=3) == [9, 1]
    assert ngram_lookup([5, 5, 5, 5], 3, max_n=2) == [5, 5]  # the first occurrence leaves the most after it
    assert ngram_lookup([1, 2, 3, 4], 3, max_n=3) == []
    assert ngram_lookup([7, 1, 8, 2, 1], 4, max_n=3, min_n=2) == []  # only a 1-gram recurs


def test_sampling_with_a_seed_is_reproducible_and_finishes_cleanly():
    model, _ = tiny_model()
    params = SamplingParams(temperature=0.8, max_tokens=20, seed=7)
    runs = []
    for _ in range(2):
        llm = tiny_engine(speculative=SpeculativeConfig("draft_model", 3, draft_model=first_layers(model, 1)))
        runs.append([o.token_ids for o in llm.generate(PROMPTS, params)])
        assert_no_leak(llm)
    assert runs[0] == runs[1] and all(len(t) == 20 or t[-1] == llm.eos_token_id for t in runs[0])


def test_bad_options_are_named():
    model, tokenizer = tiny_model()
    for kwargs, message in [({"num_speculative_tokens": 0}, "num_speculative_tokens"),
                            ({"method": "eagle"}, "'ngram' or 'draft_model'"),
                            ({"method": "draft_model"}, "needs draft_model"),
                            ({"prompt_lookup_min": 3, "prompt_lookup_max": 2}, "prompt_lookup_min")]:
        with pytest.raises(ValueError, match=message):
            SpeculativeConfig(**kwargs)
    with pytest.raises(ValueError, match="num_layers"):
        first_layers(model, 3)
    with pytest.raises(TypeError, match="SpeculativeConfig"):
        tiny_engine(speculative={"method": "ngram"})
    with pytest.raises(ValueError, match="unquantized KV cache"):
        tiny_engine(speculative=SpeculativeConfig("ngram"), kv_cache_dtype="int8")
    with pytest.raises(ValueError, match="not both"):
        tiny_engine(speculative=SpeculativeConfig("ngram"), components=EngineParts().components())
    small_vocab = type(model)(type(model.config)(**{**model.config.__dict__, "vocab_size": 100}))
    with pytest.raises(ValueError, match="vocabulary"):
        tiny_engine(speculative=SpeculativeConfig("draft_model", draft_model=small_vocab))
    llm = tiny_engine(speculative=SpeculativeConfig("ngram"))
    for params, name in [(SamplingParams(n=2), "n > 1"), (SamplingParams(top_p=0.9), "top_p"),
                         (SamplingParams(logprobs=1), "logprobs"),
                         (SamplingParams(repetition_penalty=1.2), "penalties")]:
        with pytest.raises(ValueError, match=name):
            llm.generate("Hi", params)
    with pytest.raises(ValueError, match="beam_search"):
        llm.beam_search(["Hi"], BeamSearchParams(beam_width=2, max_tokens=2))
    assert_no_leak(llm)


def test_engine_sampling_with_drafts_follows_the_target_distribution():
    """Through the whole engine: a model of 8 tokens, a prompt in which every token recurs (prompt
    lookup always drafts), and the pair (t1, t2) of the first two output tokens over 1000 seeded
    requests. t1 comes from the prefill; t2 is the first token a verifying forward emits, so given t1
    it must follow the model's own p(t2 | prompt, t1): one chi-square test over the 8 rows (56 degrees
    of freedom, p-value from torch's regularized incomplete gamma function)."""
    _, tokenizer = tiny_model()
    from labkit.model.config import ModelConfig
    from labkit.model.decoder import DecoderModel

    config = ModelConfig("llama", vocab_size=8, hidden_size=32, intermediate_size=64, num_layers=2, num_heads=4,
                         num_kv_heads=2, head_dim=8, max_position_embeddings=64, rms_norm_eps=1e-5,
                         rope_theta=10000.0, tie_word_embeddings=False, eos_token_id=None)
    torch.manual_seed(3)
    model = DecoderModel(config).eval()
    prompt = list(range(8)) * 2
    with torch.inference_mode():
        rows = torch.stack([torch.softmax(model(torch.tensor(prompt + [t]))[-1], -1) for t in range(8)]).double()
    llm = LLM(model, tokenizer=tokenizer, num_kvcache_blocks=256, max_num_seqs=64, max_model_len=64,
              speculative=SpeculativeConfig("ngram", 3))
    params = [SamplingParams(temperature=1.0, max_tokens=3, ignore_eos=True, seed=s) for s in range(1000)]
    outputs = llm.generate([prompt] * len(params), params)
    counts = torch.zeros(8, 8, dtype=torch.double)
    for o in outputs:
        counts[o.token_ids[0], o.token_ids[1]] += 1
    assert llm.metrics.num_accepted_draft_tokens > 0
    expected = counts.sum(1, keepdim=True) * rows
    statistic = float(((counts - expected) ** 2 / expected.clamp_min(1e-12)).sum())
    p_value = float(torch.special.gammaincc(torch.tensor(56 / 2, dtype=torch.double),
                                            torch.tensor(statistic / 2, dtype=torch.double)))
    assert p_value > 0.001, (statistic, counts)
    assert_no_leak(llm)


def test_stream_and_stop_strings_see_every_verified_token(plain_tokens):
    """Several tokens arrive per step: streaming still yields the whole text, and a stop token that
    falls among accepted drafts ends the request there, as without speculation."""
    llm = tiny_engine(speculative=SpeculativeConfig("ngram", 3))
    text = llm.generate(PROMPTS[0], GREEDY)[0].text
    assert "".join(llm.stream(PROMPTS[0], GREEDY)) == text
    stop_at = plain_tokens[0][5]
    params = SamplingParams(temperature=0, max_tokens=24, stop_token_ids=[stop_at])
    plain = tiny_engine().generate(PROMPTS[0], params)[0]
    speculated = llm.generate(PROMPTS[0], params)[0]
    assert speculated.token_ids == plain.token_ids and speculated.finish_reason == plain.finish_reason
    assert_no_leak(llm)
