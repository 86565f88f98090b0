"""One repository address (labkit_course.course) behind every "Open in Colab" badge and every lab's Colab cell."""

import json
from pathlib import Path

import pytest

from labkit_course import course

ROOT = Path(__file__).resolve().parent.parent
SOLUTIONS = sorted((ROOT / "solutions").glob("*.ipynb"))


def cells(path: Path) -> list[dict]:
    return json.loads(path.read_text(encoding="utf-8"))["cells"]


@pytest.mark.parametrize("path", SOLUTIONS, ids=lambda p: p.name)
def test_every_lab_starts_with_the_colab_setup_cell(path):
    first = cells(path)[0]
    assert first["cell_type"] == "code" and "".join(first["source"]) == course.colab_setup_cell()
    assert course.REPOSITORY in course.colab_setup_cell()


@pytest.mark.parametrize("path", SOLUTIONS, ids=lambda p: p.name)
def test_every_student_notebook_carries_its_badge_first(path):
    markdown = next(c for c in cells(ROOT / "notebooks" / path.name) if c["cell_type"] == "markdown")
    assert "".join(markdown["source"]).startswith(course.colab_badge(path.name) + "\n\n# Lab ")
    assert not any("colab-badge" in "".join(c["source"]) for c in cells(path)), "solutions carry no badge"


def test_the_readme_links_every_lab_to_colab():
    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    for path in SOLUTIONS:
        assert course.colab_badge(path.name) in readme, path.name


def test_colab_url_points_at_the_student_notebook():
    assert course.colab_url("05_x.ipynb") == (
        "https://colab.research.google.com/github/"
        + course.REPOSITORY.removeprefix("https://github.com/") + f"/blob/{course.BRANCH}/notebooks/05_x.ipynb")
