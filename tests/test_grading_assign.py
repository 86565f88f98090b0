"""The student-notebook generator: markers, indentation, hidden tests, errors, drift."""

import nbformat
import pytest

from labkit.grading.assign import MarkerError, generate, student_notebook, student_source


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
