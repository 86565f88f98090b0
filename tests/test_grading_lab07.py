"""Lab 07: the lesson's numbers the lab recomputes (its graders are proven in tests/catalogue/lab07.py)."""

import pytest
import torch

from labkit_course.grading.labs.lab07 import _reference_savings


def test_lab07_claims():
    assert 32 * 2 * 16 * 32 * 128 * 2 == 8_388_608
    r = _reference_savings([1000] * 100, 2048, 16, 1)
    assert f"{r['utilization_traditional']:.1%}" == "48.8%" and f"{r['utilization_paged']:.1%}" == "99.2%"
    assert f"{r['savings_percent']:.1f}" == "50.8"
    lengths = torch.randint(1, 4000, (20_000,), generator=torch.Generator().manual_seed(0)).tolist()
    for b in (8, 16, 32, 64):
        mean_waste = sum(-n % b for n in lengths) / len(lengths)
        assert abs(mean_waste - (b - 1) / 2) < 0.1 * b / 4 + 0.25 and abs(mean_waste - b / 2) > 0.3
    with pytest.raises(ValueError, match="3000 tokens"):
        _reference_savings([100, 3000], 2048, 16, 1)
    # the capacity table: an A100's 80 GiB less fp16 weights; Llama-2's whole 4,096-token context per sequence
    # gives 33 (the table's 32), 1,008-slot paged sequences about 137 (its "90+" a lower bound)
    tokens = (80 * 2**30 - 6.74e9 * 2) / (2 * 32 * 32 * 128 * 2)
    assert int(tokens // 2048) == 67 and int(tokens // 4096) == 33 and int(tokens // 1008) == 137
    # the lesson's latency overhead (1.05x with a gather) against its own exercise-4 model
    lengths = [512, 1024, 256, 2000, 800, 1500, 300, 1800, 600, 1200, 450, 1600, 900, 1300, 700, 1700]
    gather, compute = sum(-(-n // 16) for n in lengths) * 0.01, sum(lengths) * 0.1
    assert f"{(gather + compute) / compute:.3f}" == "1.006"
