"""Grade one student's folder or a class of them: a table on screen, one JSON and one CSV report.

A folder of notebooks is one student; a folder of folders is a class (one student per folder).
Every lab the course grades gets a row for every student: a lab with no notebook counts 0 of its
points, a file that cannot be graded (not a notebook, a symbolic link, too large) is one row with
its reason, and a second copy of a lab (`Copy of 03_x.ipynb`, `03_x (1).ipynb`) is named, not
graded twice. Scores come from `labkit.grading.session` (the student's code in a contained kernel,
the graders here); the report is written only after every kernel and all they started are gone.
"""

import csv
import json
import re
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path

from labkit.grading import integrity, sandbox
from labkit.grading.core import Outcome, exercises

LAB_FILE = re.compile(r"^(?:Copy of )?(\d\d)_[^/]*?(?: ?\(\d+\))?\.ipynb$")
COPY_MARK = re.compile(r"^Copy of |(?: ?\(\d+\))\.ipynb$")
TERMINAL_ESCAPE = re.compile(r"\x1b\[[0-?]*[ -/]*[@-~]|\x1b\][^\x07\x1b]*(?:\x07|\x1b\\)|\x1b.")
CONTROL = re.compile(r"[\x00-\x1f\x7f-\x9f]+")


@dataclass
class LabReport:
    lab: str
    notebook: str  # the file graded, or "" when none was
    outcomes: list[Outcome] = field(default_factory=list)
    student: str = ""
    note: str = ""  # why something was not graded, which cell stopped the run, duplicates
    seconds: float = 0.0

    @property
    def points(self) -> int:
        return sum(o.points for o in self.outcomes)

    @property
    def max_points(self) -> int:
        return sum(o.max_points for o in self.outcomes)

    @property
    def missing(self) -> bool:
        return not self.notebook and bool(self.outcomes)


def plain(text: str) -> str:
    """One line of plain text: terminal escape sequences and control characters removed."""
    return CONTROL.sub(" ", TERMINAL_ESCAPE.sub("", str(text))).strip()


def lab_of(path: Path) -> str | None:
    match = LAB_FILE.match(path.name)
    return match.group(1) if match else None


def course_labs() -> dict[str, list]:
    labs: dict[str, list] = {}
    for ex in exercises():
        labs.setdefault(ex.lab, []).append(ex)
    return dict(sorted(labs.items()))


def expected_names(root: Path = integrity.COURSE_ROOT) -> dict[str, str]:
    return {lab_of(p): p.name for p in sorted((root / "solutions").glob("*.ipynb")) if lab_of(p)}


def students_of(folder: Path) -> list[Path]:
    """One student (a folder with notebooks) or a class (a folder of student folders)."""
    if not folder.is_dir():
        raise FileNotFoundError(f"{folder} is not a folder")
    if any(p.suffix == ".ipynb" for p in folder.iterdir()):
        return [folder]
    students = sorted(p for p in folder.iterdir() if p.is_dir() and not p.is_symlink())
    if not students:
        raise FileNotFoundError(f"no lab notebooks (NN_name.ipynb) and no student folders in {folder}")
    return students


