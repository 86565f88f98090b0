"""The course's small data files: the repository's `datasets/` folder (where each comes from:
datasets/README.md).

The labkit-course wheel carries them inside the package (`labkit_course/datasets/`); a checkout,
whether installed editable or put on sys.path (Colab, the grading sandbox), reads the repository's
folder itself. `data_path` looks in that order, so every way of installing the course finds them.
"""

from pathlib import Path

JARGON_FILE = "jargon_file_4.4.7.txt"  # ~1 MB of English for training a BPE tokenizer (Lab 01)
WORKED_EXAMPLE = "worked_example.json"  # the book's tiny model and its printed numbers (Labs 03, 04)
HELDOUT_ESSAY = "heldout_essay.txt"  # ~1,000 tokens of English no model has seen, for perplexity (Lab 12)

# Inside an installed wheel, then the checkout's datasets/ (this file is course/labkit_course/data.py).
FOLDERS = (Path(__file__).resolve().parent / "datasets", Path(__file__).resolve().parents[2] / "datasets")


def data_path(name: str) -> Path:
    """The path of one of the course's data files, e.g. data_path(JARGON_FILE)."""
    for folder in FOLDERS:
        if (folder / name).is_file():
            return folder / name
    available = sorted(p.name for folder in FOLDERS if folder.is_dir() for p in folder.iterdir()
                       if p.suffix in (".txt", ".json"))
    raise FileNotFoundError(f"no data file {name!r} in {' or '.join(map(str, FOLDERS))} "
                            f"(there: {', '.join(available) or 'nothing'})")
