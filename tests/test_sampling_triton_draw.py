"""The Triton Gumbel-max draw against the sampler's torch draw, on the interpreter (conftest sets it).

The kernel must pick exactly the token the torch path picks from the same seeds and steps: the same
hash, the same float64 noise, the same first-maximum rule, whatever the vocabulary's size."""

import pytest
import torch

from labkit.sampling.sampler import gumbel_max, hash32, row_keys, seeded_uniforms
from labkit.sampling.triton_draw import BLOCK, gumbel_argmax


def torch_draw(logits, seeds, steps):
    return gumbel_max(logits, seeded_uniforms(seeds, steps, hash32(torch.arange(logits.shape[-1]))))


@pytest.mark.parametrize("vocab", [7, BLOCK, BLOCK + 1, 2 * BLOCK + 77])
def test_kernel_draws_the_torch_draw(vocab):
    generator = torch.Generator().manual_seed(vocab)
    logits = torch.randn(6, vocab, generator=generator) * 2
    logits[1, ::2] = float("-inf")  # what top-k / top-p leave
    seeds = torch.tensor([0, 1, 2**40 + 3, -5, 123456789, 2**62])
    steps = torch.tensor([0, 5, 7, 100, 3, 2**33])
    for _ in range(3):
        assert gumbel_argmax(logits, row_keys(seeds, steps)).tolist() == torch_draw(logits, seeds, steps).tolist()
        steps = steps + 1


def test_flat_rows_follow_the_noise_and_a_lone_entry_always_wins():
    """Equal logits: the winner is the noise's argmax, which moves with the step; one finite entry wins."""
    logits = torch.zeros(2, 300)
    logits[1] = float("-inf")
    logits[1, 123] = 0.0
    seeds = torch.tensor([42, 42])
    drawn = {tuple(gumbel_argmax(logits, row_keys(seeds, torch.tensor([s, s]))).tolist()) for s in range(8)}
    assert {row1 for _, row1 in drawn} == {123}
    assert len({row0 for row0, _ in drawn}) > 1
    for s in range(8):
        step = torch.tensor([s, s])
        assert gumbel_argmax(logits, row_keys(seeds, step)).tolist() == torch_draw(logits, seeds, step).tolist()


def test_bad_shapes_are_refused():
    with pytest.raises(ValueError, match=r"logits must be \[batch, vocab\] and keys \[batch\]"):
        gumbel_argmax(torch.zeros(3, 10), torch.zeros(2, dtype=torch.int64))
