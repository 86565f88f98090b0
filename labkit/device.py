"""Device choice shared by the labs and the engine: CUDA when present, else the CPU."""

import torch


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


def describe_device(device: torch.device) -> str:
    """One line that says what the computation will run on."""
    if device.type == "cuda":
        props = torch.cuda.get_device_properties(device)
        return f"cuda: {props.name}, {props.total_memory / 2**30:.0f} GiB, sm{props.major}{props.minor}"
    return "cpu"
