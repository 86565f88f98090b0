"""Import a tokenizer from a Hugging Face folder: `tokenizer.json` and `tokenizer_config.json`.

`tokenizer.json` is what the `tokenizers` library reads: a BPE model (vocabulary as token -> id,
merges as "left right" lines or [left, right] pairs, both in GPT-2's printable byte spelling), the
added tokens, a normalizer and a pre-tokenizer. labkit reads the byte-level BPE tokenizers that
Llama 3, Qwen2/3 and SmolLM2 use and refuses any other with a message naming what it met. The chat
template and the BOS/EOS names come from `tokenizer_config.json` (newer transformers write the
template to `chat_template.jinja` instead).
"""

import json
from pathlib import Path

from labkit.registry import ModelFileError

from .pretokenize import GPT2_PATTERN
from .tokenizer import Tokenizer


def load_hf_tokenizer(folder: str | Path) -> Tokenizer:
    folder = Path(folder)
    spec = _read_json(folder / "tokenizer.json")
    config = _read_json(folder / "tokenizer_config.json") if (folder / "tokenizer_config.json").is_file() else {}
    try:
        return _tokenizer(spec, config, folder)
    except ModelFileError:
        raise
    except (ValueError, KeyError, TypeError, AttributeError) as err:
        raise ModelFileError(f"{folder / 'tokenizer.json'}: unreadable tokenizer: {type(err).__name__}: {err}") from err


def _read_json(path: Path) -> dict:
    if not path.is_file():
        raise ModelFileError(f"{path.parent} has no {path.name}: labkit reads a Hugging Face folder's tokenizer "
                             "from tokenizer.json")
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as err:
        raise ModelFileError(f"{path}: not JSON ({err})") from None
    if not isinstance(data, dict):
        raise ModelFileError(f"{path}: expected a JSON object, got {type(data).__name__}")
    return data


def _tokenizer(spec: dict, config: dict, folder: Path) -> Tokenizer:
    model = spec["model"]
    if model.get("type") != "BPE" or model.get("byte_fallback"):
        raise ModelFileError(f"{folder}: tokenizer model {model.get('type')!r} "
                             f"{'with byte fallback ' if model.get('byte_fallback') else ''}is not byte-level BPE")
    added = {t["content"]: t["id"] for t in spec.get("added_tokens") or []}
    by_id = {i: token for token, i in model["vocab"].items()} | {i: token for token, i in added.items()}
    if sorted(by_id) != list(range(len(by_id))):
        raise ModelFileError(f"{folder}: token ids are not 0..{len(by_id) - 1} without gaps")
    merges = [m if isinstance(m, str) else " ".join(m) for m in model["merges"]]
    return Tokenizer.from_printable(
        [by_id[i] for i in range(len(by_id))], merges, _pattern(spec.get("pre_tokenizer"), folder), added,
        bos_token_id=added.get(_token_text(config.get("bos_token"))),
        eos_token_id=added.get(_token_text(config.get("eos_token"))),
        add_bos_token=bool(config.get("add_bos_token", False)), add_eos_token=bool(config.get("add_eos_token", False)),
        chat_template=_chat_template(config, folder), normalization=_normalization(spec.get("normalizer"), folder),
    )


def _pattern(pre: dict | None, folder: Path) -> str:
    """The one regex that cuts text as the pre-tokenizer does, for the byte-level shapes in use:
    ByteLevel alone (GPT-2's regex), Digits then ByteLevel (SmolLM2), Split(regex) then ByteLevel
    without its own regex (Llama 3, Qwen2/3)."""
    steps = (pre or {}).get("pretokenizers") if (pre or {}).get("type") == "Sequence" else [pre]
    kinds = [step.get("type") if isinstance(step, dict) else None for step in steps or [None]]
    if kinds == ["ByteLevel"] and steps[0].get("use_regex", True):
        return "gpt2"
    if kinds == ["Digits", "ByteLevel"] and steps[0].get("individual_digits") and steps[1].get("use_regex", True):
        return "smollm2"
    if (kinds == ["Split", "ByteLevel"] and not steps[1].get("use_regex", True)
            and steps[0].get("behavior") == "Isolated" and "Regex" in steps[0].get("pattern", {})):
        return steps[0]["pattern"]["Regex"]
    raise ModelFileError(f"{folder}: pre-tokenizer {' then '.join(map(str, kinds))} is not one labkit reads "
                         f"(ByteLevel; Digits then ByteLevel; Split(regex) then ByteLevel without regex); "
                         f"GPT-2's regex is {GPT2_PATTERN!r}")


def _normalization(normalizer: dict | None, folder: Path) -> str | None:
    if normalizer is None:
        return None
    if normalizer.get("type") == "NFC":
        return "NFC"
    raise ModelFileError(f"{folder}: normalizer {normalizer.get('type')!r} is not one labkit applies (none, NFC)")


def _token_text(token) -> str | None:
    """tokenizer_config.json spells a special token as its text or as {"content": text, ...}."""
    return token.get("content") if isinstance(token, dict) else token


def _chat_template(config: dict, folder: Path) -> str | None:
    if (folder / "chat_template.jinja").is_file():
        return (folder / "chat_template.jinja").read_text(encoding="utf-8")
    template = config.get("chat_template")
    if isinstance(template, list):  # named templates: [{"name": "default", "template": ...}, ...]
        template = next((t.get("template") for t in template if t.get("name") == "default"), None)
    return template
