"""Check cells, outcomes and the score report, on a real kernel."""

import csv
import json
import os
import random
import subprocess
import sys
from pathlib import Path

import nbformat
import pytest
import torch

from labkit_course.grading import ExerciseFailed, check, core, sandbox
from labkit_course.grading.core import Outcome, exercises, get_exercise, run_exercise
from labkit_course.grading.report import (
    LabReport,
    Options,
    all_passed,
    format_table,
    grade_folder,
    gradebook,
    plain,
    summary,
    write_reports,
)
from labkit_course.grading.selfcheck import wiring_problems


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


def test_a_crash_names_the_line_of_the_students_cell():
    cell = "def helper(x):\n    return x[99]\n\ndef softmax(x):\n    return helper(x)\n"
    namespace = {}
    exec(compile(cell, "<ipython-input-3-5e1f>", "exec"), namespace)
    outcome = run_exercise(get_exercise("00", "softmax"), namespace)
    assert outcome.message.endswith("(in helper, line 2 of its cell)")  # no source: linecache has no such cell


def test_inputs_come_from_the_published_seeds_unless_a_secret_is_kept(monkeypatch):
    monkeypatch.setattr(core, "_SECRET", 0)  # a notebook's check cells: the seeds published with the course
    assert core.case_seed(7) == 7 and core.seeded_random(7).random() == random.Random(7).random()
    assert torch.equal(core.float64_randn(3, seed=7), torch.randn(3, generator=torch.Generator().manual_seed(7),
                                                                   dtype=torch.float64))
    core.keep_inputs_secret()  # graded: a fresh secret for each notebook
    first = core.case_seed(7)
    assert first != 7 and core.case_seed(7) == first and core.case_seed(8) not in (8, first)
    core.keep_inputs_secret()
    assert core.case_seed(7) != first
    core.keep_inputs_secret(5)
    again = core.case_seed(7)
    core.keep_inputs_secret(5)
    assert core.case_seed(7) == again and 0 <= again < 2**63


def test_a_graded_generator_is_keyed_by_the_whole_seed_not_torchs_32_bits(monkeypatch):
    pair = (5, 5 + 2**32)
    assert torch.equal(*(torch.randn(4, generator=torch.Generator().manual_seed(s)) for s in pair)), "torch's 32 bits"
    monkeypatch.setattr(core, "_SECRET", 123)
    drawn = []
    for seed in pair:
        monkeypatch.setattr(core, "case_seed", lambda _, seed=seed: seed)
        drawn.append([torch.randn(4, generator=core.seeded_generator(0)) for _ in range(2)])
    assert all(torch.equal(*draws) for draws in drawn), "the same seed, the same stream"
    assert not torch.equal(drawn[0][0], drawn[1][0])


def test_unknown_exercise_lists_the_labs_exercises():
    with pytest.raises(KeyError, match="its exercises: softmax"):
        check("00", "nope", {})


def _lab00(folder, body):
    nb = nbformat.v4.new_notebook()
    nb.cells = [nbformat.v4.new_code_cell("import torch"), nbformat.v4.new_code_cell(body)]
    nbformat.write(nb, folder / "00_setup.ipynb")


def test_report_grades_a_class_and_explains_failed_cells(tmp_path):
    klass = tmp_path / "class"
    for student in ("filled", "blank", "broken", "crashes"):
        (klass / student).mkdir(parents=True)
    _lab00(klass / "filled", "def softmax(x):\n    e = (x - x.max(-1, keepdim=True).values).exp()\n"
                             "    return e / e.sum(-1, keepdim=True)")
    _lab00(klass / "blank", "def softmax(x):\n    raise NotImplementedError()")
    _lab00(klass / "broken", "1 / 0\ndef softmax(x):\n    return x")
    _lab00(klass / "crashes", "def softmax(x):\n    return x[99]")
    reports = grade_folder(klass)
    lab00 = {r.student: r.outcomes[0] for r in reports if r.lab == "00"}
    assert [lab00[s].passed for s in ("filled", "blank", "broken")] == [True, False, False]
    assert "not implemented yet" in lab00["blank"].message
    assert lab00["broken"].message == "`softmax` is not defined: its cell (cell 2) raised ZeroDivisionError"
    assert lab00["crashes"].message.startswith("your code raised IndexError: ")
    assert lab00["crashes"].message.endswith("(in softmax, line 2 of its cell: `return x[99]`)")
    missing = [r for r in reports if r.missing]
    assert {r.student for r in missing} == {"filled", "blank", "broken", "crashes"}
    assert {r.lab for r in missing} == {ex.lab for ex in exercises()} - {"00"}, "every lab the course has"
    assert all(o.points == 0 and "no notebook for lab" in o.message for r in missing for o in r.outcomes)
    assert not all_passed(reports)
    table = format_table(reports)
    max_points = sum(ex.points for ex in exercises())
    assert f"filled: total 1/{max_points} (missing labs: 01," in table
    json_path, csv_path, _ = write_reports(reports, tmp_path / "out" / "grades.json")
    data = json.loads(json_path.read_text())
    assert (data["points"], data["max_points"]) == (1, 4 * max_points)
    filled = next(s for s in data["students"] if s["student"] == "filled")
    assert filled["labs"][0]["exercises"][0]["passed"] is True and "00" not in filled["missing_labs"]
    rows = list(csv.DictReader(csv_path.open()))
    assert {"student", "lab", "exercise", "points", "feedback", "timestamp", "course_commit", "seconds"} <= set(rows[0])
    assert len(rows) == 4 * len(exercises())


