"""A class graded on a Dask cluster gives the report `--jobs` gives (issue 32)."""

import nbformat
import pytest

from labkit_course.grading import integrity, sandbox
from labkit_course.grading.cluster import grade_remotely
from labkit_course.grading.report import Options, grade_folder

NO_SANDBOX = sandbox.bwrap_problem() is not None
GOOD = "def softmax(x):\n    e = (x - x.max(-1, keepdim=True).values).exp()\n    return e / e.sum(-1, keepdim=True)"


def _class(root):
    bodies = {"ada": GOOD, "bob": "def softmax(x):\n    return x", "cy": "1 / 0", "di": GOOD}
    for student, body in bodies.items():
        (root / student).mkdir(parents=True)
        nb = nbformat.v4.new_notebook(cells=[nbformat.v4.new_code_cell(c) for c in ("import torch", body)])
        nbformat.write(nb, root / student / "00_setup.ipynb")
    return root


def _comparable(reports):
    return [(r.student, r.lab, r.notebook, r.note, r.sandbox, [(o.name, o.points, o.max_points, o.message)
                                                             for o in r.outcomes]) for r in reports]


def test_two_local_dask_workers_grade_as_one_worker_here(tmp_path):
    klass = _class(tmp_path / "class")
    here = grade_folder(klass, Options(jobs=1, labs=("00",), no_sandbox=NO_SANDBOX))
    on_dask = grade_folder(klass, Options(dask="local:2", labs=("00",), no_sandbox=NO_SANDBOX))
    assert _comparable(on_dask) == _comparable(here)
    assert [r.points for r in here if r.outcomes] == [2 - 1, 0, 0, 2 - 1], "softmax right; no quiz answers"


def test_a_worker_with_another_course_is_refused(tmp_path):
    (tmp_path / "00_setup.ipynb").write_text(nbformat.writes(nbformat.v4.new_notebook()))
    with pytest.raises(integrity.CourseTampered, match="is not the grader's"):
        grade_remotely("ada", "00", "00_setup.ipynb", b"{}", sandbox.Limits(), "none", "0" * 64)
    assert integrity.digest(integrity.fingerprint()) != "0" * 64


def test_a_scheduler_without_tls_is_refused(tmp_path):
    """Anyone who can connect to a Dask scheduler runs code on its workers: plain tcp:// is refused."""
    from labkit_course.grading.cluster import grade_on_dask

    with pytest.raises(ValueError, match="without TLS"):
        grade_on_dask([], "tcp://127.0.0.1:8786", sandbox.Limits(), "none")
