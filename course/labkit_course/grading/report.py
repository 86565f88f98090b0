"""Grade one student's folder or a class of them: a table on screen, one JSON and one CSV report.

A folder of notebooks is one student; a folder of folders is a class (one student per folder).
Every lab the course grades gets a row for every student: a lab with no notebook counts 0 of its
points, a file that cannot be graded (not a notebook, a symbolic link, too large) is one row with
its reason, and a second copy of a lab (`Copy of 03_x.ipynb`, `03_x (1).ipynb`) is named, not
graded twice. Scores come from `labkit_course.grading.session` (the student's code in a contained kernel,
the graders here); the report is written only after every kernel and all they started are gone.
"""

import csv
import json
import re
import sys
import unicodedata
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path

from labkit_course.grading import integrity, sandbox, workers
from labkit_course.grading.core import Outcome, exercises

LAB_FILE = re.compile(r"^(?:Copy of )?(\d\d)_[^/]*?(?: ?\(\d+\))?\.ipynb$")
COPY_MARK = re.compile(r"^Copy of |(?: ?\(\d+\))\.ipynb$")
TERMINAL_ESCAPE = re.compile(r"\x1b\[[0-?]*[ -/]*[@-~]|\x1b\][^\x07\x1b]*(?:\x07|\x1b\\)|\x1b.")
INVISIBLE = {"Cc", "Cf", "Zl", "Zp"}  # control, format (bidi overrides, zero-width), line and paragraph separators


@dataclass(frozen=True)
class Options:
    """How a class is graded."""

    jobs: int = 2  # notebooks graded at once
    limits: sandbox.Limits = field(default_factory=sandbox.Limits)
    no_sandbox: bool = False  # grade without bubblewrap (trusted notebooks only)
    labs: tuple[str, ...] = ()  # the labs assigned so far ("00", "06"); empty: every lab the course grades
    progress: bool = False  # a line on stderr as each notebook is graded
    dask: str = ""  # a Dask scheduler's address, or "local:N" for N workers here; empty: `jobs` workers here


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
    """One line of plain text: terminal escape sequences removed, and control characters, line and
    paragraph separators and invisible format characters (bidirectional overrides) made spaces."""
    kept = []
    for c in TERMINAL_ESCAPE.sub("", str(text)):
        if unicodedata.category(c) not in INVISIBLE:
            kept.append(c)
        elif kept and kept[-1] != "\0":
            kept.append("\0")  # a run of them is one space
    return "".join(kept).replace("\0", " ").strip()


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
    """One student (a folder of notebooks) or a class (a folder of student folders, each named after its
    student, files beside them ignored); a folder with both is ambiguous, and refused."""
    if not folder.is_dir():
        raise FileNotFoundError(f"{folder} is not a folder")
    notebooks = [p for p in folder.iterdir() if p.suffix == ".ipynb" and not p.name.startswith(".")]
    students = sorted(p for p in folder.iterdir() if p.is_dir() and not p.is_symlink() and not p.name.startswith("."))
    if notebooks and students:
        raise FileNotFoundError(f"{folder} holds notebooks ({escape(notebooks[0].name)}, ...) and folders "
                                f"({escape(students[0].name)}, ...): hand in one student's notebooks, or a class "
                                "as one folder per student")
    if notebooks:
        return [folder]
    if not students:
        raise FileNotFoundError(f"no lab notebooks (NN_name.ipynb) and no student folders in {folder}")
    return students


class ClassGrader:
    """Plans a class's grading: which notebook of each student is graded for each lab, and the rows
    decided without running anything (missing labs, refused files, duplicates)."""

    def __init__(self, options: Options):
        every = course_labs()
        unknown = sorted(set(options.labs) - set(every))
        if unknown:
            raise ValueError(f"no lab {', '.join(unknown)} in this course: its graded labs are {', '.join(every)}")
        self.labs = {lab: exs for lab, exs in every.items() if not options.labs or lab in options.labs}
        self.other_labs = set(every) - set(self.labs)  # graded another time: their notebooks are skipped
        self.expected = expected_names()
        self.limits = options.limits

    def plan(self, student: Path) -> tuple[list[tuple[str, Path]], list[LabReport]]:
        """The notebooks to grade, and the rows already decided (missing labs, refused files)."""
        found: dict[str, list[Path]] = {}
        rows = []
        for path in sorted(student.iterdir()):
            lab = lab_of(path)
            if lab in self.labs:
                found.setdefault(lab, []).append(path)
            elif lab in self.other_labs or lab in self.expected or path.name.startswith("."):
                continue  # not assigned now, a lab without exercises, or hidden (.ipynb_checkpoints)
            else:
                rows.append(LabReport("--", path.name, note=f"not graded: {_stray(path, lab)}"))
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


def _stray(path: Path, lab: str | None) -> str:
    """Why a file in a student's folder is not one of the course's notebooks."""
    if path.is_symlink():
        return "a symbolic link, not a notebook"
    if path.is_dir():
        return "a folder (hand in the notebooks themselves)"
    if lab is not None:
        return f"lab {lab} is not a lab of this course"
    if path.suffix == ".ipynb":
        return "not named like a lab notebook (NN_name.ipynb)"
    return "not a notebook (hand in NN_name.ipynb files)"


def grade_folder(folder: Path, options: Options = Options()) -> list[LabReport]:
    """Every student's every (assigned) lab, in order."""
    return grade_students(students_of(folder), options)


