"""Lab 02: the KV-cache size and a matmul's arithmetic intensity."""

import math

from catalogue import Right, Wrong
from labkit.grading.labs.lab02 import _intensity, _kv_bytes


def kv_product(num_layers, num_kv_heads, head_dim, seq_len, batch_size=1, dtype_bytes=2):
    return 2 * num_layers * num_kv_heads * head_dim * seq_len * batch_size * dtype_bytes


def kv_per_token_then_scale(num_layers, num_kv_heads, head_dim, seq_len, batch_size=1, dtype_bytes=2):
    per_token_per_layer = 2 * num_kv_heads * head_dim * dtype_bytes  # one K row and one V row
    return math.prod((per_token_per_layer, num_layers, seq_len, batch_size))


def kv(**drop):
    """A kv_cache_bytes that leaves out (or replaces) some factors."""
    def kv_cache_bytes(num_layers, num_kv_heads, head_dim, seq_len, batch_size=1, dtype_bytes=2):
        factors = dict(two=2, num_layers=num_layers, num_kv_heads=num_kv_heads, head_dim=head_dim, seq_len=seq_len,
                       batch_size=batch_size, dtype_bytes=dtype_bytes)
        factors.update(drop)
        return math.prod(factors.values())
    return kv_cache_bytes


def intensity(m, k, n, dtype_bytes=2):
    return 2 * m * k * n / ((m * k + k * n + m * n) * dtype_bytes)


def intensity_in_steps(m, k, n, dtype_bytes=2):
    flops = 2 * m * k * n
    bytes_moved = dtype_bytes * (m * k) + dtype_bytes * (k * n) + dtype_bytes * (m * n)
    return flops / bytes_moved


RIGHT = [
    Right("kv_cache_bytes", "one product", kv_product),
    Right("kv_cache_bytes", "bytes per token per layer, then scaled", kv_per_token_then_scale),
    Right("matmul_intensity", "one expression", intensity),
    Right("matmul_intensity", "FLOPs and bytes in steps", intensity_in_steps),
]

WRONG = [
    Wrong("kv_cache_bytes", "caches only K (or only V)", kv(two=1), "K and V are both cached"),
    Wrong("kv_cache_bytes", "one layer's cache", kv(num_layers=1), "every layer"),
    Wrong("kv_cache_bytes", "forgot the KV heads", kv(num_kv_heads=1),
          "multiply by num_kv_heads"),
    Wrong("kv_cache_bytes", "forgot the batch", kv(batch_size=1), "each sequence in the batch"),
    Wrong("kv_cache_bytes", "counted elements, not bytes", kv(dtype_bytes=1), "multiply by dtype_bytes for bytes"),
    Wrong("kv_cache_bytes", "hard-coded fp16 (ignores dtype_bytes)", kv(dtype_bytes=2), "dtype_bytes was ignored"),
    Wrong("kv_cache_bytes", "one token's cache", kv(seq_len=1), "one K and one V row per token"),
    Wrong("kv_cache_bytes", "returned KiB", lambda **c: kv_product(**c) / 1024, "not KiB/MiB/GiB"),
    Wrong("kv_cache_bytes", "returned GiB", lambda **c: kv_product(**c) / 2**30, "not KiB/MiB/GiB"),
    Wrong("kv_cache_bytes", "returned GB", lambda **c: kv_product(**c) / 1e9, "not KiB/MiB/GiB"),
    Wrong("kv_cache_bytes", "returned bits", lambda **c: kv_product(**c) * 8, "not bits"),
    Wrong("kv_cache_bytes", "returned a float", lambda **c: float(kv_product(**c)), "return an int"),
    Wrong("kv_cache_bytes", "returned a string", lambda **c: f"{kv_product(**c)} bytes", "return a number"),
    Wrong("kv_cache_bytes", "an extra token", lambda **c: kv_product(**{**c, "seq_len": c["seq_len"] + 1}),
          "expected 2 x L"),
    Wrong("kv_cache_bytes", "imports the grader's formula", lambda **c: _kv_bytes(*c.values()),
          "`_kv_bytes`", calls="labkit.grading.labs.lab02._kv_bytes"),
    Wrong("matmul_intensity", "one FLOP per multiply-add", lambda m, k, n, b=2: intensity(m, k, n, b) / 2, "2 FLOPs"),
    Wrong("matmul_intensity", "divided by elements, not bytes", lambda m, k, n, b=2: intensity(m, k, n, 1),
          "divide by bytes"),
    Wrong("matmul_intensity", "hard-coded 2 bytes", lambda m, k, n, b=2: intensity(m, k, n, 2),
          "dtype_bytes was ignored"),
    Wrong("matmul_intensity", "forgot writing the output", lambda m, k, n, b=2: 2 * m * k * n / ((m * k + k * n) * b),
          "output [m, n]"),
    Wrong("matmul_intensity", "forgot reading the input", lambda m, k, n, b=2: 2 * m * k * n / ((k * n + m * n) * b),
          "input [m, k]"),
    Wrong("matmul_intensity", "bytes per FLOP", lambda m, k, n, b=2: 1 / intensity(m, k, n, b), "bytes per FLOP"),
    Wrong("matmul_intensity", "integer division", lambda m, k, n, b=2: 2 * m * k * n // ((m * k + k * n + m * n) * b),
          "integer division"),
    Wrong("matmul_intensity", "returned the FLOP count", lambda m, k, n, b=2: 2 * m * k * n, "expected 2mkn"),
    Wrong("matmul_intensity", "imports the grader's formula", lambda m, k, n, b=2: _intensity(m, k, n, b),
          "`_intensity`", calls="labkit.grading.labs.lab02._intensity"),
]
