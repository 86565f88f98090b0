"""Check cells, outcomes and the score report, on a real kernel."""

import json

import nbformat
import pytest

from labkit.grading import ExerciseFailed, check
from labkit.grading.core import get_exercise, run_exercise
from labkit.grading.report import format_table, grade_folder, write_json
from labkit.grading.selfcheck import wiring_problems


def good_softmax(x):
    e = (x - x.max(-1, keepdim=True).values).exp()
    return e / e.sum(-1, keepdim=True)


def test_check_prints_success_and_raises_a_readable_failure(capsys):
    check("00", "softmax", {"softmax": good_softmax})
    assert capsys.readouterr().out.startswith("✔ softmax:")
    with pytest.raises(ExerciseFailed, match="softmax: exp overflowed"):
        check("00", "softmax", {"softmax": lambda x: x.exp() / x.exp().sum(-1, keepdim=True)})
    assert ExerciseFailed("x")._render_traceback_() == ["✘ x"]


def test_check_reads_the_callers_globals():
    global softmax
    softmax = good_softmax
    try:
        check("00", "softmax")
    finally:
        del softmax


@pytest.mark.parametrize(
    ("namespace", "reason"),
    [
        ({}, "`softmax` is not defined"),
        ({"softmax": 3}, "`softmax` should be a function"),
        ({"softmax": lambda x: (_ for _ in ()).throw(NotImplementedError())}, "not implemented yet"),
        ({"softmax": lambda x: x[99]}, "your code raised IndexError"),
        ({"softmax": lambda x: x.softmax(-1)}, "torch's softmax is what you are rebuilding"),
        ({"softmax": lambda x: x.exp() / x.exp().sum(0)}, "the wrong axis"),
    ],
)
def test_every_failure_becomes_one_reason(namespace, reason):
    outcome = run_exercise(get_exercise("00", "softmax"), namespace)
    assert not outcome.passed and outcome.points == 0
    assert reason in outcome.message
    assert "\n" not in outcome.message


def test_unknown_exercise_lists_the_labs_exercises():
    with pytest.raises(KeyError, match="its exercises: softmax"):
        check("00", "nope", {})


def _lab00(folder, body):
    nb = nbformat.v4.new_notebook()
    nb.cells = [nbformat.v4.new_code_cell("import torch"), nbformat.v4.new_code_cell(body)]
    nbformat.write(nb, folder / "00_setup.ipynb")


def test_report_grades_student_definitions_and_explains_failed_cells(tmp_path):
    filled, blank, broken = (tmp_path / d for d in ("filled", "blank", "broken"))
    for folder in (filled, blank, broken):
        folder.mkdir()
    _lab00(filled, "def softmax(x):\n    e = (x - x.max(-1, keepdim=True).values).exp()\n"
                   "    return e / e.sum(-1, keepdim=True)")
    _lab00(blank, "def softmax(x):\n    raise NotImplementedError()")
    _lab00(broken, "1 / 0\ndef softmax(x):\n    return x")
    reports = grade_folder(tmp_path / "filled") + grade_folder(blank) + grade_folder(broken)
    # Lab 00's knowledge check (no `answers` in these notebooks) fails in all three.
    assert [o.passed for r in reports for o in r.outcomes if o.name == "softmax"] == [True, False, False]
    assert "not implemented yet" in reports[1].outcomes[0].message
    assert reports[2].outcomes[0].message == "`softmax` is not defined: its cell (cell 2) raised ZeroDivisionError"
    table = format_table(reports)
    assert "total 1/6" in table
    write_json(reports, tmp_path / "report.json")
    data = json.loads((tmp_path / "report.json").read_text())
    assert (data["points"], data["max_points"]) == (1, 6)
    assert data["labs"][0]["exercises"][0]["passed"] is True


def test_a_folder_without_labs_is_an_error(tmp_path):
    with pytest.raises(FileNotFoundError, match="no lab notebooks"):
        grade_folder(tmp_path)


def test_wiring_finds_graders_without_check_cells_and_check_cells_without_graders(tmp_path):
    nb = nbformat.v4.new_notebook()
    nb.cells = [nbformat.v4.new_code_cell('check("00", "unknown_exercise")')]
    nbformat.write(nb, tmp_path / "00_setup.ipynb")
    problems = wiring_problems(tmp_path)
    assert "grader 00/softmax has no check cell in its notebook" in problems
    assert "check cell 00/unknown_exercise has no grader" in problems


def test_execute_is_reproducible_and_keeps_machine_dependent_outputs(tmp_path):
    from labkit.grading.execute import execute_in_place

    nb = nbformat.v4.new_notebook()
    nb.cells = [nbformat.v4.new_code_cell("for i in range(3):\n    print(i, flush=True)"),
                nbformat.v4.new_code_cell("# NBVAL_IGNORE_OUTPUT\nimport time\nprint(time.time_ns())")]
    path = tmp_path / "01_x.ipynb"
    nbformat.write(nb, path)
    execute_in_place(path)
    first = path.read_text()
    stored = nbformat.read(path, 4)
    assert stored.cells[0].outputs[0].text == "0\n1\n2\n", "stream chunks are merged into one output"
    assert "execution" not in stored.cells[0].metadata
    execute_in_place(path)
    assert path.read_text() == first
    execute_in_place(path, refresh_machine_dependent=True)
    assert path.read_text() != first
