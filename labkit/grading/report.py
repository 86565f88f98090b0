"""Grade a folder of filled-in notebooks: a score table on screen and a JSON report.

Each notebook runs top to bottom in its own kernel (a failing cell costs only the exercises that
depend on it); then the lab's graders run in that kernel against the student's own definitions.
"""

import json
import re
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, field
from pathlib import Path

from labkit.grading.core import Outcome, exercises, run_exercise
from labkit.grading.execute import run_then_evaluate

LAB_FILE = re.compile(r"^(\d\d)_.*\.ipynb$")
PROBE = "from labkit.grading.report import outcomes_json\nprint(outcomes_json({lab!r}, globals()))"


@dataclass
class LabReport:
    lab: str
    notebook: str
    outcomes: list[Outcome] = field(default_factory=list)

    @property
    def points(self) -> int:
        return sum(o.points for o in self.outcomes)

    @property
    def max_points(self) -> int:
        return sum(o.max_points for o in self.outcomes)


def outcomes_json(lab: str, namespace: dict) -> str:
    """Runs inside the student's kernel: grade every exercise of `lab` there."""
    return json.dumps([asdict(run_exercise(ex, namespace)) for ex in exercises(lab)])


def lab_of(path: Path) -> str | None:
    match = LAB_FILE.match(path.name)
    return match.group(1) if match else None


def grade_notebook(path: Path) -> LabReport:
    lab = lab_of(path)
    report = LabReport(lab, path.name)
    if not exercises(lab):
        return report
    nb, printed = run_then_evaluate(path, PROBE.format(lab=lab))
    if printed is None:
        report.outcomes = [
            Outcome(lab, ex.name, 0, ex.points, "the notebook's kernel died or a cell ran out of time")
            for ex in exercises(lab)
        ]
        return report
    failed_cells = _failed_cells(nb)
    for raw in json.loads(printed.strip().splitlines()[-1]):
        outcome = Outcome(**raw)
        if outcome.missing:
            outcome = _explain_missing(outcome, failed_cells)
        report.outcomes.append(outcome)
    return report


def grade_folder(folder: Path, jobs: int = 2) -> list[LabReport]:
    paths = sorted(p for p in folder.glob("*.ipynb") if lab_of(p))
    if not paths:
        raise FileNotFoundError(f"no lab notebooks (NN_name.ipynb) in {folder}")
    with ThreadPoolExecutor(max_workers=jobs) as pool:
        return list(pool.map(grade_notebook, paths))


def format_table(reports: list[LabReport]) -> str:
    rows = [("lab", "exercise", "score", "feedback")]
    for report in reports:
        for o in report.outcomes:
            mark = "✔" if o.passed else "✘"
            rows.append((o.lab, o.name, f"{o.points}/{o.max_points}", f"{mark} {o.message}"))
    widths = [max(len(r[i]) for r in rows) for i in range(3)]
    lines = ["  ".join(row[i].ljust(widths[i]) for i in range(3)) + "  " + row[3] for row in rows]
    total = sum(r.points for r in reports), sum(r.max_points for r in reports)
    lines.append(f"total {total[0]}/{total[1]}")
    return "\n".join(lines)


def write_json(reports: list[LabReport], path: Path) -> None:
    data = {
        "points": sum(r.points for r in reports),
        "max_points": sum(r.max_points for r in reports),
        "labs": [
            {"lab": r.lab, "notebook": r.notebook, "points": r.points, "max_points": r.max_points,
             "exercises": [{"name": o.name, "points": o.points, "max_points": o.max_points,
                            "passed": o.passed, "feedback": o.message} for o in r.outcomes]}
            for r in reports
        ],
    }
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(data, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")


def _failed_cells(nb) -> dict[int, tuple[str, str]]:
    """Cell number (1-based) -> (source, error name) for every cell that raised."""
    failed = {}
    for index, cell in enumerate(nb.cells, start=1):
        for output in cell.get("outputs", []):
            if output.get("output_type") == "error":
                failed[index] = (cell.source, output.get("ename", "an error"))
    return failed


def _explain_missing(outcome: Outcome, failed_cells: dict[int, tuple[str, str]]) -> Outcome:
    name = re.escape(outcome.missing)
    defines = re.compile(rf"^\s*(def|class)\s+{name}\b|^\s*{name}\s*=", re.MULTILINE)
    for index, (source, ename) in failed_cells.items():
        if defines.search(source):
            why = ("its cell is not filled in yet" if ename == "NotImplementedError"
                   else f"its cell (cell {index}) raised {ename}")
            return Outcome(outcome.lab, outcome.name, 0, outcome.max_points,
                           f"`{outcome.missing}` is not defined: {why}")
    return outcome
