"""The command line answers before torch loads, every option says its default; `make lab` runs as root
and leaves the student's notebooks every core (one thread is for test targets only)."""

import os
import stat
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


def test_engine_help_answers_without_importing_torch():
    code = ("import runpy, sys; sys.argv = ['labkit.engine', '--help']\n"
            "try:\n    runpy.run_module('labkit.engine', run_name='__main__')\n"
            "except SystemExit:\n    pass\n"
            "print('torch imported' if 'torch' in sys.modules else 'torch not imported')")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.rstrip().endswith("torch not imported")
    assert "usage: python -m labkit.engine" in out


def test_every_engine_option_has_help_with_its_default():
    out = subprocess.run([sys.executable, "-m", "labkit.engine", "--help"], capture_output=True, text=True,
                         check=True).stdout
    options = out.split("options:")[1]
    for option, default in [("--model", "smollm2"), ("--max-tokens", "64"), ("--temperature", "0.0"),
                            ("--seed", "0"), ("--stream", "False"), ("--dtype", "auto"),
                            ("--weight-format", "dequantized")]:
        entry = options.split(option, 1)[1].split("\n  -", 1)[0]
        assert f"(default: {default})" in " ".join(entry.split()), option


def test_a_bad_option_is_refused_before_loading_anything():
    result = subprocess.run([sys.executable, "-m", "labkit.engine", "--max-tokens", "many"], capture_output=True,
                            text=True)
    assert result.returncode == 2 and "invalid int value: 'many'" in result.stderr
    assert "loading" not in result.stdout
    result = subprocess.run([sys.executable, "-m", "labkit.engine", "--weight-format", "q4_0"], capture_output=True,
                            text=True)
    assert result.returncode == 2 and "invalid choice: 'q4_0'" in result.stderr and "q4_1" in result.stderr


def fake_tools(tmp_path: Path) -> Path:
    """A bin/ folder whose jupyter, ruff, lint-imports and python print their arguments and the thread setting."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    for name in ("jupyter", "ruff", "lint-imports", "python"):
        script = bin_dir / name
        script.write_text(f'#!/bin/sh\necho "{name} $*"\necho "OMP_NUM_THREADS=${{OMP_NUM_THREADS:-unset}}"\n')
        script.chmod(script.stat().st_mode | stat.S_IEXEC)
    return bin_dir


def run_make(target: str, tmp_path: Path) -> str:
    """`make target` with the tools faked and the install stamp taken as up to date (-o): nothing installs."""
    env = {k: v for k, v in os.environ.items() if k not in ("OMP_NUM_THREADS", "MAKEFLAGS", "MAKELEVEL")}
    return subprocess.run(["make", "-s", "-o", ".venv/.installed", target, f"BIN={fake_tools(tmp_path)}"],
                          cwd=ROOT, env=env, capture_output=True, text=True, check=True).stdout


def test_make_lab_allows_root_only_when_root_and_keeps_every_thread(tmp_path):
    out = run_make("lab", tmp_path)
    assert "jupyter lab" in out and "notebooks/" in out
    assert ("--allow-root" in out) == (os.getuid() == 0)
    assert "OMP_NUM_THREADS=unset" in out


def test_make_test_runs_one_thread_per_process(tmp_path):
    out = run_make("test", tmp_path)
    assert "ruff check ." in out and "lint-imports" in out and "python -m pytest tests" in out
    assert out.count("OMP_NUM_THREADS=1") == out.count("OMP_NUM_THREADS=") >= 3


def test_labkit_serve_says_what_it_loads_before_the_long_wait(capsys):
    from labkit.__main__ import main

    with pytest.raises(Exception):  # noqa: B017, PT011 - the model does not exist: it stops right after the line
        main(["serve", "--model", "/nonexistent/model.gguf"])
    assert capsys.readouterr().out.startswith("labkit serve: loading /nonexistent/model.gguf…")
