"""SamplingParams: vLLM's defaults, and every bad value rejected with a message naming the parameter."""

import dataclasses

import pytest

from labkit import SamplingParams


def test_defaults_follow_vllm():
    params = SamplingParams()
    assert (params.temperature, params.top_p, params.top_k, params.min_p) == (1.0, 1.0, 0, 0.0)
    assert (params.repetition_penalty, params.presence_penalty, params.frequency_penalty) == (1.0, 0.0, 0.0)
    assert (params.max_tokens, params.stop, params.stop_token_ids, params.ignore_eos, params.seed) == (
        16, (), (), False, None)
    assert not params.greedy and SamplingParams(temperature=0).greedy


def test_valid_edges_are_accepted():
    SamplingParams(temperature=0, top_p=1, top_k=-1, min_p=1, presence_penalty=-2, frequency_penalty=2,
                   max_tokens=1, stop=["\n\n", "User:"], stop_token_ids=[2], seed=-(2**63))
    assert SamplingParams(stop=["a", "b"]).stop == ("a", "b")  # a list is stored as an immutable tuple


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"temperature": -0.1}, r"temperature must be >= 0"),
        ({"temperature": float("nan")}, r"temperature must be >= 0"),
        ({"temperature": "1"}, r"temperature must be >= 0.*'1'"),
        ({"top_p": 0.0}, r"top_p must be in \(0, 1\], got 0.0"),
        ({"top_p": 1.5}, r"top_p must be in \(0, 1\]"),
        ({"min_p": -0.1}, r"min_p must be in \[0, 1\]"),
        ({"min_p": 1.01}, r"min_p must be in \[0, 1\]"),
        ({"top_k": -2}, r"top_k must be an integer >= -1"),
        ({"top_k": 2.5}, r"top_k must be an integer >= -1"),
        ({"top_k": True}, r"top_k must be an integer"),
        ({"repetition_penalty": 0.0}, r"repetition_penalty must be in \[0.01, 100\]"),
        ({"repetition_penalty": 1e-50}, r"repetition_penalty must be in \[0.01, 100\] .*got 1e-50"),
        ({"repetition_penalty": float("inf")}, r"repetition_penalty must be in \[0.01, 100\]"),
        ({"temperature": float("inf")}, r"temperature must be >= 0 and finite .*got inf"),
        ({"top_k": 10**30}, r"top_k must be an integer >= -1 and <= 2\*\*31 - 1 .*got 10{30}"),
        ({"top_k": 2**31}, r"top_k must be an integer >= -1 and <= 2\*\*31 - 1"),
        ({"presence_penalty": 2.5}, r"presence_penalty must be in \[-2, 2\]"),
        ({"frequency_penalty": -3}, r"frequency_penalty must be in \[-2, 2\]"),
        ({"max_tokens": 0}, r"max_tokens must be an integer >= 1"),
        ({"max_tokens": 8.0}, r"max_tokens must be an integer >= 1"),
        ({"stop": "###"}, r"stop must be a list of non-empty strings, got '###'"),
        ({"stop": ["ok", ""]}, r"stop must be a list of non-empty strings"),
        ({"stop": [3]}, r"stop must be a list of non-empty strings"),
        ({"stop_token_ids": 2}, r"stop_token_ids must be a list of token ids"),
        ({"stop_token_ids": [-1]}, r"stop_token_ids must be a list of token ids"),
        ({"ignore_eos": 1}, r"ignore_eos must be True or False"),
        ({"seed": 1.5}, r"seed must be None or an integer"),
        ({"seed": 2**63}, r"seed must be None or an integer in \[-2\*\*63, 2\*\*63\)"),
    ],
)
def test_bad_values_name_the_parameter_and_its_range(kwargs, message):
    with pytest.raises(ValueError, match=message):
        SamplingParams(**kwargs)


def test_params_are_frozen_so_validation_cannot_be_bypassed():
    params = SamplingParams()
    with pytest.raises(dataclasses.FrozenInstanceError):
        params.temperature = -1.0


def test_a_tiny_temperature_is_raised_to_vllms_floor_with_a_warning():
    with pytest.warns(UserWarning, match="temperature 1e-38 is below 0.01.*using 0.01"):
        params = SamplingParams(temperature=1e-38)
    assert params.temperature == 0.01 and not params.greedy
    assert SamplingParams(temperature=0.01).temperature == 0.01  # the floor itself: no warning, no change
    assert SamplingParams(top_k=2**31 - 1).top_k == 2**31 - 1
