"""labkit: the engine and helpers behind the course "Inside an LLM inference engine".

The top-level names are imported lazily so that `import labkit` stays cheap in a
notebook's first cell; each lives in the module that owns its concept.
"""

from importlib import import_module

__version__ = "0.1.0"

_EXPORTS = {
    "load_tokenizer": "labkit.tokenizer",
    "load_model": "labkit.model",
    "SamplingParams": "labkit.sampling",
    "LLM": "labkit.engine",
    "pick_device": "labkit.device",
}

__all__ = sorted(_EXPORTS) + ["__version__"]


def __getattr__(name):
    if name in _EXPORTS:
        return getattr(import_module(_EXPORTS[name]), name)
    raise AttributeError(f"module 'labkit' has no attribute {name!r}")
