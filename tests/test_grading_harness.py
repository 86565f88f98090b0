"""Check cells, outcomes and the score report, on a real kernel."""

import csv
import json

import nbformat
import pytest
import torch

from labkit.grading import ExerciseFailed, check
from labkit.grading.core import exercises, get_exercise, run_exercise
from labkit.grading.report import all_passed, format_table, grade_folder, plain, write_reports
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
        ({"softmax": lambda x: x.softmax(-1)}, "`torch.Tensor.softmax` is what this exercise asks you to write"),
        ({"softmax": lambda x: torch.special.softmax(x, -1)}, "`torch.special.softmax` is what this exercise"),
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


def test_report_grades_a_class_and_explains_failed_cells(tmp_path):
    klass = tmp_path / "class"
    for student in ("filled", "blank", "broken"):
        (klass / student).mkdir(parents=True)
    _lab00(klass / "filled", "def softmax(x):\n    e = (x - x.max(-1, keepdim=True).values).exp()\n"
                             "    return e / e.sum(-1, keepdim=True)")
    _lab00(klass / "blank", "def softmax(x):\n    raise NotImplementedError()")
    _lab00(klass / "broken", "1 / 0\ndef softmax(x):\n    return x")
    reports = grade_folder(klass)
    lab00 = {r.student: r.outcomes[0] for r in reports if r.lab == "00"}
    assert [lab00[s].passed for s in ("filled", "blank", "broken")] == [True, False, False]
    assert "not implemented yet" in lab00["blank"].message
    assert lab00["broken"].message == "`softmax` is not defined: its cell (cell 2) raised ZeroDivisionError"
    missing = [r for r in reports if r.missing]
    assert {r.student for r in missing} == {"filled", "blank", "broken"}
    assert {r.lab for r in missing} == {ex.lab for ex in exercises()} - {"00"}, "every lab the course has"
    assert all(o.points == 0 and "no notebook for lab" in o.message for r in missing for o in r.outcomes)
    assert not all_passed(reports)
    table = format_table(reports)
    max_points = sum(ex.points for ex in exercises())
    assert f"filled: total 1/{max_points} (missing labs: 01," in table
    json_path, csv_path = write_reports(reports, tmp_path / "out" / "grades.json")
    data = json.loads(json_path.read_text())
    assert (data["points"], data["max_points"]) == (1, 3 * max_points)
    filled = next(s for s in data["students"] if s["student"] == "filled")
    assert filled["labs"][0]["exercises"][0]["passed"] is True and "00" not in filled["missing_labs"]
    rows = list(csv.DictReader(csv_path.open()))
    assert {"student", "lab", "exercise", "points", "feedback", "timestamp", "course_commit", "seconds"} <= set(rows[0])
    assert len(rows) == 3 * len(exercises())


def test_plain_strips_escape_sequences_and_control_characters():
    assert plain("\x1b[31mred\x1b[0m\x1b]0;title\x07 line\r\nnext\x00") == "red line next"


def test_a_folder_without_labs_or_students_is_an_error(tmp_path):
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
