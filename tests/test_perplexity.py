"""Perplexity from logits (labkit.model.perplexity) against PyTorch's cross-entropy."""

import math

import pytest
import torch
import torch.nn.functional as F

from labkit.model.perplexity import perplexity_from_logits


def test_matches_exp_of_torch_cross_entropy_on_shifted_targets():
    gen = torch.Generator().manual_seed(0)
    logits, ids = torch.randn(30, 50, generator=gen) * 3, torch.randint(50, (30,), generator=gen)
    expected = math.exp(F.cross_entropy(logits[:-1].double(), ids[1:]).item())
    assert perplexity_from_logits(logits, ids) == pytest.approx(expected, rel=1e-12)


def test_a_uniform_model_has_the_vocabulary_size_as_perplexity():
    assert perplexity_from_logits(torch.zeros(7, 40), torch.arange(7)) == pytest.approx(40)


def test_a_very_unlikely_token_stays_finite():
    logits = torch.zeros(3, 4)
    logits[:, 0] = 300.0  # float32 softmax gives the other tokens probability 0
    assert perplexity_from_logits(logits, torch.tensor([0, 1, 0])) == pytest.approx(math.exp(150), rel=1e-9)


@pytest.mark.parametrize(("logits", "ids", "message"), [
    (torch.zeros(1, 5), torch.tensor([0]), "at least 2 tokens"),
    (torch.zeros(4, 5), torch.tensor([0, 1, 2]), "expected logits"),
    (torch.zeros(4), torch.tensor([0, 1, 2, 3]), "expected logits"),
])
def test_bad_shapes_say_what_was_expected(logits, ids, message):
    with pytest.raises(ValueError, match=message):
        perplexity_from_logits(logits, ids)
