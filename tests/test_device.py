"""Precision by GPU capability: bf16 only where the hardware has it (sm80+), fp16 below, fp32 on the CPU.

torch.cuda.is_bf16_supported() answers True on a T4 (sm75) because it counts emulation, and Triton
cannot compile bf16 dots there; these tests fake the capability, since this machine has no GPU.
"""

import pytest
import torch

from labkit import device as device_module
from labkit.device import default_dtype, has_native_bf16
from labkit.model import default_dtype as model_default_dtype

CUDA = torch.device("cuda", 0)


@pytest.fixture
def fake_gpu(monkeypatch):
    """A GPU of the given capability that claims bf16 support the way torch does on a T4."""
    def install(capability):
        monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: capability)
        monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda *args, **kwargs: True)
    return install


@pytest.mark.parametrize("capability, expected", [
    ((7, 0), torch.float16),   # V100
    ((7, 5), torch.float16),   # T4, Colab's free GPU: bf16 would be emulated
    ((8, 0), torch.bfloat16),  # A100
    ((8, 9), torch.bfloat16),  # L4
    ((9, 0), torch.bfloat16),  # H100
])
def test_cuda_dtype_follows_the_compute_capability_not_is_bf16_supported(fake_gpu, capability, expected):
    fake_gpu(capability)
    assert default_dtype(CUDA) == expected
    assert has_native_bf16(CUDA) == (expected == torch.bfloat16)


def test_cpu_is_fp32_whatever_a_gpu_would_say(fake_gpu):
    fake_gpu((9, 0))
    assert default_dtype(torch.device("cpu")) == torch.float32
    assert not has_native_bf16(torch.device("cpu"))


def test_the_model_loader_uses_the_same_rule():
    assert model_default_dtype is device_module.default_dtype
