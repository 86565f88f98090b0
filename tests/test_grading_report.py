"""The CSV reports show the names a student chose as the printed table does: escaped, one row each."""

import csv

from labkit_course.grading.core import Outcome
from labkit_course.grading.report import LabReport, write_reports


def test_control_characters_in_names_never_reach_the_csv_raw(tmp_path):
    notebook, student = "00_x\x1b[2J\x07\nforged,row.ipynb", "mallory\r\nbob\x1b]0;title\x07"
    reports = [LabReport("00", notebook, [Outcome("00", "softmax", 0, 1, "wrong")], student),
               LabReport("00", "00_setup.ipynb", [Outcome("00", "softmax", 1, 1, "ok")], "alice")]
    _, table, book = write_reports(reports, tmp_path / "grades.json")
    for path, rows in ((table, 3), (book, 3)):
        text = path.read_text(encoding="utf-8")
        assert not any(c in text for c in "\x1b\x07\r"), path.name
        assert text.count("\n") == rows, f"{path.name}: one line per row"
    row = next(csv.DictReader(table.open(encoding="utf-8")))
    assert row["student"] == "mallory\\r\\nbob\\x1b]0;title\\x07"
    assert row["notebook"] == "00_x\\x1b[2J\\x07\\nforged,row.ipynb"
