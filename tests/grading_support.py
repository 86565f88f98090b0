"""Helpers the grading tests share: a notebook from cell sources, and the codec's round trip."""

from pathlib import Path

import nbformat

from labkit_course.grading.codec import Decoder, Encoder, dumps, identity, loads


def write_notebook(folder: Path, name: str, *cells: str) -> Path:
    """A notebook of code cells at folder/name (the folder made if needed)."""
    folder.mkdir(parents=True, exist_ok=True)
    nb = nbformat.v4.new_notebook()
    nb.cells = [nbformat.v4.new_code_cell(c) for c in cells]
    nbformat.write(nb, folder / name)
    return folder / name


def write_back(sender: Encoder, receiver: Decoder) -> None:
    """What the student's side did to its copies (the objects `receiver` decoded) written back into the
    trusted side's originals (those `sender` encoded), through the wire as the grading channel does."""
    replier = Encoder(known={identity(obj): n for n, obj in receiver.objects.items()})
    updates = loads(dumps([[n, replier.contents(obj, n)] for n, obj in receiver.objects.items()]))
    originals = {sender.ids[identity(obj)]: obj for obj in sender.keep}
    writer = Decoder(known=originals)
    for n, node in updates:
        writer.fill(originals[n], node)
