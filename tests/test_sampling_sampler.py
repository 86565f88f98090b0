"""The batched Sampler: draws follow the filtered distribution (chi-square), seeds are batch-independent,
temperature 0 is greedy, and penalties equal transformers' (repetition) and OpenAI's (presence, frequency)."""

import dataclasses

import pytest
import torch
from transformers.generation.logits_process import RepetitionPenaltyLogitsProcessor

from labkit.sampling import (
    Sampler,
    SamplingMetadata,
    SamplingParams,
    apply_penalties,
    filter_logits,
    greedy_tokens,
    token_counts,
)
from labkit.sampling.sampler import gumbel_max, hash32, seeded_uniforms

LOGITS = torch.tensor([2.0, 1.5, 1.0, 0.5, 0.0, -0.5, -1.0, -2.0])  # 8 tokens, a spread of probabilities


def draw(params: SamplingParams, logits: torch.Tensor, n: int, prompt=(), output=()) -> torch.Tensor:
    """n draws for one request, as n rows with seeds 0..n-1 (every row an independent request)."""
    requests = [SamplingParams(**{**params.__dict__, "seed": seed}) for seed in range(n)]
    metadata = SamplingMetadata.from_requests(requests, [list(prompt)] * n, [list(output)] * n)
    return Sampler()(logits.expand(n, -1), metadata)


def chi_square_p_value(tokens: torch.Tensor, probs: torch.Tensor) -> float:
    """Pearson's chi-square test of the draws against `probs`; tokens with probability 0 must never appear.

    The p-value is the chi-square survival function, Q(df / 2, x / 2) (torch.special.gammaincc).
    """
    counts = torch.bincount(tokens, minlength=len(probs)).double()
    support = probs > 0
    assert counts[~support].sum() == 0, "drew a token the filters removed"
    expected = probs[support].double() * len(tokens)
    statistic = ((counts[support] - expected) ** 2 / expected).sum()
    df = int(support.sum()) - 1
    return torch.special.gammaincc(torch.tensor(df / 2, dtype=torch.float64), statistic / 2).item()


METHODS = {
    "plain": SamplingParams(),
    "temperature 0.5": SamplingParams(temperature=0.5),
    "temperature 2": SamplingParams(temperature=2.0),
    "top-k 3": SamplingParams(top_k=3),
    "top-p 0.8": SamplingParams(top_p=0.8),
    "min-p 0.2": SamplingParams(min_p=0.2),
    "all four": SamplingParams(temperature=0.8, top_k=6, top_p=0.9, min_p=0.05),
}


@pytest.mark.parametrize("name", list(METHODS))
def test_draw_frequencies_match_the_filtered_distribution(name):
    params = METHODS[name]
    tokens = draw(params, LOGITS, 20_000)
    filtered = filter_logits(LOGITS, params.temperature, params.top_k, params.top_p, params.min_p)
    p_value = chi_square_p_value(tokens, filtered.softmax(-1))
    assert p_value > 1e-3, f"{name}: p = {p_value:.2e}"
    if not torch.isinf(filtered).any() and params.temperature != 1:  # the test can tell distributions apart
        assert chi_square_p_value(tokens, LOGITS.softmax(-1)) < 1e-6


def test_the_chi_square_check_rejects_a_wrong_distribution():
    tokens = draw(SamplingParams(top_k=3), LOGITS, 20_000)
    assert chi_square_p_value(tokens, filter_logits(LOGITS, top_k=4).softmax(-1)) < 1e-6


def test_draws_along_one_request_follow_the_distribution_step_after_step():
    """One seed, 20,000 successive steps: the per-step uniforms are independent too."""
    n = 20_000
    metadata = SamplingMetadata.from_requests([SamplingParams(seed=1234, top_p=0.9)] * n, [[]] * n, [[]] * n)
    metadata = dataclasses.replace(metadata, steps=torch.arange(n))  # row i: the request at step i
    tokens = Sampler()(LOGITS.expand(n, -1), metadata)
    assert chi_square_p_value(tokens, filter_logits(LOGITS, top_p=0.9).softmax(-1)) > 1e-3


def test_penalized_draws_match_the_penalized_distribution():
    params = SamplingParams(repetition_penalty=1.3, presence_penalty=0.5, frequency_penalty=0.4)
    prompt, output = [0, 5], [1, 1, 2]
    tokens = draw(params, LOGITS, 20_000, prompt, output)
    penalized = LOGITS.clone()
    penalized[[0, 1, 2, 5]] = torch.where(penalized[[0, 1, 2, 5]] > 0, penalized[[0, 1, 2, 5]] / 1.3,
                                          penalized[[0, 1, 2, 5]] * 1.3)
    penalized[1] -= 0.5 + 2 * 0.4
    penalized[2] -= 0.5 + 1 * 0.4
    assert chi_square_p_value(tokens, penalized.softmax(-1)) > 1e-3


