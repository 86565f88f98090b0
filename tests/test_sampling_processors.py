"""allowed_token_ids, logit_bias and min_tokens: the additive tensor, the sampler, and the stop check."""

import dataclasses

import pytest
import torch

from labkit.sampling import Sampler, SamplingMetadata, SamplingParams, check_stop
from labkit.sampling.processors import logit_offsets, min_tokens_banned

EOS = 0
VOCAB = 6


def test_each_processor_shapes_its_own_row_only():
    params = [SamplingParams(), SamplingParams(allowed_token_ids=[2, 4]), SamplingParams(logit_bias={1: 2.5, 3: -1.0}),
              SamplingParams(min_tokens=2, stop_token_ids=[5]), SamplingParams(min_tokens=2, ignore_eos=True)]
    offsets = logit_offsets(params, [0, 0, 0, 1, 1], EOS, VOCAB)
    inf = float("-inf")
    assert offsets.tolist() == [
        [0, 0, 0, 0, 0, 0],
        [inf, inf, 0, inf, 0, inf],
        [0, 2.5, 0, -1.0, 0, 0],
        [inf, 0, 0, 0, 0, inf],  # EOS and the stop token, while 1 < min_tokens
        [0, 0, 0, 0, 0, 0],  # ignore_eos: EOS is not a stop, so it is not masked
    ]
    assert logit_offsets([SamplingParams(min_tokens=2)], [2], EOS, VOCAB) is None  # reached: nothing to build
    assert min_tokens_banned(SamplingParams(min_tokens=3, stop_token_ids=[4]), 2, EOS) == [4, EOS]


def test_the_sampler_never_picks_a_masked_token_greedy_or_sampled():
    logits = torch.tensor([[5.0, 4.0, 3.0, 2.0, 1.0, 0.0]]).expand(4, -1)
    params = [SamplingParams(temperature=0, min_tokens=1), SamplingParams(temperature=0, logit_bias={3: 10.0}),
              SamplingParams(temperature=0, allowed_token_ids=[4, 5]),
              SamplingParams(temperature=2.0, seed=1, allowed_token_ids=[4, 5])]
    metadata = SamplingMetadata.from_requests(params, [[1]] * 4, [[]] * 4, eos_token_id=EOS, vocab_size=VOCAB)
    assert Sampler()(logits, metadata).tolist()[:3] == [1, 3, 4]
    draws = set()
    for step in range(30):
        metadata = SamplingMetadata.from_requests(params[3:], [[1]], [[1] * step], vocab_size=VOCAB)
        draws.add(int(Sampler()(logits[:1], metadata)))
    assert draws == {4, 5}
    with pytest.raises(ValueError, match="vocab_size is needed for logit_bias"):
        SamplingMetadata.from_requests(params[1:2], [[1]], [[]])


def test_stop_rules_wait_for_min_tokens():
    params = SamplingParams(min_tokens=3, stop=["x"], stop_token_ids=[7], max_tokens=5)
    assert check_stop(params, [1, 7], "ax", 1, EOS) is None  # a stop token and a stop string, too early
    assert check_stop(params, [1, 2, 7], "abx", 1, EOS).stop_reason == 7
    assert check_stop(SamplingParams(min_tokens=2), [EOS], "", 0, EOS) is None


def test_a_validated_request_can_be_copied_with_another_seed():
    """The engine derives each sample's params with dataclasses.replace(params, seed=seed + i)."""
    params = SamplingParams(logit_bias={1: 2.0}, allowed_token_ids=[1, 2], stop_token_ids=[3], seed=5, n=2)
    child = dataclasses.replace(params, seed=6)
    assert child.logit_bias == {1: 2.0} and child.allowed_token_ids == (1, 2) and child.seed == 6
    with pytest.raises(TypeError):
        params.logit_bias[1] = 0.0  # read-only: a validated request cannot change afterwards
