"""`make gpu-check` exercised on this CPU (--dry-run): the report writer runs the CPU-runnable parts for
real (the Triton kernels on the interpreter in three dtypes, engine greedy parity with transformers on
a 2-layer random-weights SmolLM2-shaped model) and marks every CUDA part "no CUDA"."""

import importlib.util
import os
import textwrap
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parent.parent
spec = importlib.util.spec_from_file_location("gpu_check", ROOT / "bench" / "gpu_check.py")
gpu_check = importlib.util.module_from_spec(spec)
spec.loader.exec_module(gpu_check)

pytestmark = pytest.mark.skipif(torch.cuda.is_available(), reason="a CUDA machine runs the real `make gpu-check`")


def test_dry_run_writes_a_report_of_the_cpu_parts_and_skips_cuda(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("TRITON_INTERPRET", "1")  # what gpu_check sets on a CPU, kept to this test
    assert gpu_check.main(["--dry-run", "--model", "random", "--out", str(tmp_path)]) == 0
    [report] = tmp_path.glob("*-cpu.md")
    text = report.read_text()
    assert text.startswith("# GPU check: cpu\n")
    assert "Sections: 4 passed, 0 failed, 4 skipped." in text
    assert "- ok: 12/12 requests drew the same tokens with async scheduling" in text
    assert "## Triton kernels vs the torch reference: PASS" in text
    for dtype in ("float32", "float16", "bfloat16"):
        assert text.count(f"- ok: paged_attention {dtype}") == 3
        assert f"- ok: store_kvcache {dtype}" in text
    assert "- ok: sampler's Gumbel-max draw, 4 rows x 5000: 4/4 tokens as the torch draw's" in text
    assert "SmolLM2-135M-shaped, random weights (seed 0)" in text
    assert text.count("greedy tokens: identical") == 2
    for title in ("CUDA graphs (fp32)", "transformers fp32", "Solution notebooks under nbval", "Speed"):
        assert f"{title}: SKIPPED\n\n- no CUDA: skipped (this part needs a GPU)" in text
    assert f"report written to {report}" in capsys.readouterr().out


def test_without_cuda_and_without_dry_run_it_refuses(tmp_path, capsys):
    assert gpu_check.main(["--out", str(tmp_path)]) == 2
    assert "no CUDA device: `make gpu-check` needs one (--dry-run" in capsys.readouterr().err
    assert not list(tmp_path.iterdir())


def test_a_failing_part_fails_its_section_and_the_exit_status_not_the_rest():
    def broken(section):
        section.check(True, "first result")
        raise RuntimeError("kernel did not compile")

    section = gpu_check.run_section("Broken", broken)
    assert section.status == "fail"
    assert section.lines[0] == "- ok: first result"
    assert "- FAILED with RuntimeError: kernel did not compile" in section.lines
    text = gpu_check.report_markdown("NVIDIA T4", [section, gpu_check.no_cuda("Speed")], False, 1.0)
    assert "Sections: 0 passed, 1 failed, 1 skipped." in text and "## Broken: FAIL" in text


def test_nbval_results_are_summarized_per_notebook(tmp_path):
    """pytest's JUnit XML as nbval writes it on a GPU (escapes and all): each failure keeps its diff or error."""
    junit = tmp_path / "nbval.xml"
    diff = ("#x1B[91mNotebook cell execution failed#x1B[0m\n#x1B[94mCell 3: Cell outputs differ\n\nInput:\n"
            "#x1B[0mprint(model.dtype)\n\n#x1B[94mTraceback:#x1B[0m\n#x1B[94m mismatch 'stdout'#x1B[91m\n\n"
            " assert reference_output == test_output failed:\n\n  - torch.bfloat16\n  ?       -\n"
            "  + torch.float32\n#x1B[0m")
    error = ("Cell 16: Cell execution caused an exception\n\nInput:\nx.equal(y)\n\nTraceback:\n"
             "RuntimeError     Traceback (most recent call last)\nCell In[1], line 1\n"
             "RuntimeError: Expected all tensors to be on the same device")
    junit.write_text(textwrap.dedent(f"""\
        <testsuites><testsuite>
          <testcase classname="solutions.05_real_model_kv_cache.ipynb" name="Cell 0"/>
          <testcase classname="solutions.05_real_model_kv_cache.ipynb" name="Cell 3">
            <failure message="Notebook cell execution failed">{diff}</failure></testcase>
          <testcase classname="solutions.04_decode_and_kv_cache.ipynb" name="Cell 16">
            <failure message="Notebook cell execution failed">{error}</failure></testcase>
          <testcase classname="solutions.06_sampling.ipynb" name="Cell 0"/>
        </testsuite></testsuites>"""))
    assert gpu_check.summarize_junit(junit) == {
        "05_real_model_kv_cache.ipynb": (1, 2, ["Cell 3:   - torch.bfloat16\n      + torch.float32"]),
        "04_decode_and_kv_cache.ipynb": (0, 1, ["Cell 16: RuntimeError     Traceback (most recent call last)\n"
                                                "    RuntimeError: Expected all tensors to be on the same device"]),
        "06_sampling.ipynb": (1, 1, []),
    }


def test_the_model_falls_back_to_random_weights_without_the_gguf(monkeypatch):
    assert gpu_check.model_source("random") == "random"
    real_find_spec = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *args: None if name == "gguf" else real_find_spec(name, *args))
    assert gpu_check.model_source("auto") == "random"


