"""filter_logits and the per-row filters against transformers' logits warpers, ties and -inf included."""

import itertools

import pytest
import torch
from transformers.generation.logits_process import (
    LogitsProcessorList,
    MinPLogitsWarper,
    TemperatureLogitsWarper,
    TopKLogitsWarper,
    TopPLogitsWarper,
)

from labkit.sampling import apply_min_p, apply_top_k, apply_top_p, filter_logits


def transformers_filter(logits, temperature, top_k, top_p, min_p):
    """What `generate(do_sample=True, ...)` builds: the same warpers, in the same order, on the same conditions."""
    warpers = LogitsProcessorList()
    if temperature != 1.0:
        warpers.append(TemperatureLogitsWarper(float(temperature)))
    if top_k > 0:
        warpers.append(TopKLogitsWarper(top_k))
    if top_p < 1.0:
        warpers.append(TopPLogitsWarper(top_p))
    if min_p > 0:
        warpers.append(MinPLogitsWarper(min_p))
    return warpers(torch.zeros(logits.shape[0], 1, dtype=torch.long), logits.clone())


def logit_batches():
    """Smooth logits, heavily tied ones (small integers), ones with -inf entries, and a peaked row."""
    g = torch.Generator().manual_seed(0)
    smooth = torch.randn(6, 50, generator=g) * 2
    tied = torch.randint(-3, 3, (6, 50), generator=g).float()
    masked = torch.randn(6, 50, generator=g).masked_fill(torch.rand(6, 50, generator=g) < 0.6, float("-inf"))
    peaked = torch.randn(2, 50, generator=g)
    peaked[:, 7] = 12.0
    return {"smooth": smooth, "tied": tied, "masked": masked, "peaked": peaked}


SETTINGS = list(itertools.product([1.0, 0.6, 1.7], [0, 1, 5, 50, 80], [1.0, 0.9, 0.5, 0.05], [0.0, 0.1, 0.5]))


@pytest.mark.parametrize("kind", ["smooth", "tied", "masked", "peaked"])
def test_filter_logits_equals_transformers_warpers(kind):
    logits = logit_batches()[kind]
    for temperature, top_k, top_p, min_p in SETTINGS:
        expected = transformers_filter(logits, temperature, top_k, top_p, min_p)
        got = filter_logits(logits, temperature=temperature, top_k=top_k, top_p=top_p, min_p=min_p)
        assert torch.equal(got, expected), (kind, temperature, top_k, top_p, min_p)


def test_boundary_cases_match_exactly():
    # probabilities 0.5, 0.25, 0.125, 0.125: top_p 0.75 lands exactly on a cumulative sum
    logits = torch.log(torch.tensor([[0.5, 0.25, 0.125, 0.125]]))
    for top_p in (0.75, 0.5, 0.875, 0.74, 0.76):
        assert torch.equal(filter_logits(logits, top_p=top_p), transformers_filter(logits, 1.0, 0, top_p, 0.0))
    # top-k keeps every token tied with the k-th largest: 3 survive top_k=2 here
    tied = torch.tensor([[2.0, 1.0, 1.0, 0.0]])
    assert torch.isfinite(filter_logits(tied, top_k=2)).sum() == 3
    # min_p = 1 keeps only the top token(s); the top token always survives every filter
    assert torch.isfinite(filter_logits(logits, min_p=1.0)).sum() == 1
    assert torch.isfinite(filter_logits(logits, top_p=1e-9)).sum() == 1


def test_minus_inf_inputs_stay_removed_and_top_k_beyond_the_finite_entries_keeps_them_all():
    logits = torch.tensor([[0.0, float("-inf"), 1.0, float("-inf"), -1.0]])
    out = filter_logits(logits, top_k=4, top_p=0.999)
    assert torch.equal(out, transformers_filter(logits, 1.0, 4, 0.999, 0.0))
    assert torch.isinf(out[0, [1, 3]]).all() and torch.isfinite(out[0, [0, 2, 4]]).all()


def test_disabled_settings_return_the_logits_unchanged_and_input_is_not_mutated():
    logits = torch.randn(3, 20, generator=torch.Generator().manual_seed(1))
    before = logits.clone()
    for top_k in (0, -1):
        assert torch.equal(filter_logits(logits, top_k=top_k, top_p=1.0, min_p=0.0), logits)
    filter_logits(logits, temperature=0.5, top_k=3, top_p=0.5, min_p=0.3)
    assert torch.equal(logits, before)


def test_temperature_zero_keeps_only_the_first_argmax():
    logits = torch.tensor([[1.0, 3.0, 3.0, 2.0], [0.0, -1.0, 5.0, 5.0]])
    out = filter_logits(logits, temperature=0)
    assert torch.equal(torch.isfinite(out), torch.tensor([[False, True, False, False], [False, False, True, False]]))


def test_one_dimensional_logits_are_accepted():
    logits = torch.randn(30, generator=torch.Generator().manual_seed(2))
    assert torch.equal(filter_logits(logits, top_k=5), filter_logits(logits[None], top_k=5)[0])


def test_per_row_parameters_equal_one_call_per_row():
    logits = logit_batches()["smooth"]
    top_k = torch.tensor([0, 1, 3, 50, -1, 7])
    top_p = torch.tensor([1.0, 0.3, 0.9, 0.5, 0.99, 0.7], dtype=torch.float64)
    min_p = torch.tensor([0.0, 0.2, 0.05, 0.5, 1.0, 0.1], dtype=torch.float64)
    for row in range(len(logits)):
        k, p, m = int(top_k[row]), float(top_p[row]), float(min_p[row])
        assert torch.equal(apply_top_k(logits, top_k)[row], filter_logits(logits[row], top_k=k))
        assert torch.equal(apply_top_p(logits, top_p)[row], filter_logits(logits[row], top_p=p))
        assert torch.equal(apply_min_p(logits, min_p)[row], filter_logits(logits[row], min_p=m))


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [({"temperature": -1.0}, "temperature"), ({"top_p": 0.0}, "top_p"), ({"top_k": -2}, "top_k"),
     ({"min_p": 2.0}, "min_p")],
)
def test_bad_settings_raise_value_error_naming_them(kwargs, message):
    with pytest.raises(ValueError, match=message):
        filter_logits(torch.zeros(1, 4), **kwargs)


def test_bad_logits_are_rejected():
    with pytest.raises(ValueError, match="floating-point tensor of shape"):
        filter_logits(torch.zeros(1, 2, 3))
    with pytest.raises(ValueError, match="floating-point tensor"):
        filter_logits(torch.zeros(4, dtype=torch.long))


def test_top_k_given_its_largest_setting_filters_alike_and_the_sampler_knows_it_on_the_host():
    """The sampler hands apply_top_k the largest top_k from the requests (reading it off a GPU tensor
    waits for the GPU): the same result as finding it in the tensor, including the vocabulary clamp."""
    from labkit.sampling import SamplingMetadata, SamplingParams

    logits = torch.randn(4, 100, generator=torch.Generator().manual_seed(3))
    top_k = torch.tensor([0, 5, 200, 17])
    assert torch.equal(apply_top_k(logits, top_k, max_top_k=200), apply_top_k(logits, top_k))
    params = [SamplingParams(temperature=1, top_k=k) for k in (0, 5, 200, 17)]
    metadata = SamplingMetadata.from_requests(params, [()] * 4, [()] * 4)
    assert metadata.max_top_k == 200 and "top_k" in metadata.filters
