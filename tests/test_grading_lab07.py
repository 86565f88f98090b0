"""Lab 07: the lesson's numbers the lab recomputes (its graders are proven in tests/catalogue/lab07.py)."""

import pytest
import torch

from labkit.grading.labs.lab07 import _reference_savings


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
    tokens = (80e9 - 6.74e9 * 2) / (2 * 32 * 32 * 128 * 2)
    assert int(tokens // 2048) == 61 and int(tokens // 4096) == 30 and int(tokens // 1008) == 125
