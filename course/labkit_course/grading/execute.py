"""Run notebooks in a Jupyter kernel, the same way for `make execute` and for grading.

Stored outputs must be reproducible byte for byte: no timing metadata, no widget state, and
widget views (whose model ids are random) reduced to their text form. Cells marked
`# NBVAL_IGNORE_OUTPUT` show timings or machine-dependent figures; re-executing keeps their stored
outputs while their source is unchanged (so `make execute` twice leaves no diff), unless asked
to refresh them.
"""

import os
from pathlib import Path

import nbformat
from nbclient import NotebookClient

WIDGET_VIEW = "application/vnd.jupyter.widget-view+json"
CELL_TIMEOUT_S = 900
MACHINE_DEPENDENT = "# NBVAL_IGNORE_OUTPUT"


def _client(nb: nbformat.NotebookNode, cwd: Path, allow_errors: bool) -> NotebookClient:
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("PYDEVD_DISABLE_FILE_VALIDATION", "1")
    return NotebookClient(
        nb,
        timeout=CELL_TIMEOUT_S,
        kernel_name="python3",
        allow_errors=allow_errors,
        record_timing=False,
        store_widget_state=False,
        resources={"metadata": {"path": str(cwd)}},
    )


def normalize_outputs(nb: nbformat.NotebookNode) -> None:
    """Drop what changes from run to run although the computation did not."""
    for cell in nb.cells:
        if cell.cell_type != "code":
            continue
        cell.metadata.pop("execution", None)
        merged = []  # the kernel may split one print into several stream chunks, differently each run
        for output in cell.get("outputs", []):
            output.get("data", {}).pop(WIDGET_VIEW, None)
            previous = merged[-1] if merged else None
            if (output.output_type == "stream" and previous is not None
                    and previous.output_type == "stream" and previous.name == output.name):
                previous.text += output.text
            else:
                merged.append(output)
        cell.outputs = merged
    nb.metadata.pop("widgets", None)


def execute_in_place(path: Path, refresh_machine_dependent: bool = False) -> None:
    """Re-run a solution notebook top to bottom and store its outputs (any error stops it)."""
    nb = nbformat.read(path, as_version=nbformat.NO_CONVERT)
    kept = {
        cell.source: cell.outputs
        for cell in nb.cells
        if cell.cell_type == "code" and cell.source.startswith(MACHINE_DEPENDENT) and cell.outputs
    }
    _client(nb, path.parent, allow_errors=False).execute()
    normalize_outputs(nb)
    if not refresh_machine_dependent:
        for cell in nb.cells:
            if cell.cell_type == "code" and cell.source in kept:
                cell.outputs = kept[cell.source]
    path.write_text(nbformat.writes(nb) + "\n", encoding="utf-8")
