"""The student-notebook generator: markers, indentation, hidden tests, errors, drift."""

import nbformat
import pytest

from labkit_course.grading.assign import MarkerError, generate, student_notebook, student_source


def test_solution_region_becomes_a_gap_at_the_marker_indentation():
    source = "def f(x):\n    ### BEGIN SOLUTION\n    y = x + 1\n    return y\n    ### END SOLUTION\n\nprint(1)"
    assert student_source(source, "nb, cell 1") == (
        "def f(x):\n    # YOUR CODE HERE\n    raise NotImplementedError()\n\nprint(1)"
    )


def test_hidden_tests_are_removed_and_top_level_regions_work():
    source = "### BEGIN SOLUTION\nx = 1\n### END SOLUTION\n### BEGIN HIDDEN TESTS\nassert x == 1\n### END HIDDEN TESTS"
    assert student_source(source, "w") == "# YOUR CODE HERE\nraise NotImplementedError()"


@pytest.mark.parametrize(
    ("source", "message"),
    [
        ("### BEGIN SOLUTION\nx = 1", "never closed"),
        ("x = 1\n### END SOLUTION", "without a matching"),
        ("### BEGIN SOLUTION\n### BEGIN HIDDEN TESTS\n", "inside the region"),
        ("### BEGIN HIDDEN TESTS\n### END SOLUTION", "without a matching"),
        ("### BEGIN SOLUTIONS\nx = 1", "unknown marker"),
    ],
)
def test_malformed_markers_name_notebook_cell_and_line(source, message):
    with pytest.raises(MarkerError, match=message) as error:
        student_source(source, "07_x.ipynb, cell 4")
    assert "07_x.ipynb, cell 4" in str(error.value)


def _notebook(*sources, outputs=True):
    nb = nbformat.v4.new_notebook()
    for source in sources:
        cell = nbformat.v4.new_code_cell(source)
        if outputs:
            cell.outputs = [nbformat.v4.new_output("stream", name="stdout", text="out\n")]
            cell.execution_count = 1
        nb.cells.append(cell)
    return nb


def test_changed_and_check_cells_lose_outputs_others_keep_them():
    nb = _notebook("print(1)", "### BEGIN SOLUTION\nx = 1\n### END SOLUTION", 'check("00", "softmax")')
    student = student_notebook(nb, "00_setup.ipynb")
    assert [len(c.outputs) for c in student.cells] == [1, 0, 0]
    assert student.cells[1].execution_count is None
    assert len(nb.cells[1].outputs) == 1, "the solution notebook itself is left untouched"


def test_markers_in_markdown_are_refused():
    nb = nbformat.v4.new_notebook()
    nb.cells.append(nbformat.v4.new_markdown_cell("### BEGIN SOLUTION\nanswer\n### END SOLUTION"))
    with pytest.raises(MarkerError, match="03_a.ipynb, cell 1: solution markers are only allowed in code"):
        student_notebook(nb, "03_a.ipynb")


def test_generate_writes_then_reports_drift_and_stale_files(tmp_path):
    solutions, notebooks = tmp_path / "solutions", tmp_path / "notebooks"
    solutions.mkdir()
    nbformat.write(_notebook("### BEGIN SOLUTION\nx = 1\n### END SOLUTION"), solutions / "01_a.ipynb")
    assert generate(solutions, notebooks, check_only=True) == [notebooks / "01_a.ipynb"]
    assert not notebooks.exists(), "check_only writes nothing"
    generate(solutions, notebooks)
    assert generate(solutions, notebooks, check_only=True) == []
    (notebooks / "99_stale.ipynb").write_text("{}")
    (notebooks / "01_a.ipynb").write_text("edited by hand")
    assert generate(solutions, notebooks, check_only=True) == [notebooks / "01_a.ipynb", notebooks / "99_stale.ipynb"]
    generate(solutions, notebooks)
    assert sorted(p.name for p in notebooks.iterdir()) == ["01_a.ipynb"]