def test_a_section_missing_its_tools_names_them_and_how_to_install(monkeypatch):
    real_find_spec = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *args: None if name in ("nbval", "nbclient") else real_find_spec(name, *args))
    section = gpu_check.run_section("Solution notebooks under nbval", gpu_check.notebooks, "cuda")
    assert section.status == "fail"
    assert "not installed here: nbclient, nbval" in section.lines[0] and "-m pip install" in section.lines[0]


def test_a_second_report_the_same_day_keeps_the_first(tmp_path):
    first = gpu_check.report_path(tmp_path, "NVIDIA H100 80GB HBM3")
    assert first.name.endswith("-nvidia-h100-80gb-hbm3.md")
    first.write_text("first run")
    second = gpu_check.report_path(tmp_path, "NVIDIA H100 80GB HBM3")
    assert second.name == first.name.replace(".md", "-2.md")
    second.write_text("second run")
    assert gpu_check.report_path(tmp_path, "NVIDIA H100 80GB HBM3").name == first.name.replace(".md", "-3.md")


def test_gpu_reports_are_committed_not_ignored():
    import subprocess

    ignored = subprocess.run(["git", "check-ignore", "-q", "reports/gpu/2026-01-01-nvidia-t4.md"], cwd=ROOT)
    assert ignored.returncode == 1, "reports/gpu/ must not be git-ignored"
    assert subprocess.run(["git", "check-ignore", "-q", "reports/grades.json"], cwd=ROOT).returncode == 0
    assert os.path.isfile(ROOT / ".nbval_sanitize_gpu.cfg")


def test_the_gpu_session_script_runs_each_stage_and_keeps_what_it_wrote(tmp_path):
    """bench/gpu_session.sh, what a short GPU loan runs, in its --dry-run form; a machine lacking what
    the stages import stops at the preflight, and stages past the session's time are skipped."""
    import subprocess
    import sys

    env = {**os.environ, "GPU_PYTHON": sys.executable}
    done = subprocess.run(["bash", "bench/gpu_session.sh", str(tmp_path / "out"), "--dry-run"], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    files = {p.name for p in (tmp_path / "out").iterdir()}
    assert {"gpu-check.log", "bench-qwen3.log"} <= files and any(f.endswith("-cpu.md") for f in files)
    assert "async scheduling / synchronous steps" in (tmp_path / "out" / "bench-qwen3.log").read_text()
    failed = subprocess.run(["bash", "bench/gpu_session.sh", str(tmp_path / "failed"), "--dry-run"], cwd=ROOT,
                            env={**env, "GPU_PYTHON": "false"}, capture_output=True, text=True, timeout=60)
    assert failed.returncode == 1
    assert "== preflight ended with status 1" in failed.stdout and "== stopping: preflight failed" in failed.stdout
    short = subprocess.run(["bash", "bench/gpu_session.sh", str(tmp_path / "short"), "--dry-run"], cwd=ROOT,
                           env={**env, "SESSION_SECONDS": "25"}, capture_output=True, text=True, timeout=60)
    assert short.returncode == 1 and "== gpu-check skipped: the session's time is spent" in short.stdout


def test_a_check_cut_short_keeps_the_sections_it_finished(tmp_path, monkeypatch):
    """The report is rewritten after each section: a GPU loan that ends mid-check keeps what it checked."""
    monkeypatch.setenv("TRITON_INTERPRET", "1")

    def cut(*args):
        raise KeyboardInterrupt  # stands for the time limit: the check stops in the middle of a section

    monkeypatch.setattr(gpu_check, "kernels", cut)
    with pytest.raises(KeyboardInterrupt):
        gpu_check.main(["--dry-run", "--model", "random", "--out", str(tmp_path)])
    [report] = tmp_path.glob("*-cpu.md")
    assert "## Environment: PASS" in report.read_text() and "Sections: 1 passed" in report.read_text()
