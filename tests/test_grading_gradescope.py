"""The Gradescope autograder zip, run end to end in a simulated /autograder root (issue 32).

Gradescope unpacks the zip into /autograder/source, runs setup.sh once to build its image (here the
test's own environment stands for what setup.sh installs), then, for each submission, puts the
student's files in /autograder/submission, runs run_autograder and reads
/autograder/results/results.json.
"""

import json
import os
import subprocess
import sys
import zipfile
from pathlib import Path

import nbformat
import pytest

from labkit_course.grading import sandbox
from labkit_course.grading.core import exercises
from labkit_course.grading.integrity import COURSE_ROOT

BWRAP = sandbox.bwrap_problem() is None


@pytest.fixture(scope="module")
def autograder(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("zip") / "autograder.zip"
    done = subprocess.run([sys.executable, "-m", "labkit_course.grading", "gradescope-zip", "--labs", "0", "--out",
                           str(out)], cwd=COURSE_ROOT, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    return out


def _submit(autograder: Path, root: Path, files: dict[str, str]) -> dict:
    """Unpack the zip as Gradescope does, hand in `files` (name -> notebook JSON), run the autograder."""
    with zipfile.ZipFile(autograder) as zipped:
        for info in zipped.infolist():
            zipped.extract(info, root / "source")
            if info.external_attr >> 16 & 0o111:
                (root / "source" / info.filename).chmod(0o755)
    (root / "submission" / "nested").mkdir(parents=True)
    for name, text in files.items():
        (root / "submission" / name).write_text(text)
    env = {**os.environ, "AUTOGRADER_ROOT": str(root), "LABKIT_PYTHON": sys.executable}
    done = subprocess.run([str(root / "source" / "run_autograder")], env=env, capture_output=True, text=True,
                          timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    results = json.loads((root / "results" / "results.json").read_text())
    assert type(results["execution_time"]) is int and isinstance(results["output"], str)
    if BWRAP:  # Gradescope's results format: a score that is the sum of the tests' scores
        assert results["score"] == sum(t["score"] for t in results["tests"])
        assert [(t["name"], t["max_score"]) for t in results["tests"]] == [(f"lab 00: {ex.name}", ex.points)
                                                                            for ex in exercises("00")]
        assert all(set(t) == {"name", "score", "max_score", "output", "visibility"} for t in results["tests"])
    return results


def test_the_zip_holds_the_two_scripts_and_the_course(autograder):
    with zipfile.ZipFile(autograder) as zipped:
        names = set(zipped.namelist())
        modes = {info.filename: info.external_attr >> 16 for info in zipped.infolist()}
        run = zipped.read("run_autograder").decode()
    assert {"setup.sh", "run_autograder", "COURSE_COMMIT", "course/labkit_course/grading/session.py",
            "notebooks/00_setup.ipynb", "requirements.txt"} <= names
    assert not any(n.startswith(("solutions/", ".git", "tests/")) for n in names), "no answers in the zip"
    assert modes["setup.sh"] & 0o111 and modes["run_autograder"] & 0o111
    assert "gradescope-run --root \"$root\" --labs 00" in run


def test_a_correct_submission_scores_full_marks(autograder, tmp_path):
    solution = (COURSE_ROOT / "solutions" / "00_setup.ipynb").read_text()
    results = _submit(autograder, tmp_path, {"nested/lab0-final.ipynb": solution})
    if not BWRAP:
        assert results["score"] == 0 and "bubblewrap" in results["output"]
        return
    assert results["score"] == sum(ex.points for ex in exercises("00")), results


def test_a_wrong_submission_scores_zero_with_feedback(autograder, tmp_path):
    handed_out = (COURSE_ROOT / "notebooks" / "00_setup.ipynb").read_text()
    results = _submit(autograder, tmp_path, {"00_setup.ipynb": handed_out})
    assert results["score"] == 0
    if BWRAP:
        assert all(t["output"] for t in results["tests"]), "every test says why"


def test_another_labs_notebook_is_not_taken_for_this_lab(autograder, tmp_path):
    lab06 = (COURSE_ROOT / "solutions" / "06_sampling.ipynb").read_text()
    results = _submit(autograder, tmp_path, {"06_sampling.ipynb": lab06})
    assert results["score"] == 0
    if BWRAP:
        assert all(t["output"].startswith("no notebook for lab 00") for t in results["tests"]), results


def test_a_hostile_submission_cannot_write_its_own_results(autograder, tmp_path):
    forged = json.dumps({"score": 999, "tests": []})
    nb = nbformat.v4.new_notebook(cells=[nbformat.v4.new_code_cell(c) for c in (
        "import torch", "def softmax(x):\n    return x",
        f"for path in ({str(tmp_path / 'results' / 'results.json')!r}, '/autograder/results/results.json'):\n"
        f"    try:\n        open(path, 'w').write({forged!r})\n    except OSError:\n        pass")])
    results = _submit(autograder, tmp_path, {"00_setup.ipynb": nbformat.writes(nb)})
    assert results["score"] == 0 and "999" not in json.dumps(results)
