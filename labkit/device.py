"""Device and precision choice shared by the labs and the engine: CUDA when present, else the CPU.

The precision follows what the GPU does in hardware, not what torch can emulate:
`torch.cuda.is_bf16_supported()` answers True on a T4 (sm75) because it counts emulation, yet
Triton cannot compile bf16 dots below sm80. So the compute capability decides.
"""

import torch

BF16_MIN_CAPABILITY = (8, 0)  # Ampere: the first GPUs with bf16 tensor cores


def pick_device(prefer: str | None = None) -> torch.device:
    """Return the device a lab or the engine should run on.

    `prefer` forces "cpu" or "cuda"; asking for CUDA on a machine without it is an
    error rather than a silent fallback, so a student sees why.
    """
    if prefer is None:
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    device = torch.device(prefer)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise RuntimeError("CUDA was requested but torch sees no CUDA device on this machine")
    return device


def has_native_bf16(device: torch.device) -> bool:
    """True on GPUs from sm80 (A100, L4, H100...), False on older ones (T4, V100) and on the CPU."""
    return device.type == "cuda" and torch.cuda.get_device_capability(device) >= BF16_MIN_CAPABILITY


def default_dtype(device: torch.device) -> torch.dtype:
    """fp32 on the CPU (exact, and fast enough); bf16 on GPUs from sm80; fp16 below (no emulated bf16)."""
    if device.type != "cuda":
        return torch.float32
    return torch.bfloat16 if has_native_bf16(device) else torch.float16


def describe_device(device: torch.device) -> str:
    """One line that says what the computation will run on."""
    if device.type == "cuda":
        props = torch.cuda.get_device_properties(device)
        return f"cuda: {props.name}, {props.total_memory / 2**30:.0f} GiB, sm{props.major}{props.minor}"
    return "cpu"


def upload(tensor: torch.Tensor, device: torch.device | str) -> torch.Tensor:
    """`tensor` (on the CPU) copied to `device` without waiting for the work queued there.

    A plain `.to("cuda")` of pageable memory waits for the GPU to finish what it is running, so
    the host could not prepare the next step while the current one runs. From pinned memory the copy
    is queued like a kernel; torch's pinned-memory cache keeps the buffer until the copy is done."""
    device = torch.device(device)
    if device.type != "cuda" or tensor.is_cuda:
        return tensor.to(device)
    return tensor.pin_memory().to(device, non_blocking=True)