class ClassGrader:
    """Grades with graders loaded, and the course fingerprinted, before any student code runs."""

    def __init__(self, hidden: list[Path], limits: sandbox.Limits | None = None):
        self.labs = course_labs()
        self.expected = expected_names()
        self.fingerprint = integrity.fingerprint()
        self.limits = limits or sandbox.Limits()
        self.hidden = list(dict.fromkeys(p.resolve() for p in [integrity.COURSE_ROOT / "solutions", *hidden]))
        self.uids = sandbox.UidPool() if sandbox.mode() == "uid" else None

    def plan(self, student: Path) -> tuple[list[tuple[str, Path]], list[LabReport]]:
        """The notebooks to grade, and the rows already decided (missing labs, refused files)."""
        found: dict[str, list[Path]] = {}
        rows = []
        for path in sorted(student.iterdir()):
            lab = lab_of(path)
            if lab in self.labs:
                found.setdefault(lab, []).append(path)
            elif lab in self.expected:  # a lab without exercises: nothing to grade
                continue
            elif path.suffix == ".ipynb" or path.is_symlink():
                why = "not a lab of this course" if lab else "not named like a lab notebook (NN_name.ipynb)"
                rows.append(LabReport("--", path.name, note=f"not graded: {why}"))
        todo = []
        for lab, exs in self.labs.items():
            want = self.expected.get(lab, f"{lab}_name.ipynb")
            candidates = found.get(lab, [])
            if not candidates:
                rows.append(LabReport(lab, "", [Outcome(lab, ex.name, 0, ex.points, f"no notebook for lab {lab}: "
                                                        f"hand in {want}") for ex in exs], note="missing"))
                continue
            usable = [p for p in candidates if sandbox.refusal(p, self.limits) is None]
            if not usable:
                reason = sandbox.refusal(candidates[0], self.limits)
                rows.append(LabReport(lab, candidates[0].name, [Outcome(lab, ex.name, 0, ex.points, f"{reason}")
                                                               for ex in exs], note=reason))
                continue
            chosen = min(usable, key=lambda p: (p.name != want, bool(COPY_MARK.search(p.name)),
                                                -p.stat().st_mtime, p.name))
            others = [p.name for p in candidates if p != chosen]
            todo.append((lab, chosen))
            if others:
                rows.append(LabReport(lab, chosen.name, note="duplicate: also handed in "
                                      + ", ".join(others) + f"; only {chosen.name} is graded"))
        return todo, rows

    def grade(self, lab: str, path: Path) -> LabReport:
        from labkit.grading.session import NotANotebook, grade_contained

        started = time.monotonic()
        report = LabReport(lab, path.name)
        try:
            run = grade_contained(path, lab, self.hidden, self.limits, self.uids)
        except Exception as error:  # noqa: BLE001 - one broken file is one row, never the whole run
            first = (str(error).strip().splitlines() or [""])[0][:200]
            reason = f"not graded: {error}" if isinstance(error, NotANotebook) else \
                f"not graded: grading failed with {type(error).__name__}: {first}"
            report.outcomes = [Outcome(lab, ex.name, 0, ex.points, reason) for ex in self.labs[lab]]
            report.note = reason
        else:
            report.outcomes = [_explain_missing(o, run.failed_cells, run.stopped) if o.missing else o
                               for o in run.outcomes]
            notes = [f"cell {run.stopped[0]} {run.stopped[1]}; the cells after it were not run"] \
                if run.stopped else []
            report.note = "; ".join(notes + run.notes)
        finally:
            integrity.verify(self.fingerprint)
        report.seconds = time.monotonic() - started
        return report


def grade_folder(folder: Path, jobs: int = 2, hidden: list[Path] = (), limits: sandbox.Limits | None = None
                 ) -> list[LabReport]:
    """Every student's every lab, in order; notebooks are graded `jobs` at a time."""
    return grade_students(students_of(folder), jobs, [folder, *hidden], limits)


def grade_students(students: list[Path], jobs: int = 2, hidden: list[Path] = (),
                   limits: sandbox.Limits | None = None) -> list[LabReport]:
    """Each folder in `students` is one student, named after the folder."""
    grader = ClassGrader([*students, *hidden], limits)
    work, reports = [], []
    for student in students:
        todo, rows = grader.plan(student)
        for row in rows:
            row.student = student.name
        reports += rows
        work += [(student.name, lab, path) for lab, path in todo]
    with ThreadPoolExecutor(max_workers=max(1, jobs)) as pool:
        graded = list(pool.map(lambda item: grader.grade(item[1], item[2]), work))
    for (student, _, _), report in zip(work, graded, strict=True):
        report.student = student
    reports += graded
    for report in reports:
        report.note = plain(report.note)
        report.outcomes = [_honest(o) for o in report.outcomes]
    return sorted(reports, key=lambda r: (r.student, r.lab, not r.outcomes, r.notebook))


def all_passed(reports: list[LabReport]) -> bool:
    return all(o.passed for r in reports for o in r.outcomes)