def grade_students(students: list[Path], options: Options = Options()) -> list[LabReport]:
    """Each folder in `students` is one student, named after the folder. Containment is bubblewrap, or
    none when the options say so; without bubblewrap and without that, SandboxUnavailable."""
    how = sandbox.mode(options.no_sandbox)
    grader = ClassGrader(options)
    if options.progress and how == "none":
        print("grading WITHOUT a sandbox: the students' code runs with your privileges", file=sys.stderr)
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

    if options.progress:  # the graders load and the first kernel starts before the first notebook's line
        where = f"on the Dask cluster {options.dask}" if options.dask else f"{options.jobs} at a time"
        print(f"grading {_count(len(work), 'notebook')} of {_count(len(students), 'student')}, {where}...",
              file=sys.stderr, flush=True)

    def done(job: workers.Job, graded: workers.Graded) -> None:
        integrity.verify(course)  # a changed course stops the run before anything more is graded
        if options.progress:
            points = sum(o.points for o in graded.outcomes)
            print(f"graded {escape(job.student)} {job.lab} ({escape(job.path.name)}): "
                  f"{points}/{sum(o.max_points for o in graded.outcomes)} in {graded.seconds:.0f} s",
                  file=sys.stderr, flush=True)

    if options.dask:
        from labkit_course.grading.cluster import grade_on_dask

        results = grade_on_dask(work, options.dask, options.limits, how, done)
    else:
        results = workers.grade_all(work, options.jobs, options.limits, how, done)
    for job, graded in zip(work, results, strict=True):
        reports.append(LabReport(job.lab, job.path.name, graded.outcomes, job.student, graded.note, graded.seconds))
    integrity.verify(everything)
    for report in reports:
        report.note = plain(report.note)
        report.outcomes = [_honest(o) for o in report.outcomes]
        report.sandbox = how
    return sorted(reports, key=lambda r: (r.student, r.lab, not r.outcomes, r.notebook))


def all_passed(reports: list[LabReport]) -> bool:
    return all(o.passed for r in reports for o in r.outcomes)


def summary(reports: list[LabReport], slowest: int = 3) -> str:
    """The run in two lines: what was graded and whether all of it passed, and the slowest notebooks."""
    graded = [r for r in reports if r.notebook and r.outcomes]
    outcomes = [o for r in reports for o in r.outcomes]
    passed = sum(o.passed for o in outcomes)
    verdict = "every exercise passed" if passed == len(outcomes) else "not all passed"
    students = len({r.student for r in reports})
    stray = sum(1 for r in reports if not r.outcomes and r.note.startswith("not graded"))
    lines = [f"graded {_count(len(graded), 'notebook')} of {_count(students, 'student')}: "
             f"{passed} of {_count(len(outcomes), 'exercise')} passed, {verdict}"
             + (f"; {_count(stray, 'file')} not graded (see {'its row' if stray == 1 else 'their rows'})"
                if stray else "")]
    if graded:
        ranked = sorted(graded, key=lambda r: -r.seconds)[:slowest]
        lines.append("slowest: " + ", ".join(f"{escape(r.student)} {r.lab} ({r.seconds:.0f} s)" for r in ranked))
    return "\n".join(lines)


def _count(n: int, thing: str) -> str:
    return f"{n} {thing}{'' if n == 1 else 's'}"


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


def write_reports(reports: list[LabReport], path: Path) -> tuple[Path, Path, Path]:
    """The JSON report at `path`, a CSV with one row per exercise next to it, and a gradebook: one row
    per student, one column per lab graded and a total (`<name>-gradebook.csv`)."""
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
    book = path.with_name(path.stem + "-gradebook.csv")
    _write_atomically(book, _csv(gradebook(reports)))
    return path, table, book


def gradebook(reports: list[LabReport]) -> list[list]:
    """One row per student (named by their folder), a column per lab graded with its points, and the
    total; each column's name says its maximum. Nothing else: an LMS import matches each row to a user."""
    labs = sorted({r.lab for r in reports if r.outcomes})
    maxima = {lab: max(r.max_points for r in reports if r.lab == lab and r.outcomes) for lab in labs}
    rows = [["student", *(f"lab {lab} (out of {maxima[lab]})" for lab in labs),
             f"total (out of {sum(maxima.values())})"]]
    for student in sorted({r.student for r in reports}):
        points = {lab: sum(r.points for r in reports if r.student == student and r.lab == lab) for lab in labs}
        rows.append([_cell(student), *(points[lab] for lab in labs), sum(points.values())])
    return rows


def _csv(rows: list[list]) -> str:
    import io

    out = io.StringIO()
    csv.writer(out, lineterminator="\n").writerows(rows)
    return out.getvalue()


def _cell(name: str) -> str:
    """A name a student chose (a folder, a notebook), for a spreadsheet: escaped as the printed table
    shows it (no escape sequences or line breaks), and quoted as text if it starts like a formula."""
    name = escape(name)
    return "'" + name if name[:1] in ("=", "+", "-", "@") else name


def _write_atomically(path: Path, text: str) -> None:
    partial = path.with_name(path.name + ".partial")
    partial.write_text(text, encoding="utf-8")
    partial.replace(path)


def _honest(outcome: Outcome) -> Outcome:
    points = max(0, min(outcome.points, outcome.max_points))
    return Outcome(outcome.lab, outcome.name, points, outcome.max_points, plain(outcome.message), outcome.missing)
