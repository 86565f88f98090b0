"""The course's own files, fingerprinted before any student code runs and checked after each notebook.

Graders are loaded into the trusted process before the first kernel starts, so a student who
manages to edit `labkit/grading/labs/lab00.py` cannot change how anyone is graded in this run; the
check makes such an edit stop the run loudly, so that it cannot affect a later one either.
"""

import hashlib
import subprocess
from pathlib import Path

import labkit

COURSE_ROOT = Path(labkit.__file__).resolve().parents[1]
WATCHED = ("labkit", "Makefile", "pyproject.toml", "requirements.txt")


class CourseTampered(RuntimeError):
    """A course file changed while students' notebooks were being graded."""


def fingerprint(root: Path = COURSE_ROOT) -> dict[str, str]:
    digests = {}
    for name in WATCHED:
        top = root / name
        for path in sorted([top] if top.is_file() else top.rglob("*")):
            if path.is_file() and "__pycache__" not in path.parts:
                digests[str(path.relative_to(root))] = hashlib.sha256(path.read_bytes()).hexdigest()
            elif path.is_symlink():
                digests[str(path.relative_to(root))] = f"symlink to {path.readlink()}"
    return digests


def verify(before: dict[str, str], root: Path = COURSE_ROOT) -> None:
    after = fingerprint(root)
    changed = sorted(k for k in before.keys() | after.keys() if before.get(k) != after.get(k))
    if changed:
        raise CourseTampered("course files changed during grading, so no grade of this run can be trusted: "
                             + ", ".join(changed[:10]))


def course_commit(root: Path = COURSE_ROOT) -> str:
    """The checkout's commit, marked "+modified" if its files differ from it."""
    try:
        commit = subprocess.run(["git", "rev-parse", "HEAD"], cwd=root, capture_output=True, text=True,
                                timeout=30).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=root,
                               capture_output=True, text=True, timeout=30).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return "unknown"
    return (commit or "unknown") + ("+modified" if dirty else "")