def run_batch(requests, histories, logits_by_request, sampler=None):
    """One engine step over the given requests (each with its own logits row and history)."""
    metadata = SamplingMetadata.from_requests(requests, [[]] * len(requests), histories)
    return (sampler or Sampler())(torch.stack(logits_by_request), metadata)


def test_a_seeded_request_draws_the_same_tokens_whatever_shares_its_batch():
    g = torch.Generator().manual_seed(3)
    vocab = 1000
    target = SamplingParams(seed=42, temperature=0.9, top_k=50)
    target_logits = [torch.randn(vocab, generator=g) for _ in range(12)]
    alone = [run_batch([target], [[7] * step], [target_logits[step]]).item() for step in range(12)]
    for position, company in [(0, 3), (2, 3), (5, 7)]:
        together = []
        for step in range(12):
            others = [SamplingParams(seed=step * 10 + j, top_p=0.5) if j % 2 else SamplingParams(temperature=0.3)
                      for j in range(company)]
            requests = others[:position] + [target] + others[position:]
            rows = [torch.randn(vocab, generator=g) for _ in others]
            rows = rows[:position] + [target_logits[step]] + rows[position:]
            histories = [[1] * (j + 3) for j in range(company)]
            histories = histories[:position] + [[7] * step] + histories[position:]
            together.append(run_batch(requests, histories, rows)[position].item())
        assert together == alone, f"row {position} of {company + 1} drew differently"
    assert len(set(alone)) > 3  # it really samples: not the same token every step


def test_a_draw_over_the_filtered_entries_alone_equals_the_draw_over_the_whole_rows():
    """The sampler computes the Gumbel noise only where top-k/top-p left entries: the tokens must be the
    ones the whole-row draw (every entry's uniform, -inf where removed) picks, also with NaN and +inf
    logits, and in batches that keep most entries (the whole-row path)."""
    g = torch.Generator().manual_seed(5)
    for params, vocab in (([SamplingParams(seed=i, top_k=5 + i, temperature=0.7) for i in range(6)], 5000),
                          ([SamplingParams(seed=i, top_p=0.3) for i in range(6)], 5000),
                          ([SamplingParams(seed=i) for i in range(3)] + [SamplingParams(seed=9, top_k=2)], 300)):
        for step in range(20):
            logits = torch.randn(len(params), vocab, generator=g) * 4
            logits[0, step] = float("nan") if step % 3 == 0 else logits[0, step]
            logits[1, step + 1] = float("inf") if step % 4 == 0 else logits[1, step + 1]
            metadata = SamplingMetadata.from_requests(params, [[]] * len(params), [[1] * step] * len(params))
            sampler = Sampler()
            filtered = sampler.filter(logits.clone(), metadata)
            whole_rows = gumbel_max(filtered, seeded_uniforms(metadata.seeds, metadata.steps,
                                                              hash32(torch.arange(vocab))))
            assert torch.equal(sampler(logits, metadata), whole_rows), f"step {step}: {len(params)} x {vocab}"


def test_different_seeds_and_steps_give_different_draws_and_the_same_seed_repeats():
    logits = torch.zeros(1, 50_000)
    one = run_batch([SamplingParams(seed=1)], [[]], [logits[0]])
    assert one == run_batch([SamplingParams(seed=1)], [[]], [logits[0]])
    assert one != run_batch([SamplingParams(seed=2)], [[]], [logits[0]])
    assert one != run_batch([SamplingParams(seed=1)], [[5]], [logits[0]])


def test_unseeded_requests_follow_torch_manual_seed():
    logits = [torch.zeros(50_000)] * 4
    torch.manual_seed(0)
    first = run_batch([SamplingParams()] * 4, [[]] * 4, logits)
    torch.manual_seed(0)
    assert torch.equal(first, run_batch([SamplingParams()] * 4, [[]] * 4, logits))
    assert len(set(first.tolist())) == 4


def test_temperature_zero_is_greedy_in_a_mixed_batch():
    g = torch.Generator().manual_seed(5)
    logits = torch.randn(6, 300, generator=g)
    requests = [SamplingParams(temperature=0, top_k=5, top_p=0.1, seed=s) if s % 2 == 0 else SamplingParams(seed=s)
                for s in range(6)]
    tokens = run_batch(requests, [[]] * 6, list(logits))
    assert torch.equal(tokens[0::2], logits[0::2].argmax(-1))
    all_greedy = run_batch([SamplingParams(temperature=0)] * 6, [[]] * 6, list(logits))
    assert torch.equal(all_greedy, logits.argmax(-1))