def _outputs(nb):
    return [len(cell.outputs) for cell in nb.cells]


def test_cells_that_run_student_code_lose_outputs_transitively():
    nb = _notebook(
        "import torch",                                     # 0 course code: keeps its output
        "def f(x):\n    ### BEGIN SOLUTION\n    return x\n    ### END SOLUTION\n\nprint(f(1))",  # 1 the exercise
        "y = f(2)\nprint(y)",                               # 2 calls the student's f
        "z = [y] * 2\nprint(z)",                            # 3 uses what 2 computed from f
        "def g():\n    return f(3)",                        # 4 a helper that will call f
        "print(g())",                                       # 5 ... and a call of it
        "class Backend:\n    def __call__(self, q):\n        return f(q)\n\nmodel = Backend()",  # 6
        "print(model(4))",                                  # 7 runs f through an object
        "y = 5\nprint(y)",                                  # 8 rebinds y with course code
        "print(y, torch.ones(1))",                          # 9 reads the rebound y: keeps its output
        "%time w = f(6)",                                   # 10 a magic that runs f
        "for i in range(2):\n    print(i)",                 # 11 a loop variable reads nothing earlier
    )
    assert _outputs(student_notebook(nb, "05_x.ipynb")) == [1, 0, 0, 0, 0, 0, 0, 0, 1, 1, 0, 1]


def test_a_method_named_like_the_students_function_hides_its_cells_output():
    nb = _notebook(
        "def take(pool):\n    ### BEGIN SOLUTION\n    return pool.pop()\n    ### END SOLUTION",
        "class Buggy(Manager):\n    def take(self):\n        return 0\n\nprint(Buggy().take())",  # not theirs
        "class Other(Manager):\n    def give(self):\n        return 0\n\nprint(Other().give())",
    )
    assert _outputs(student_notebook(nb, "09_x.ipynb")) == [0, 0, 1]


def test_mutating_an_object_with_student_code_taints_it():
    nb = _notebook(
        "### BEGIN SOLUTION\ndef norm(x):\n    return x\n### END SOLUTION",
        "layers = {}\nprint(layers)",
        "layers['norm'] = norm",
        "print(layers['norm'](1))",
        "import math\nprint(math.pi)",
    )
    assert _outputs(student_notebook(nb, "05_x.ipynb")) == [0, 1, 0, 0, 1]


def test_nbval_markers_are_dropped_and_their_cells_keep_outputs():
    nb = _notebook("# NBVAL_IGNORE_OUTPUT\nprint('timing')", "x = 1  # NBVAL_SKIP stays: not a marker line\n"
                   "  # NBVAL_SKIP\nprint(x)")
    student = student_notebook(nb, "02_x.ipynb")
    assert [c.source for c in student.cells] == ["print('timing')", "x = 1  # NBVAL_SKIP stays: not a marker line\n"
                                                                   "print(x)"]
    assert _outputs(student) == [1, 1]
    assert "NBVAL_IGNORE_OUTPUT" in nb.cells[0].source, "the solution keeps its markers"


def test_generated_lab05_shows_nothing_the_student_has_not_computed():
    from pathlib import Path

    notebooks = Path(__file__).resolve().parents[1] / "notebooks"
    nb = nbformat.read(notebooks / "05_real_model_kv_cache.ipynb", as_version=4)
    code = [cell for cell in nb.cells if cell.cell_type == "code"]
    students = ("rms_norm(", "apply_rotary(", "attention_with_cache(", "YourKVCache(", "check(")
    calling = [cell for cell in code if any(name in cell.source for name in students)]
    assert len(calling) >= 7
    assert all(not cell.outputs for cell in calling), [cell.source[:60] for cell in calling if cell.outputs]
    assert not any("same tokens as labkit's" in str(cell.outputs) for cell in code)
    assert any(cell.outputs for cell in code), "course cells keep their outputs"
    for path in notebooks.glob("*.ipynb"):
        assert "NBVAL_" not in path.read_text(encoding="utf-8"), path.name
