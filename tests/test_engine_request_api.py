"""vLLM's request API on SmolLM2, against transformers: logprobs, n samples, processors, beam search.

Every engine here shares one labkit model; transformers' model on the same GGUF file is the
oracle. Each test ends by checking that every KV block is back in the pool.
"""

import dataclasses

import pytest
import torch
from engine_support import assert_no_leak

from labkit.engine import LLM
from labkit.model import load_model
from labkit.model.transformers_oracle import load_transformers_model
from labkit.sampling import BeamSearchParams, SamplingParams
from labkit.tokenizer import load_tokenizer

CHAT = "<|im_start|>user\n{}<|im_end|>\n<|im_start|>assistant\n"
LONG = "Once upon a time, in a small village at the edge of a large forest, there lived an old clockmaker"


@pytest.fixture(scope="module")
def smollm2():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    hf, _ = load_transformers_model("smollm2")
    yield load_model("smollm2", device="cpu"), load_tokenizer("smollm2"), hf
    torch.set_num_threads(threads)


def engine(smollm2, **kwargs):
    model, tokenizer, _ = smollm2
    kwargs.setdefault("num_kvcache_blocks", 64)
    return LLM(model, tokenizer=tokenizer, **kwargs)




def hf_logprobs(hf, token_ids):
    """transformers' fp32 log-softmax at every position of `token_ids`: row i predicts token i + 1."""
    with torch.no_grad():
        return torch.log_softmax(hf(torch.tensor([token_ids])).logits[0].float(), dim=-1)


def assert_position_matches(position, expected_row, token, k):
    """One position's dict: the token's own logprob and rank, and the k best tokens, as transformers has them."""
    assert position[token].logprob == pytest.approx(expected_row[token].item(), abs=1e-4)
    assert position[token].rank == int((expected_row >= expected_row[token]).sum())
    values, ids = expected_row.topk(k)
    assert set(position) == {token, *ids.tolist()}
    for rank, (t, v) in enumerate(zip(ids.tolist(), values.tolist(), strict=True), 1):
        assert position[t].logprob == pytest.approx(v, abs=1e-4)
        assert t == token or position[t].rank == rank


@pytest.mark.parametrize("temperature", [0.0, 0.8])
def test_logprobs_and_prompt_logprobs_equal_transformers_log_softmax(smollm2, temperature):
    _, tokenizer, hf = smollm2
    # A 16-token budget prefills the long prompt in chunks; the prompt is cached first, so the
    # prompt_logprobs request must recompute what the prefix cache would have served.
    llm = engine(smollm2, max_num_batched_tokens=16)
    llm.generate(LONG, SamplingParams(temperature=0, max_tokens=1))
    params = SamplingParams(temperature=temperature, seed=3, max_tokens=6, logprobs=5, prompt_logprobs=3,
                            ignore_eos=True)
    out = llm.generate([LONG, "Hi"], params)
    for request, prompt in zip(out, [LONG, "Hi"], strict=True):
        sample = request.outputs[0]
        ids = tokenizer.encode(prompt) + sample.token_ids
        expected = hf_logprobs(hf, ids)
        num_prompt = len(request.prompt_token_ids)
        assert request.prompt_logprobs[0] is None and len(request.prompt_logprobs) == num_prompt
        for i in range(1, num_prompt):
            assert_position_matches(request.prompt_logprobs[i], expected[i - 1], ids[i], 3)
        assert len(sample.logprobs) == len(sample.token_ids)
        for j, (position, token) in enumerate(zip(sample.logprobs, sample.token_ids, strict=True)):
            assert_position_matches(position, expected[num_prompt - 1 + j], token, 5)
            assert position[token].decoded_token == tokenizer.decode([token])
        own = [position[token].logprob for position, token in zip(sample.logprobs, sample.token_ids, strict=True)]
        assert sample.cumulative_logprob == pytest.approx(sum(own), abs=1e-5)
    plain = llm.generate("Hi", SamplingParams(max_tokens=2))[0]
    assert plain.prompt_logprobs is None and plain.outputs[0].logprobs is None
    assert plain.outputs[0].cumulative_logprob is None
    assert_no_leak(llm)


def count_copies(llm):
    """Wrap the storage's copy_blocks to count copy-on-write copies."""
    copies = []
    original = llm.storage.copy_blocks
    llm.storage.copy_blocks = lambda pairs: (copies.extend(pairs), original(pairs))
    return copies


