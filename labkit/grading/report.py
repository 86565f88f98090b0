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
import sys
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path

from labkit.grading import integrity, sandbox, workers
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
    sandbox: str = ""  # how its kernel was contained: "bwrap" or "none"

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


def escape(name: str) -> str:
    """A name a student chose (a file, a folder), on one line as typed: every character that is not
    printable (newlines, escape sequences, bidirectional overrides) shown as its escape code."""
    return "".join(c if c.isprintable() else c.encode("unicode_escape").decode("ascii") for c in name)


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
    """Plans a class's grading: which notebook of each student is graded for each lab, and the rows
    decided without running anything (missing labs, refused files, duplicates)."""

    def __init__(self, limits: sandbox.Limits | None = None):
        self.labs = course_labs()
        self.expected = expected_names()
        self.limits = limits or sandbox.Limits()

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
                                      + ", ".join(map(escape, others)) + f"; only {escape(chosen.name)} is graded"))
        return todo, rows


def grade_folder(folder: Path, jobs: int = 2, limits: sandbox.Limits | None = None, no_sandbox: bool = False,
                 progress: bool = False) -> list[LabReport]:
    """Every student's every lab, in order; notebooks are graded `jobs` at a time."""
    return grade_students(students_of(folder), jobs, limits, no_sandbox, progress)


def grade_students(students: list[Path], jobs: int = 2, limits: sandbox.Limits | None = None,
                   no_sandbox: bool = False, progress: bool = False) -> list[LabReport]:
    """Each folder in `students` is one student, named after the folder. Containment is bubblewrap, or
    none when `no_sandbox` says so; without bubblewrap and without it, SandboxUnavailable."""
    how = sandbox.mode(no_sandbox)
    grader = ClassGrader(limits)
    integrity.check_site_packages()
    everything = integrity.fingerprint(python=True)
    course = {key: value for key, value in everything.items() if not key.startswith("/")}
    work, reports = [], []
    for student in students:
        todo, rows = grader.plan(student)
        for row in rows:
            row.student = student.name
        reports += rows
        work += [workers.Job(student.name, lab, path) for lab, path in todo]

    def done(job: workers.Job, graded: workers.Graded) -> None:
        integrity.verify(course)  # a changed course stops the run before anything more is graded
        if progress:
            points = sum(o.points for o in graded.outcomes)
            print(f"graded {escape(job.student)} {job.lab} ({escape(job.path.name)}): "
                  f"{points}/{sum(o.max_points for o in graded.outcomes)} in {graded.seconds:.0f} s",
                  file=sys.stderr, flush=True)

    for job, graded in zip(work, workers.grade_all(work, jobs, grader.limits, how, done), strict=True):
        reports.append(LabReport(job.lab, job.path.name, graded.outcomes, job.student, graded.note, graded.seconds))
    integrity.verify(everything)
    for report in reports:
        report.note = plain(report.note)
        report.outcomes = [_honest(o) for o in report.outcomes]
        report.sandbox = how
    return sorted(reports, key=lambda r: (r.student, r.lab, not r.outcomes, r.notebook))


def all_passed(reports: list[LabReport]) -> bool:
    return all(o.passed for r in reports for o in r.outcomes)


def format_table(reports: list[LabReport]) -> str:
    several = len({r.student for r in reports}) > 1
    rows = [(("student",) if several else ()) + ("lab", "exercise", "score", "feedback")]
    for report in reports:
        who = (escape(report.student),) if several else ()
        reasons = {o.message for o in report.outcomes}
        if len(report.outcomes) > 1 and len(reasons) == 1 and not report.points:  # missing, refused, broken
            rows.append(who + (report.lab, f"({len(report.outcomes)} exercises)", f"0/{report.max_points}",
                               f"✘ {reasons.pop()}"))
        else:
            rows += [who + (o.lab, o.name, f"{o.points}/{o.max_points}", f"{'✔' if o.passed else '✘'} {o.message}")
                     for o in report.outcomes]
        if report.note and report.note != "missing" and report.note not in {o.message for o in report.outcomes}:
            rows.append(who + (report.lab, "", "", f"{escape(report.notebook)}: {report.note}"))
    width = len(rows[0]) - 1
    widths = [max(len(r[i]) for r in rows) for i in range(width)]
    lines = ["  ".join(row[i].ljust(widths[i]) for i in range(width)) + "  " + row[-1] for row in rows]
    for student in dict.fromkeys(r.student for r in reports):
        mine = [r for r in reports if r.student == student]
        missing = sorted(r.lab for r in mine if r.missing)
        label = f"{escape(student)}: " if several else ""
        lines.append(f"{label}total {sum(r.points for r in mine)}/{sum(r.max_points for r in mine)}"
                     + (f" (missing labs: {', '.join(missing)})" if missing else ""))
    return "\n".join(lines)


def write_reports(reports: list[LabReport], path: Path) -> tuple[Path, Path]:
    """The JSON report at `path` and a CSV (one row per exercise) next to it."""
    stamp = datetime.now(UTC).isoformat(timespec="seconds")
    commit = integrity.course_commit()
    students = list(dict.fromkeys(r.student for r in reports))
    data = {
        "graded_at": stamp, "course_commit": commit, "sandbox": ", ".join(sorted({r.sandbox for r in reports})),
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
            lines.append([_cell(r.student), r.lab, o.name if o else "", o.points if o else 0,
                          o.max_points if o else 0, o.message if o else r.note, _cell(r.notebook), r.note, stamp,
                          commit, round(r.seconds, 2)])
    _write_atomically(table, _csv([["student", "lab", "exercise", "points", "max_points", "feedback", "notebook",
                                    "note", "timestamp", "course_commit", "seconds"], *lines]))
    return path, table


def _csv(rows: list[list]) -> str:
    import io

    out = io.StringIO()
    csv.writer(out, lineterminator="\n").writerows(rows)
    return out.getvalue()


def _cell(name: str) -> str:
    """A student's name for a spreadsheet: one that starts like a formula (=, +, -, @) is quoted as text."""
    return "'" + name if name[:1] in ("=", "+", "-", "@", "\t", "\r") else name


def _write_atomically(path: Path, text: str) -> None:
    partial = path.with_name(path.name + ".partial")
    partial.write_text(text, encoding="utf-8")
    partial.replace(path)


def _honest(outcome: Outcome) -> Outcome:
    points = max(0, min(outcome.points, outcome.max_points))
    return Outcome(outcome.lab, outcome.name, points, outcome.max_points, plain(outcome.message), outcome.missing)