def test_greedy_applies_the_penalties_first():
    logits = torch.tensor([[3.0, 2.9, 0.0]])
    metadata = SamplingMetadata.from_requests([SamplingParams(temperature=0, repetition_penalty=1.5)], [[0]], [[]])
    assert Sampler()(logits, metadata).item() == 1


def test_repetition_penalty_equals_transformers_over_prompt_and_output():
    g = torch.Generator().manual_seed(6)
    logits = torch.randn(3, 40, generator=g) * 3
    prompts, outputs = [[1, 2, 3], [4], [5, 5, 6, 7]], [[8, 8], [], [1, 39]]
    requests = [SamplingParams(repetition_penalty=p) for p in (1.3, 0.7, 2.0)]
    metadata = SamplingMetadata.from_requests(requests, prompts, outputs)  # packs histories, -1 padded
    got = apply_penalties(logits, metadata.prompt_token_ids, metadata.output_token_ids,
                          metadata.repetition_penalty, metadata.presence_penalty, metadata.frequency_penalty)
    for row in range(3):
        reference = RepetitionPenaltyLogitsProcessor(requests[row].repetition_penalty)
        history = torch.tensor([prompts[row] + outputs[row]])
        assert torch.equal(got[row], reference(history, logits[row : row + 1].clone())[0])


def test_presence_and_frequency_penalties_count_generated_tokens_only():
    logits = torch.zeros(1, 6)
    prompt, output = torch.tensor([[0, 0, 5]]), torch.tensor([[1, 1, 1, 2, -1]])  # -1 is padding
    got = apply_penalties(logits, prompt, output, torch.ones(1), torch.tensor([0.5]), torch.tensor([0.25]))
    assert torch.allclose(got, torch.tensor([[0.0, -1.25, -0.75, 0.0, 0.0, 0.0]]))  # mu - c * f - (c > 0) * p


def test_token_counts_ignore_padding_and_reject_out_of_range_ids():
    counts = token_counts(torch.tensor([[3, 3, -1], [0, -1, -1]]), vocab_size=4)
    assert counts.tolist() == [[0, 0, 0, 2], [1, 0, 0, 0]]
    with pytest.raises(ValueError, match=r"token ids must be in \[0, 4\)"):
        token_counts(torch.tensor([[4]]), vocab_size=4)


def test_the_sampler_does_not_modify_its_input():
    logits = torch.randn(2, 30, generator=torch.Generator().manual_seed(7))
    before = logits.clone()
    metadata = SamplingMetadata.from_requests(
        [SamplingParams(top_p=0.5, repetition_penalty=1.2, seed=1), SamplingParams(top_k=2)], [[1], [2]], [[3], []])
    Sampler()(logits, metadata)
    assert torch.equal(logits, before)


def test_bad_calls_are_rejected_with_clear_messages():
    with pytest.raises(ValueError, match="one entry per row, got 2, 1 and 2"):
        SamplingMetadata.from_requests([SamplingParams()] * 2, [[]], [[], []])
    with pytest.raises(TypeError, match="sequence of SamplingParams"):
        SamplingMetadata.from_requests([{"temperature": 1.0}], [[]], [[]])
    metadata = SamplingMetadata.from_requests([SamplingParams()] * 2, [[], []], [[], []])
    with pytest.raises(ValueError, match=r"one row per request \(2\), got shape \(3, 10\)"):
        Sampler()(torch.zeros(3, 10), metadata)


@pytest.mark.parametrize("vocab", [49152, 3 * 1024, 1000])
def test_greedy_tokens_equal_torch_max_with_ties_and_nans(vocab):
    """The two-pass argmax picks what torch's max(-1).indices picks: the first of tied maxima (here
    planted in a later block than an earlier copy, and inside one block), and the first NaN."""
    torch.manual_seed(0)
    logits = torch.randn(6, vocab)
    logits[1, vocab - 5] = logits[1, 7] = 10.0             # a tie across blocks: the earlier one wins
    logits[2, 3] = logits[2, 4] = 10.0                     # a tie inside one block
    logits[3, vocab // 2] = logits[3, vocab - 1] = float("nan")
    logits[4] = 0.0                                        # every entry tied
    expected = logits.max(-1).indices
    assert greedy_tokens(logits).tolist() == expected.tolist()
    assert expected[1] == 7 and expected[2] == 3 and expected[3] == vocab // 2 and expected[4] == 0
    bf16 = logits.to(torch.bfloat16)
    assert greedy_tokens(bf16).tolist() == bf16.max(-1).indices.tolist()