def test_n_seeded_samples_are_reproducible_independent_of_the_batch_and_share_the_prompt(smollm2):
    params = SamplingParams(n=4, seed=7, temperature=1.0, top_p=0.95, max_tokens=8, ignore_eos=True)
    prompt = "The capital of France is"  # 5 tokens: the last prompt block is partial, so forks share it
    llm = engine(smollm2)
    copies = count_copies(llm)
    alone = llm.generate(prompt, params)[0]
    assert [c.index for c in alone.outputs] == [0, 1, 2, 3] and alone.finished
    texts = [c.token_ids for c in alone.outputs]
    assert len(set(map(tuple, texts))) > 1, "the samples must differ from one another"
    assert len(copies) == 3, "each forked sample copies the shared partial block once, the first one keeps it"
    assert_no_leak(llm)

    # In a batch with other requests (one also sampling n > 1), in another row, on a cache small
    # enough to preempt: the same four samples.
    small = engine(smollm2, num_kvcache_blocks=6, max_num_seqs=7)  # 2 + 4 + 1 samples: all of them at once
    others = [SamplingParams(n=2, seed=1, max_tokens=10, ignore_eos=True), SamplingParams(max_tokens=9, seed=5)]
    batch = small.generate(["Hello there", prompt, LONG], [others[0], params, others[1]])
    assert [c.token_ids for c in batch[1].outputs] == texts
    assert small.metrics.num_preemptions > 0
    assert_no_leak(small)

    # vLLM's rule: sample i draws with seed + i, exactly as a single request with that seed does,
    # so the K/V the forked samples read through shared and copied blocks is the prompt's.
    for i, tokens in enumerate(texts):
        single = llm.generate(prompt, dataclasses.replace(params, n=1, seed=7 + i))[0]
        assert single.token_ids == tokens
    assert_no_leak(llm)


def test_aborting_a_request_with_n_samples_frees_every_sample(smollm2):
    llm = engine(smollm2)
    request_id = llm.add_request("Hello", SamplingParams(n=3, max_tokens=20))
    llm.step()
    llm.step()
    assert len(llm.scheduler.running) == 3
    llm.abort(request_id)
    assert_no_leak(llm)
    with pytest.raises(ValueError, match="stream yields the text of one sample: n must be 1"):
        next(llm.stream("Hello", SamplingParams(n=2)))
    assert_no_leak(llm)


def hf_greedy(hf, ids, max_new_tokens, **kwargs):
    with torch.no_grad():
        out = hf.generate(torch.tensor([ids]), attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                          max_new_tokens=max_new_tokens, do_sample=False, eos_token_id=2, pad_token_id=2, **kwargs)
    return out[0, len(ids):].tolist()


def test_min_tokens_logit_bias_and_allowed_token_ids_equal_transformers_processors(smollm2):
    _, tokenizer, hf = smollm2
    llm = engine(smollm2)
    prompt = CHAT.format("Is the sky blue? Answer yes or no.")
    ids = tokenizer.encode(prompt)
    free = llm.generate(prompt, SamplingParams(temperature=0, max_tokens=12))[0]
    assert free.token_ids[-1] == llm.eos_token_id and len(free.token_ids) < 8  # ends early on its own
    min_tokens = llm.generate(prompt, SamplingParams(temperature=0, max_tokens=12, min_tokens=8))[0]
    assert min_tokens.token_ids == hf_greedy(hf, ids, 12, min_new_tokens=8)
    assert llm.eos_token_id not in min_tokens.token_ids[:8]

    bias = {free.token_ids[0]: -5.0, 6022: 3.0}
    biased = llm.generate(prompt, SamplingParams(temperature=0, max_tokens=6, logit_bias=bias))[0]
    expected = hf_greedy(hf, ids, 6, sequence_bias={(t,): b for t, b in bias.items()})
    assert biased.token_ids == expected and biased.token_ids[0] != free.token_ids[0]

    allowed = [28, 29, 30, 198, 2]
    constrained = llm.generate(prompt, SamplingParams(temperature=0, max_tokens=6, allowed_token_ids=allowed))[0]
    assert constrained.token_ids == hf_greedy(hf, ids, 6, prefix_allowed_tokens_fn=lambda batch, sent: allowed)
    sampled = llm.generate(prompt, SamplingParams(temperature=1.5, seed=0, max_tokens=12, ignore_eos=True,
                                                  allowed_token_ids=allowed))[0]
    assert set(sampled.token_ids) <= set(allowed)
    assert_no_leak(llm)


def test_include_stop_str_in_output(smollm2):
    llm = engine(smollm2)
    cut, kept = llm.generate(["1, 2, 3,", "1, 2, 3,"], [
        SamplingParams(temperature=0, max_tokens=10, stop=[" 5"]),
        SamplingParams(temperature=0, max_tokens=10, stop=[" 5"], include_stop_str_in_output=True)])
    assert cut.text == " 4," and kept.text == " 4, 5"
    assert cut.stop_reason == kept.stop_reason == " 5" and cut.token_ids == kept.token_ids
    assert_no_leak(llm)


@pytest.mark.parametrize(("field", "value", "message"), [
    ("n", 0, "n must be an integer >= 1"),
    ("logprobs", 21, r"logprobs must be None or an integer in \[0, 20\]"),
    ("prompt_logprobs", -1, r"prompt_logprobs must be None or an integer in \[0, 20\]"),
    ("min_tokens", 17, r"min_tokens must be an integer in \[0, max_tokens=16\]"),
    ("logit_bias", {5: float("inf")}, "logit_bias must be a dict of token id"),
    ("logit_bias", [5, 1.0], "logit_bias must be a dict of token id"),
    ("allowed_token_ids", [], "allowed_token_ids must be None or a non-empty list"),
    ("allowed_token_ids", [-1], "allowed_token_ids must be None or a non-empty list"),
    ("include_stop_str_in_output", 1, "include_stop_str_in_output must be True or False"),
])
def test_bad_request_fields_are_named(field, value, message):
    with pytest.raises(ValueError, match=message):
        SamplingParams(**{field: value})


