"""Read a Hugging Face model folder: config.json plus one or several *.safetensors files.

Sharded checkpoints list their files in model.safetensors.index.json; a single-file checkpoint is
model.safetensors. Parameter names lose their "model." prefix to match labkit's DecoderModel.
"""

import json
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open

from labkit.model.config import ModelConfig
from labkit.registry import ModelFileError


def _safetensors_files(folder: Path) -> list[Path]:
    index = folder / "model.safetensors.index.json"
    if index.is_file():
        try:
            shards = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        except (json.JSONDecodeError, UnicodeDecodeError, KeyError, TypeError, AttributeError) as err:
            raise ModelFileError(f"{index} does not map tensors to shards (a 'weight_map' object): {err!r}") from err
        missing = [name for name in shards if not (folder / name).is_file()]
        if missing:
            raise FileNotFoundError(f"{index.name} in {folder} lists shards that are missing: {missing}")
        return [folder / name for name in shards]
    files = sorted(folder.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"no *.safetensors weights in {folder} (PyTorch .bin files are not supported)")
    return files


def read_hf_config(folder: str | Path) -> ModelConfig:
    """The ModelConfig of a Hugging Face folder, from its config.json."""
    config_file = Path(folder) / "config.json"
    if not config_file.is_file():
        raise FileNotFoundError(f"{folder} is not a Hugging Face model folder: it has no config.json")
    try:
        config = json.loads(config_file.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as err:
        raise ModelFileError(f"{config_file} is not valid JSON: {err}") from err
    if not isinstance(config, dict):
        raise ModelFileError(f"{config_file} holds a {type(config).__name__}, not a JSON object")
    try:
        return ModelConfig.from_hf_dict(config)
    except KeyError as err:
        raise ModelFileError(f"{config_file} lacks the key {err.args[0]!r}") from err
    except (ValueError, TypeError) as err:
        raise ModelFileError(f"{config_file}: {err}") from err


def load_hf_folder(folder: str | Path) -> tuple[ModelConfig, dict[str, torch.Tensor]]:
    """The config and weights (labkit names, checkpoint dtype) of a Llama or Qwen3 folder."""
    folder = Path(folder)
    config = read_hf_config(folder)
    state_dict = {}
    for file in _safetensors_files(folder):
        try:
            with safe_open(file, framework="pt") as f:
                for key in f.keys():
                    name = key.removeprefix("model.")
                    if name in state_dict:
                        raise ModelFileError(f"{file.name}: tensor {key} appears in more than one shard")
                    state_dict[name] = f.get_tensor(key)
        except SafetensorError as err:
            raise ModelFileError(f"{file} is not a readable safetensors file (truncated or corrupted?): "
                                 f"{err}") from err
    return config, state_dict
