"""Lab 02 graders: a correct answer passes, an unfinished one fails, each dropped factor is named."""

import pytest

from labkit.grading.core import get_exercise, run_exercise


def outcome(name, fn):
    return run_exercise(get_exercise("02", name), {name: fn})


def not_done(*args, **kwargs):
    raise NotImplementedError()


def kv_good(num_layers, num_kv_heads, head_dim, seq_len, batch_size=1, dtype_bytes=2):
    return 2 * num_layers * num_kv_heads * head_dim * seq_len * batch_size * dtype_bytes


@pytest.mark.parametrize(("fn", "message"), [
    (not_done, "not implemented"),
    (lambda **c: kv_good(**c) // 2, "K and V are both cached"),
    (lambda **c: kv_good(**c) // c["num_layers"], "every layer"),
    (lambda **c: kv_good(**c) // c["batch_size"], "each sequence in the batch"),
    (lambda **c: kv_good(**c) // c["dtype_bytes"], "multiply by dtype_bytes"),
    (lambda **c: kv_good(**c) / 1024, "not KiB/MiB"),
    (lambda **c: kv_good(**c) + 1, "expected 2 x L"),
    (lambda **c: "lots", "return a number"),
])
def test_kv_cache_bytes_mistakes(fn, message):
    result = outcome("kv_cache_bytes", fn)
    assert not result.passed and message in result.message, result.message


def test_kv_cache_bytes_correct():
    assert outcome("kv_cache_bytes", kv_good).passed


def intensity_good(m, k, n, dtype_bytes=2):
    return 2 * m * k * n / ((m * k + k * n + m * n) * dtype_bytes)


@pytest.mark.parametrize(("fn", "message"), [
    (not_done, "not implemented"),
    (lambda m, k, n, b=2: intensity_good(m, k, n, b) / 2, "2 FLOPs"),
    (lambda m, k, n, b=2: intensity_good(m, k, n, b) * b, "divide by bytes"),
    (lambda m, k, n, b=2: 2 * m * k * n / ((m * k + k * n) * b), "output [m, n]"),
    (lambda m, k, n, b=2: m * k, "expected 2mkn"),
])
def test_matmul_intensity_mistakes(fn, message):
    result = outcome("matmul_intensity", fn)
    assert not result.passed and message in result.message, result.message


def test_matmul_intensity_correct():
    assert outcome("matmul_intensity", intensity_good).passed