def test_an_assignment_grades_its_labs_only_and_names_what_is_missing_or_stray(tmp_path):
    """`--labs 00,06`: totals over those labs, a missing one counts 0 and is named, other labs' notebooks
    are left for their own assignment, and a stray file gets a row saying why it was not graded."""
    klass = tmp_path / "class"
    for student in ("ada", "bob"):
        (klass / student).mkdir(parents=True)
        _lab00(klass / student, "def softmax(x):\n    e = (x - x.max(-1, keepdim=True).values).exp()\n"
                                "    return e / e.sum(-1, keepdim=True)")
    nbformat.write(nbformat.v4.new_notebook(), klass / "ada" / "06_sampling.ipynb")  # an empty lab 06
    nbformat.write(nbformat.v4.new_notebook(), klass / "bob" / "05_real_model_kv_cache.ipynb")  # not assigned
    (klass / "bob" / "notes.txt").write_text("my notes")
    (klass / "bob" / ".ipynb_checkpoints").mkdir()
    reports = grade_folder(klass, Options(labs=("00", "06")))
    assert {r.lab for r in reports if r.outcomes} == {"00", "06"}
    six = sum(ex.points for ex in exercises("06"))
    totals = {s: (sum(r.points for r in reports if r.student == s), sum(r.max_points for r in reports
                                                                         if r.student == s)) for s in ("ada", "bob")}
    assert totals == {"ada": (1, 2 + six), "bob": (1, 2 + six)}
    assert [r.lab for r in reports if r.missing] == ["06"] and next(r for r in reports if r.missing).student == "bob"
    stray = [(r.student, r.notebook, r.note) for r in reports if not r.outcomes]
    assert stray == [("bob", "notes.txt", "not graded: not a notebook (hand in NN_name.ipynb files)")]
    _lab00(klass, "x = 1")  # a notebook beside the student folders: is it a student or a class?
    with pytest.raises(FileNotFoundError, match="holds notebooks .* and folders"):
        grade_folder(klass, Options(labs=("00",)))
    (klass / "00_setup.ipynb").unlink()
    table = format_table(reports)
    assert f"bob: total 1/{2 + six} (missing labs: 06)" in table and "05" not in table
    exercises_graded = 2 * len(exercises("00")) + 2 * len(exercises("06"))
    assert summary(reports).startswith(f"graded 3 notebooks of 2 students: 2 of {exercises_graded} exercises "
                                       "passed, not all passed; 1 file not graded (see its row)")
    with pytest.raises(ValueError, match="no lab 42 in this course"):
        grade_folder(klass, Options(labs=("00", "42")))


def test_the_gradebook_has_a_row_per_student_and_a_column_per_lab():
    def lab(student, lab, *points):
        return LabReport(lab, f"{lab}_x.ipynb", [Outcome(lab, f"e{i}", p, 1, "") for i, p in enumerate(points)],
                         student)

    reports = [lab("bob", "06", 1, 0, 1), lab("ada", "00", 1, 1), lab("ada", "06", 0, 0, 0), lab("bob", "00", 0, 1),
               LabReport("06", "", [Outcome("06", "e0", 0, 3, "no notebook")], "=cmd()")]
    assert gradebook(reports) == [["student", "lab 00 (out of 2)", "lab 06 (out of 3)", "total (out of 5)"],
                                  ["'=cmd()", 0, 0, 0], ["ada", 2, 0, 2], ["bob", 1, 2, 3]]


