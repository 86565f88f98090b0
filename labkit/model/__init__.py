"""A Llama-family decoder (Llama, SmolLM2, Qwen3) and the loaders that fill it with real weights."""

from pathlib import Path

import torch

from labkit.device import pick_device
from labkit.model.config import ModelConfig, RopeScaling
from labkit.model.decoder import DecoderModel
from labkit.model.generate import generate
from labkit.model.gguf_loader import load_gguf, read_gguf_config
from labkit.model.hf_loader import load_hf_folder, read_hf_config
from labkit.registry import resolve_model_path

__all__ = ["DecoderModel", "ModelConfig", "RopeScaling", "default_dtype", "generate", "load_config", "load_gguf",
           "load_hf_folder", "load_model"]


def default_dtype(device: torch.device) -> torch.dtype:
    """fp32 on the CPU (exact, and fast enough); bf16 on GPUs that have it, else fp16."""
    if device.type != "cuda":
        return torch.float32
    return torch.bfloat16 if torch.cuda.is_bf16_supported() else torch.float16


def load_config(name_or_path: str | Path = "smollm2") -> ModelConfig:
    """The architecture numbers of a model, without loading its weights."""
    path = resolve_model_path(name_or_path)
    return read_hf_config(path) if path.is_dir() else read_gguf_config(path)


def load_model(name_or_path: str | Path = "smollm2", device: torch.device | str | None = None,
               dtype: torch.dtype | None = None) -> DecoderModel:
    """Load "smollm2", a .gguf file or a Hugging Face folder (config.json + *.safetensors), ready to run."""
    path = resolve_model_path(name_or_path)
    device = pick_device() if device is None else torch.device(device)
    if dtype is None:
        dtype = default_dtype(device)
    elif not (isinstance(dtype, torch.dtype) and dtype.is_floating_point):
        raise TypeError(f"dtype must be a floating-point torch.dtype, got {dtype!r}")
    if path.is_dir():
        config, weights = load_hf_folder(path)
    elif path.suffix == ".gguf":
        config, weights = load_gguf(path)
    else:
        raise ValueError(f"don't know how to load {path}: expected a .gguf file or a model folder")
    return DecoderModel.from_state_dict(config, weights, device=device, dtype=dtype, source=path.name)
