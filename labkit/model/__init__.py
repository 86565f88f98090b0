"""A Llama-family decoder (Llama, SmolLM2, Qwen3) and the loaders that fill it with real weights.

The GGUF loader (and with it the `gguf` package) is imported when a GGUF file is read, so a machine
without `gguf` still runs HF folders and random-weights models (`labkit.model.random_weights`).
"""

from pathlib import Path

import torch

from labkit.device import default_dtype, pick_device
from labkit.model.config import ModelConfig, RopeScaling
from labkit.model.decoder import DecoderModel
from labkit.model.generate import generate
from labkit.model.hf_loader import load_hf_folder, read_hf_config
from labkit.model.weight_formats import apply_weight_format, check_weight_format
from labkit.registry import resolve_model_path

__all__ = ["DecoderModel", "ModelConfig", "RopeScaling", "default_dtype", "generate", "load_config", "load_gguf",
           "load_hf_folder", "load_model"]


def __getattr__(name):
    if name in ("load_gguf", "read_gguf_config"):
        from labkit.model import gguf_loader

        return getattr(gguf_loader, name)
    raise AttributeError(f"module 'labkit.model' has no attribute {name!r}")


def load_config(name_or_path: str | Path = "smollm2") -> ModelConfig:
    """The architecture numbers of a model, without loading its weights."""
    path = resolve_model_path(name_or_path)
    if path.is_dir():
        return read_hf_config(path)
    from labkit.model.gguf_loader import read_gguf_config

    return read_gguf_config(path)


def load_model(name_or_path: str | Path = "smollm2", device: torch.device | str | None = None,
               dtype: torch.dtype | None = None, weight_format: str = "dequantized",
               prepack: bool = False) -> DecoderModel:
    """Load "smollm2", a .gguf file or a Hugging Face folder (config.json + *.safetensors), ready to run.

    `weight_format` and `prepack`: see labkit.model.weight_formats ("int8" and "q4_1" default to bf16;
    "q4_1" of a GGUF with Q4_1 tensors keeps the file's own blocks)."""
    path = resolve_model_path(name_or_path)
    device = pick_device() if device is None else torch.device(device)
    if dtype is None:
        dtype = default_dtype(device) if weight_format == "dequantized" else torch.bfloat16
    elif not (isinstance(dtype, torch.dtype) and dtype.is_floating_point):
        raise TypeError(f"dtype must be a floating-point torch.dtype, got {dtype!r}")
    check_weight_format(weight_format, dtype, device)  # before the seconds of loading
    if path.is_dir():
        config, weights = load_hf_folder(path)
    elif path.suffix == ".gguf":
        from labkit.model.gguf_loader import load_gguf

        config, weights = load_gguf(path)
    else:
        raise ValueError(f"don't know how to load {path}: expected a .gguf file or a model folder")
    model = DecoderModel.from_state_dict(config, weights, device=device, dtype=dtype, source=path.name)
    q4_blocks = None
    if weight_format == "q4_1" and path.suffix == ".gguf":
        from labkit.model.gguf_loader import load_q4_1_blocks

        q4_blocks = load_q4_1_blocks(path)
    apply_weight_format(model, weight_format, prepack=prepack, q4_blocks=q4_blocks)
    return model