def test_the_command_says_in_words_that_it_graded_and_what_passed(tmp_path):
    (tmp_path / "ada").mkdir()
    _lab00(tmp_path / "ada", "def softmax(x):\n    return x")
    (tmp_path / "out").mkdir()
    report = tmp_path / "out" / "grades.json"  # --report may name a folder: the reports go in it
    done = subprocess.run([sys.executable, "-m", "labkit_course.grading", "grade", str(tmp_path / "ada"), "--labs", "0",
                           "--report", str(report.parent),
                           *([] if sandbox.bwrap_problem() is None else ["--no-sandbox"])],
                          capture_output=True, text=True, timeout=300, env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert done.returncode == 0, done.stderr[-2000:]
    assert "graded 1 notebook of 1 student: 0 of 2 exercises passed, not all passed" in done.stdout
    assert "slowest: " in done.stdout and "graded ada 00 (00_setup.ipynb): 0/2 in" in done.stderr
    book = list(csv.reader(report.with_name("grades-gradebook.csv").open()))
    assert book == [["student", "lab 00 (out of 2)", "total (out of 2)"], ["ada", "0", "0"]]
    bad = subprocess.run([sys.executable, "-m", "labkit_course.grading", "grade", str(tmp_path / "ada"), "--labs",
                          "99"], capture_output=True, text=True, timeout=300)
    assert bad.returncode == 2 and "no lab 99 in this course" in bad.stderr


def test_plain_strips_escape_sequences_and_control_characters():
    assert plain("\x1b[31mred\x1b[0m\x1b]0;title\x07 line\r\nnext\x00") == "red line next"
    assert plain("right\u202eto left\u2066\u2028next\u200b") == "right to left next", "bidi, separators, zero-width"


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
    from labkit_course.grading.execute import execute_in_place

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


def test_grading_skips_only_course_demonstrations_no_graded_name_depends_on():
    from labkit_course.grading.plan import graded_names, skipped_cells

    course = ["import torch\nfrom labkit_course.grading import check", "scale = 2.0", "logits = torch.randn(5)",
              "demo = softmax(logits)\nprint(demo)", 'check("00", "softmax")', "def softmax(x):\n    raise "
              "NotImplementedError()", "tokens = list(range(3))\ntokens.append(4)"]
    handed_out = nbformat.v4.new_notebook(cells=[nbformat.v4.new_code_cell(c) for c in course])
    student = nbformat.from_dict(handed_out)
    student.cells[5].source = "def softmax(x):\n    e = (scale * x).exp()\n    return e / e.sum(-1)"
    student.cells.insert(3, nbformat.v4.new_code_cell("print(torch.randn(2))"))  # the student's own: it runs
    assert {"softmax", "answers"} <= graded_names("00")
    skipped = skipped_cells(student, handed_out, graded_names("00"))
    assert sorted(skipped) == [2, 4, 5, 7], "the demo, its input, the check cell and an unused list are skipped"
    assert skipped_cells(student, None, graded_names("00")) == set(), "without the handed-out notebook, run all"
    student.cells[6].source = "def softmax(x):\n    return helper(x)"  # a helper the notebook defines later
    student.cells.append(nbformat.v4.new_code_cell("def helper(x):\n    return x.softmax(-1)"))
    handed_out.cells.append(student.cells[-1])
    assert len(student.cells) - 1 not in skipped_cells(student, handed_out, graded_names("00"))


def test_graders_read_only_the_names_grading_keeps_cells_for():
    """Skipping relies on it: a grader that `require`s another name would find it undefined."""
    import re

    from labkit_course.grading import labs
    from labkit_course.grading.plan import graded_names

    for path in sorted(Path(labs.__file__).parent.glob("lab*.py")):
        source = path.read_text()
        assert not re.search(r"require\(\s*\w+\s*,\s*[^\"'\s]", source), f"{path.name}: a name required by variable"
        required = set(re.findall(r"require\(\s*\w+\s*,\s*[\"'](\w+)[\"']", source))
        assert required <= graded_names(path.stem[3:]), (path.name, required - graded_names(path.stem[3:]))
