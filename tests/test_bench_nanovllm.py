"""bench/bench_nanovllm.py: nano-vLLM's workload drawn exactly, and the script run end to end (--tiny) here."""

import importlib.util
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parent.parent
spec = importlib.util.spec_from_file_location("bench_nanovllm", ROOT / "bench" / "bench_nanovllm.py")
bench = importlib.util.module_from_spec(spec)
spec.loader.exec_module(bench)


def test_the_workload_is_nanovllms():
    """nano-vLLM's README reports 133,966 output tokens for its seed-0 run of bench.py."""
    prompts, params = bench.Workload().draw()
    assert len(prompts) == len(params) == 256
    assert sum(p.max_tokens for p in params) == 133966
    assert all(100 <= len(p) <= 1024 and 0 <= min(p) and max(p) <= 10000 for p in prompts)
    assert {(p.temperature, p.ignore_eos) for p in params} == {(0.6, True)}


def test_qwen3_shape_is_qwen3_06b():
    c = bench.QWEN3_06B
    assert c.qk_norm and c.head_dim * c.num_heads == 2 * c.hidden_size and c.tie_word_embeddings
    assert c.kv_cache_bytes_per_token(2) == 28 * 2 * 8 * 128 * 2  # 112 KiB of bf16 K/V a token


@pytest.mark.skipif(torch.cuda.is_available(), reason="a CUDA machine runs the full benchmark")
def test_tiny_run_reports_both_models(tmp_path, capsys):
    assert bench.main(["--tiny", "--profile", "--out", str(tmp_path)]) == 0
    text = capsys.readouterr().out
    for name in ("qwen3-0.6b (tiny)", "smollm2-135m (tiny)"):
        assert f"## {name}, random weights (seed 0)" in text
    assert text.count("output tok/s") == 6 and text.count("throughput ratio labkit/transformers") == 2
    assert text.count("where its wall time went: schedule") == 4 and "### Profile" in text
    assert text.count("resolve (gpu wait, append)") == 2 and text.count("async scheduling / synchronous steps") == 2
    assert not list(tmp_path.iterdir())  # reports are written for GPU runs only


@pytest.mark.skipif(torch.cuda.is_available(), reason="a CUDA machine runs the full benchmark")
def test_full_run_needs_a_gpu(capsys):
    assert bench.main([]) == 2
    assert "no CUDA device" in capsys.readouterr().err


@pytest.mark.skipif(torch.cuda.is_available(), reason="a CUDA machine runs the full benchmark")
def test_no_fusion_and_no_transformers(monkeypatch, capsys):
    from labkit.model import layers

    monkeypatch.setattr(layers, "fuses", layers.fuses)  # --no-fusion replaces it for the process: restore it
    assert bench.main(["--tiny", "--model", "qwen3-0.6b", "--no-fusion", "--hf-requests", "0"]) == 0
    text = capsys.readouterr().out
    assert "element-wise fusion off" in text and "transformers generate" not in text
    assert layers.fuses((torch.ones(1, dtype=torch.bfloat16),)) is False