def format_table(reports: list[LabReport]) -> str:
    several = len({r.student for r in reports}) > 1
    rows = [(("student",) if several else ()) + ("lab", "exercise", "score", "feedback")]
    for report in reports:
        who = (report.student,) if several else ()
        reasons = {o.message for o in report.outcomes}
        if len(report.outcomes) > 1 and len(reasons) == 1 and not report.points:  # missing, refused, broken
            rows.append(who + (report.lab, f"({len(report.outcomes)} exercises)", f"0/{report.max_points}",
                               f"✘ {reasons.pop()}"))
        else:
            rows += [who + (o.lab, o.name, f"{o.points}/{o.max_points}", f"{'✔' if o.passed else '✘'} {o.message}")
                     for o in report.outcomes]
        if report.note and report.note != "missing" and report.note not in {o.message for o in report.outcomes}:
            rows.append(who + (report.lab, "", "", f"{report.notebook}: {report.note}"))
    width = len(rows[0]) - 1
    widths = [max(len(r[i]) for r in rows) for i in range(width)]
    lines = ["  ".join(row[i].ljust(widths[i]) for i in range(width)) + "  " + row[-1] for row in rows]
    for student in dict.fromkeys(r.student for r in reports):
        mine = [r for r in reports if r.student == student]
        missing = sorted(r.lab for r in mine if r.missing)
        label = f"{student}: " if several else ""
        lines.append(f"{label}total {sum(r.points for r in mine)}/{sum(r.max_points for r in mine)}"
                     + (f" (missing labs: {', '.join(missing)})" if missing else ""))
    return "\n".join(lines)


def write_reports(reports: list[LabReport], path: Path) -> tuple[Path, Path]:
    """The JSON report at `path` and a CSV (one row per exercise) next to it."""
    stamp = datetime.now(UTC).isoformat(timespec="seconds")
    commit = integrity.course_commit()
    students = list(dict.fromkeys(r.student for r in reports))
    data = {
        "graded_at": stamp, "course_commit": commit, "sandbox": sandbox.mode(),
        "points": sum(r.points for r in reports), "max_points": sum(r.max_points for r in reports),
        "students": [
            {"student": s, "points": sum(r.points for r in reports if r.student == s),
             "max_points": sum(r.max_points for r in reports if r.student == s),
             "missing_labs": sorted(r.lab for r in reports if r.student == s and r.missing),
             "labs": [{"lab": r.lab, "notebook": r.notebook, "points": r.points, "max_points": r.max_points,
                       "note": r.note, "seconds": round(r.seconds, 2),
                       "exercises": [{"name": o.name, "points": o.points, "max_points": o.max_points,
                                      "passed": o.passed, "feedback": o.message} for o in r.outcomes]}
                      for r in reports if r.student == s]}
            for s in students
        ],
    }
    path.parent.mkdir(parents=True, exist_ok=True)
    _write_atomically(path, json.dumps(data, indent=2, ensure_ascii=False) + "\n")
    table = path.with_suffix(".csv")
    lines = []
    for r in reports:
        for o in r.outcomes or [None]:
            lines.append([r.student, r.lab, o.name if o else "", o.points if o else 0, o.max_points if o else 0,
                          o.message if o else r.note, r.notebook, r.note, stamp, commit, round(r.seconds, 2)])
    _write_atomically(table, _csv([["student", "lab", "exercise", "points", "max_points", "feedback", "notebook",
                                    "note", "timestamp", "course_commit", "seconds"], *lines]))
    return path, table


def _csv(rows: list[list]) -> str:
    import io

    out = io.StringIO()
    csv.writer(out, lineterminator="\n").writerows(rows)
    return out.getvalue()


def _write_atomically(path: Path, text: str) -> None:
    partial = path.with_name(path.name + ".partial")
    partial.write_text(text, encoding="utf-8")
    partial.replace(path)


def _honest(outcome: Outcome) -> Outcome:
    points = max(0, min(outcome.points, outcome.max_points))
    return Outcome(outcome.lab, outcome.name, points, outcome.max_points, plain(outcome.message), outcome.missing)


def _explain_missing(outcome: Outcome, failed_cells: dict[int, tuple[str, str]],
                     stopped: tuple[int, str] | None) -> Outcome:
    name = re.escape(outcome.missing)
    defines = re.compile(rf"^\s*(def|class)\s+{name}\b|^\s*{name}\s*=", re.MULTILINE)
    for index, (source, ename) in failed_cells.items():
        if defines.search(source):
            why = ("its cell is not filled in yet" if ename == "NotImplementedError"
                   else f"its cell (cell {index}) raised {ename}")
            return Outcome(outcome.lab, outcome.name, 0, outcome.max_points,
                           f"`{outcome.missing}` is not defined: {why}")
    if stopped is not None:
        return Outcome(outcome.lab, outcome.name, 0, outcome.max_points,
                       f"`{outcome.missing}` is not defined: cell {stopped[0]} {stopped[1]}, "
                       "so it and the cells after it did not run")
    return outcome
