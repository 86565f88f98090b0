"""`fused_on_gpu`: the engine's element-wise chains compile only inside `fused_elementwise`, on a GPU, in
half precision; everywhere else (this CPU, the notebooks) they run as written. A compiler failure warns
once and falls back to the written function."""

import pytest
import torch

from labkit.model import layers


def test_outside_the_engine_or_on_a_cpu_nothing_compiles(monkeypatch):
    def no_compile(*args, **kwargs):
        raise AssertionError("torch.compile must not run here")

    monkeypatch.setattr(torch, "compile", no_compile)
    x, w = torch.randn(3, 8, dtype=torch.bfloat16), torch.ones(8, dtype=torch.bfloat16)
    expected = w * torch.nn.functional.rms_norm(x.float(), (8,), eps=1e-6).to(torch.bfloat16)
    assert torch.equal(layers.rms_norm(x, w, 1e-6), expected)
    with layers.fused_elementwise():
        assert not layers.fuses((x, w))  # CPU tensors
        assert torch.equal(layers.rms_norm(x, w, 1e-6), expected)
    assert not layers.fuses((x, w))


def fake_gpu(monkeypatch, compile_fn):
    """Let `fuses` answer as on a GPU (for half-precision calls inside the context), with a stand-in compiler."""
    real_fuses = layers.fuses
    monkeypatch.setattr(layers, "fuses", lambda args: layers._FUSING.get() and any(
        isinstance(a, torch.Tensor) and a.dtype in (torch.float16, torch.bfloat16) for a in args) or real_fuses(args))
    calls = []

    def compile_(fn, **options):
        calls.append(options)
        return compile_fn(fn)

    monkeypatch.setattr(torch, "compile", compile_)
    return calls


def test_inside_the_engine_half_precision_compiles_once_and_fp32_never(monkeypatch):
    calls = fake_gpu(monkeypatch, lambda fn: fn)
    double = layers.fused_on_gpu(lambda x: x * 2)
    with layers.fused_elementwise():
        assert torch.equal(double(torch.ones(2, dtype=torch.float32)), torch.full((2,), 2.0))
        assert calls == []  # fp32: op for op, for exact parity
        for n in (1, 5, 9):
            assert torch.equal(double(torch.ones(n, dtype=torch.bfloat16)), torch.full((n,), 2.0, dtype=torch.bfloat16))
    assert calls == [{"fullgraph": True}]  # one compiled function; torch.compile decides which dims are dynamic


def test_a_compiler_failure_warns_and_runs_the_function_as_written(monkeypatch):
    def broken(fn):
        def run(*args):
            raise RuntimeError("no Triton for this GPU")
        return run

    calls = fake_gpu(monkeypatch, broken)
    double = layers.fused_on_gpu(lambda x: x * 2)
    x = torch.ones(3, dtype=torch.float16)
    with layers.fused_elementwise():
        with pytest.warns(UserWarning, match=r"torch.compile of <lambda> failed \(RuntimeError: no Triton"):
            assert torch.equal(double(x), x * 2)
        assert torch.equal(double(x), x * 2)  # no second attempt, no second warning
    assert len(calls) == 1
