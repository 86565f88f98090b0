"""The course's small data files, shipped inside the package (where each comes from: README.md here).

They are found through importlib.resources, so a git checkout, an editable install and a wheel
installed anywhere all resolve them the same way.
"""

from importlib.resources import files
from pathlib import Path

JARGON_FILE = "jargon_file_4.4.7.txt"  # ~1 MB of English for training a BPE tokenizer (Lab 01)
WORKED_EXAMPLE = "worked_example.json"  # the book's tiny model and its printed numbers (Labs 03, 04)
HELDOUT_ESSAY = "heldout_essay.txt"  # ~1,000 tokens of English no model has seen, for perplexity (Lab 12)


def data_path(name: str) -> Path:
    """The path of one of the course's data files, e.g. data_path(JARGON_FILE)."""
    path = files(__name__) / name
    if not (isinstance(path, Path) and path.is_file()):
        available = sorted(p.name for p in files(__name__).iterdir() if p.name.endswith((".txt", ".json")))
        raise FileNotFoundError(f"no data file {name!r} in labkit.data (it has {', '.join(available)})")
    return path
