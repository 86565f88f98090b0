"""Session-wide test setup that must happen before any test module imports triton, and the fixtures
the C kernels' build tests and the engine tests share."""

import os
import sys

# Grading treats a compiled file that appears in the course or the environment while it runs as an
# attack (labkit_course.grading.integrity); the tests write none, so that one test's imports never look like
# another's attack.
sys.dont_write_bytecode = True
os.environ["PYTHONDONTWRITEBYTECODE"] = "1"

import pytest  # noqa: E402
import torch  # noqa: E402

# Triton reads TRITON_INTERPRET when it is first imported, and transformers may import it while a
# model test loads; set it here, before collection, so the kernel tests never depend on file order.
# On a CUDA machine the kernels compile instead (make gpu-check).
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

# Lab 08's graders compile the student's kernels for a GPU on Triton as imported, which the interpreter's
# launches leave patched: it is kept now, before any test launches one (graded, before the first cell).
from labkit_course.grading.kernels import remember_triton  # noqa: E402

remember_triton()


@pytest.fixture
def fresh_build(monkeypatch, tmp_path):
    """Every C kernel built afresh, at its next use, into an empty cache directory and with whatever
    the test patched (compiler, CPU target); the loaded kernels are restored afterwards."""
    from labkit.kernels import decode_attention, fused_decode, gemm, int8_dot

    loaders = (decode_attention.load, int8_dot.load, gemm.load_f32, gemm.load_bf16, fused_decode.load)
    monkeypatch.setenv("LABKIT_CACHE_DIR", str(tmp_path))
    for load in loaders:
        load.cache_clear()
    yield tmp_path
    for load in loaders:
        load.cache_clear()


@pytest.fixture(scope="module")
def tiny():
    """(model, tokenizer) of engine_support's tiny random-weights Llama, one per test module."""
    from engine_support import tiny_model_and_tokenizer

    return tiny_model_and_tokenizer()


@pytest.fixture
def secret_inputs(monkeypatch):
    """Graders draw their inputs from a secret here, as when a class is graded; the list counts the seeds
    they mix with it."""
    import types

    from labkit_course.grading import core

    draws, blake2b = [], core.hashlib.blake2b

    def counted(*args, **kwargs):
        draws.append(1)
        return blake2b(*args, **kwargs)

    monkeypatch.setattr(core, "hashlib", types.SimpleNamespace(blake2b=counted))
    monkeypatch.setattr(core, "_SECRET", 0x5EC12E7)
    return draws
