"""labkit_course.roofline: step costs counted from a model's shape, checked against PyTorch's FLOP counter
and the model's own parameters; the machine measurements return sane numbers."""

import dataclasses
import math

import pytest
import torch
from torch.utils.flop_counter import FlopCounterMode

from labkit.model.random_weights import SMOLLM2_135M, random_model
from labkit_course.roofline import (
    decode_cost,
    engine_step_cost,
    measure_matmul_flops,
    measure_read_bandwidth,
    prefill_cost,
    weight_bytes,
)

SMALL = dataclasses.replace(SMOLLM2_135M, num_layers=2, vocab_size=512)


@pytest.fixture(scope="module")
def model():
    return random_model(SMALL)


@pytest.mark.parametrize("num_tokens", [1, 16, 33])
def test_prefill_flops_match_torch_flop_counter(model, num_tokens):
    """Linear layers exactly; attention as the causal half of the full T x T products labkit's dense path runs."""
    with FlopCounterMode(display=False) as counter:
        model(torch.randint(SMALL.vocab_size, (num_tokens,)))
    counts = {str(op): n for op, n in counter.get_flop_counts()["Global"].items()}
    causal_attention = counts["aten.bmm"] * (num_tokens + 1) / (2 * num_tokens)
    assert prefill_cost(SMALL, num_tokens).flops == pytest.approx(counts["aten.mm"] + causal_attention, rel=1e-12)


def test_weight_bytes_are_the_parameters_every_step_reads(model):
    matrices = sum(p.numel() for name, p in model.named_parameters() if "norm" not in name)  # tied head once
    assert weight_bytes(SMALL, 2) == 2 * matrices


def test_decode_intensity_grows_with_the_batch_until_the_kv_reads_cap_it():
    assert decode_cost(SMOLLM2_135M, 1, 0, dtype_bytes=2).intensity == pytest.approx(1.0)
    assert decode_cost(SMOLLM2_135M, 64, 0, dtype_bytes=2).intensity == pytest.approx(64.0)
    long = [decode_cost(SMOLLM2_135M, b, 4096, dtype_bytes=2).intensity for b in (1, 64, 10**6, 10**9)]
    assert long == sorted(long) and long[-1] - long[-2] < 1e-3 * long[-1] and long[-1] < 10


def test_measurements_are_positive_rates():
    assert math.isfinite(measure_matmul_flops(8, 16, 16, repeats=1)) and measure_matmul_flops(8, 16, 16) > 0
    assert measure_read_bandwidth(2**20, repeats=1) > 0


def test_an_engine_step_counts_the_lm_head_only_for_scored_rows_and_each_sequences_own_context():
    """A prefill of T tokens scoring every row is `prefill_cost`; a decode batch is `decode_cost`; a
    mixed step is the sum of its parts minus the weights read once, and a chunk scoring no row skips
    the LM head."""
    c, head = SMOLLM2_135M, 2 * SMOLLM2_135M.vocab_size * SMOLLM2_135M.hidden_size
    assert engine_step_cost(c, [33], [33], 33, 4).flops == pytest.approx(prefill_cost(c, 33).flops)
    assert engine_step_cost(c, [33], [33], 1, 4).flops == pytest.approx(prefill_cost(c, 33).flops - 32 * head)
    decode = engine_step_cost(c, [1] * 8, [100] * 8, 8, 2)
    assert decode.flops == pytest.approx(decode_cost(c, 8, 100, 2).flops)
    assert decode.bytes_moved == decode_cost(c, 8, 100, 2).bytes_moved
    mixed = engine_step_cost(c, [1, 20], [50, 70], 1, 2)
    chunk = engine_step_cost(c, [20], [70], 0, 2)
    alone = engine_step_cost(c, [1], [50], 1, 2)
    assert mixed.flops == pytest.approx(chunk.flops + alone.flops)
    assert mixed.bytes_moved == chunk.bytes_moved + alone.bytes_moved - weight_bytes(c, 2)