def test_token_ids_beyond_the_vocabulary_and_too_many_samples_are_refused(smollm2):
    llm = engine(smollm2, max_num_seqs=4)
    vocab = llm.model.config.vocab_size
    for field, value in [("logit_bias", {vocab: 1.0}), ("allowed_token_ids", [1, vocab]),
                         ("stop_token_ids", [vocab + 5])]:
        with pytest.raises(ValueError, match=f"{field} must hold token ids below the vocabulary size {vocab}"):
            llm.generate("Hi", SamplingParams(**{field: value}))
    with pytest.raises(ValueError, match="n=5 samples cannot run at once with max_num_seqs=4"):
        llm.generate("Hi", SamplingParams(n=5))
    assert_no_leak(llm)


LAB06_BEAM = CHAT.format("What is the capital of France? Answer in a few words.")
BEAM_CASES = [  # prompt, beam width, max tokens, length penalty: Lab 06's case first
    (LAB06_BEAM, 3, 7, 1.0),
    ("The capital of France is", 3, 8, 1.0),
    (CHAT.format("What is 2+2?"), 2, 8, 0.0),
]


@pytest.mark.parametrize(("prompt", "beam_width", "max_tokens", "length_penalty"), BEAM_CASES)
def test_beam_search_in_the_engine_equals_transformers(smollm2, prompt, beam_width, max_tokens, length_penalty):
    _, tokenizer, hf = smollm2
    ids = tokenizer.encode(prompt)
    with torch.no_grad():
        expected = hf.generate(torch.tensor([ids]), attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                               num_beams=beam_width, do_sample=False, max_new_tokens=max_tokens,
                               length_penalty=length_penalty, early_stopping=False, num_return_sequences=beam_width,
                               eos_token_id=2, pad_token_id=2, return_dict_in_generate=True, output_scores=True)
    lengths = (expected.beam_indices != -1).sum(-1)
    expected_ids = [row[len(ids): len(ids) + n].tolist() for row, n in zip(expected.sequences, lengths, strict=True)]

    llm = engine(smollm2)
    copies = count_copies(llm)
    computed = []
    forward = llm.runner.forward
    llm.runner.forward = lambda seqs, num_new: (computed.append(list(num_new)), forward(seqs, num_new))[1]
    out = llm.beam_search([prompt], BeamSearchParams(beam_width, max_tokens, length_penalty=length_penalty))[0]
    assert [s.tokens[len(ids):] for s in out.sequences] == expected_ids
    assert all(s.tokens[:len(ids)] == ids for s in out.sequences)
    torch.testing.assert_close(torch.tensor([s.score for s in out.sequences]), expected.sequences_scores,
                               atol=1e-4, rtol=0)
    for s in out.sequences:
        ended = s.tokens[-1] == llm.eos_token_id
        assert s.finish_reason == ("stop" if ended else "length")
        assert s.text == tokenizer.decode(s.tokens[len(ids): len(s.tokens) - ended])
    # The prompt is computed once; afterwards every step computes one token per beam, and beams
    # that branch share their blocks (a partial block is copied when a branch writes into it).
    assert computed[0] == [len(ids)] and all(set(step) == {1} for step in computed[1:])
    assert copies, "no beam ever shared a partial block"
    assert_no_leak(llm)


def test_beam_search_arguments_and_its_interplay_with_queued_requests(smollm2):
    llm = engine(smollm2)
    ignore = llm.beam_search({"prompt_token_ids": [504, 3575, 282]}, BeamSearchParams(2, 3, ignore_eos=True))[0]
    assert all(len(s.tokens) == 6 and s.finish_reason == "length" for s in ignore.sequences)
    for kwargs, message in [({"beam_width": 0, "max_tokens": 2}, "beam_width must be an integer >= 1"),
                            ({"beam_width": 2, "max_tokens": 2, "temperature": -1.0}, "temperature must be finite"),
                            ({"beam_width": 2, "max_tokens": 2, "length_penalty": float("nan")}, "length_penalty")]:
        with pytest.raises(ValueError, match=message):
            BeamSearchParams(**kwargs)
    with pytest.raises(ValueError, match="needs one of 'prompt' or 'prompt_token_ids'"):
        llm.beam_search({"text": "Hi"}, BeamSearchParams(2, 2))
    llm.add_request("Hello", SamplingParams(max_tokens=2))
    with pytest.raises(RuntimeError, match="beam_search runs alone"):
        llm.beam_search("Hi", BeamSearchParams(2, 2))
    llm.generate("Hi", SamplingParams(max_tokens=1))  # also finishes the queued request... by stepping
    while llm.has_unfinished_requests():
        llm.step()
    assert_no_leak(llm)
