"""What grading runs on, fingerprinted before any student code runs and checked while it runs.

The course's own files (the graders among them) are hashed and checked after every notebook; the
Python that grades (the environment's and the interpreter's files, compiled ones included: a planted
`.pth` or `.pyc` runs in every later interpreter) is fingerprinted by metadata at the start and
checked again before the report is written. Grading writes no bytecode itself, so any change is
someone else's. Any change stops the run with no report. At the start, every `.pth`
and `sitecustomize` file in the environment must be one an installed package put there, with the
content its RECORD lists: a file planted by an earlier, unsandboxed run stops grading too.
"""

import base64
import hashlib
import importlib.metadata
import json
import os
import site
import sys
from pathlib import Path

import labkit

COURSE_ROOT = Path(labkit.__file__).resolve().parents[1]
# What grading trusts in the checkout: the code and graders, the handed-out notebooks (their cells are
# exempt from the course rules), and git's own configuration and hooks (commands git would run).
WATCHED = ("labkit", "course", "datasets", "notebooks", "Makefile", "pyproject.toml", "requirements.txt",
           ".git/config", ".git/hooks")
STARTUP_FILES = ("sitecustomize.py", "usercustomize.py")


class CourseTampered(RuntimeError):
    """A course file or the grading Python changed, or holds a file no package installed."""


def fingerprint(root: Path = COURSE_ROOT, python: bool = False) -> dict[str, str]:
    """The course files' hashes (their compiled `__pycache__` files by metadata); with `python`, also
    every file of this environment and interpreter by metadata. The metadata includes the inode's
    change time, which no program can set back, so a file rewritten to its old size and time is seen."""
    digests = {}
    for name in WATCHED:
        top = root / name
        for path in sorted([top] if top.is_file() else top.rglob("*")):
            if path.is_symlink():
                digests[str(path.relative_to(root))] = f"symlink to {path.readlink()}"
            elif path.is_file():
                digests[str(path.relative_to(root))] = _metadata(path) if "__pycache__" in path.parts else \
                    hashlib.sha256(path.read_bytes()).hexdigest()
    if python:
        for tree in sorted({Path(sys.prefix).resolve(), Path(sys.base_prefix).resolve()}):
            for folder, _, files in os.walk(tree):
                for file in files:
                    path = os.path.join(folder, file)
                    digests[path] = _metadata(path)
    return digests


def _metadata(path) -> str:
    stat = os.lstat(path)
    return f"{stat.st_size}:{stat.st_mtime_ns}:{stat.st_ctime_ns}:{stat.st_ino}:{stat.st_mode:o}"


def digest(fingerprint: dict[str, str]) -> str:
    """One hash for a whole fingerprint: two machines grade alike only if their digests agree."""
    return hashlib.sha256(json.dumps(sorted(fingerprint.items())).encode()).hexdigest()


def verify(before: dict[str, str], root: Path = COURSE_ROOT) -> None:
    after = fingerprint(root, python=any(key.startswith("/") for key in before))
    changed = sorted(k for k in before.keys() | after.keys() if before.get(k) != after.get(k))
    if changed:
        raise CourseTampered("the course or the Python that grades changed during grading, so no grade of this "
                             "run can be trusted: " + ", ".join(changed[:10]))


def check_site_packages() -> None:
    """Every `.pth` and `sitecustomize` file in this environment's site folders is one an installed
    distribution's RECORD lists, with that content."""
    recorded = {}
    for dist in importlib.metadata.distributions():
        for entry in dist.files or []:
            if entry.hash is not None and (entry.name.endswith(".pth") or entry.name in STARTUP_FILES):
                recorded[Path(dist.locate_file(entry)).resolve()] = entry.hash.value
    folders = [Path(p) for p in site.getsitepackages()]
    if site.ENABLE_USER_SITE:
        folders.append(Path(site.getusersitepackages()))
    for folder in folders:
        if not folder.is_dir():
            continue
        for path in sorted(folder.iterdir()):
            if path.suffix == ".pth" or path.name in STARTUP_FILES:
                digest = base64.urlsafe_b64encode(hashlib.sha256(path.read_bytes()).digest()).rstrip(b"=").decode()
                if recorded.get(path.resolve()) != digest:
                    raise CourseTampered(f"{path} is not a file an installed package put there (it runs in "
                                         "every Python started from this environment): remove it, or "
                                         "reinstall the package it belongs to, before grading")


def course_commit(root: Path = COURSE_ROOT) -> str:
    """The checkout's commit, read from git's files: never by running git, which would run whatever
    commands the repository's configuration names (a notebook graded --no-sandbox could add some)."""
    git = root / ".git"
    try:
        if git.is_file():  # a worktree: "gitdir: <path>"
            git = (root / git.read_text().split(":", 1)[1].strip()).resolve()
        head = (git / "HEAD").read_text().strip()
        if not head.startswith("ref: "):
            return head
        ref = head.removeprefix("ref: ")
        if (git / ref).is_file():
            return (git / ref).read_text().strip()
        common = git / (git / "commondir").read_text().strip() if (git / "commondir").is_file() else git
        for line in (common / "packed-refs").read_text().splitlines():
            if line.endswith(f" {ref}"):
                return line.split()[0]
    except (OSError, IndexError):
        pass
    return "unknown"
