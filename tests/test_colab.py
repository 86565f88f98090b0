"""Every lab's first cell on a simulated Colab runtime: a stub `google.colab` module, a fresh Python
environment whose torch (and the rest) is preinstalled, and a local git repository as COURSE_REPO.
It clones, installs (offline, against what is installed), says what it does, stamps the end of a
finished install, puts labkit and the course's package on sys.path; run again, it is silent and only sets the path; a
half-finished install is redone; a bad address says how to set COURSE_REPO; off Colab it prints nothing."""

import subprocess

import pytest
from fresh_env import copy_checkout, fresh_venv, offline_env

from labkit_course.course import colab_setup_cell

CHECK = ("\nimport labkit, labkit_course, labkit_course.data as d\nprint('labkit from', labkit.__file__)\n"
         "print('course from', labkit_course.__file__)\nprint('data', d.data_path(d.JARGON_FILE).is_file())\n")
COURSE_FROM = "course from {}/course/labkit_course/__init__.py"


@pytest.fixture(scope="module")
def colab(tmp_path_factory):
    """(bin/ of the runtime's Python, a folder holding the google.colab stub, the course repository)."""
    tmp = tmp_path_factory.mktemp("colab")
    origin = copy_checkout(tmp / "origin")
    git = ["git", "-C", str(origin), "-c", "user.name=test", "-c", "user.email=test@example.com"]
    subprocess.run(["git", "init", "-q", str(origin)], check=True)
    subprocess.run([*git, "add", "-A"], check=True)
    subprocess.run([*git, "commit", "-q", "-m", "course"], check=True)
    stub = tmp / "stub" / "google" / "colab"
    stub.mkdir(parents=True)
    (stub / "__init__.py").write_text('"""Stands in for Colab\'s runtime module."""\n')
    return fresh_venv(tmp / "runtime"), stub.parent.parent, origin


def run_cell(colab, course_dir, repo, on_colab=True, after=CHECK):
    bin_dir, stub, _ = colab
    prelude = "import google.colab\n" if on_colab else ""
    env = offline_env(bin_dir, PYTHONPATH=str(stub), COURSE_DIR=str(course_dir), COURSE_REPO=str(repo))
    return subprocess.run([bin_dir / "python", "-c", prelude + colab_setup_cell() + after], cwd=course_dir.parent,
                          env=env, capture_output=True, text=True, timeout=600)


def test_first_run_clones_installs_and_stamps_then_a_second_run_only_sets_the_path(colab, tmp_path):
    _, _, origin = colab
    course = tmp_path / "course"
    first = run_cell(colab, course, origin)
    assert first.returncode == 0, first.stderr[-3000:]
    lines = first.stdout.splitlines()
    assert lines[0] == f"cloning {origin} into {course}…"
    assert lines[1].startswith("installing labkit, the course's package and their libraries")
    assert lines[2].startswith("done in ") and lines[2].endswith(" s")
    assert lines[3:] == [f"labkit from {course}/labkit/__init__.py", COURSE_FROM.format(course), "data True"]
    assert (course / ".colab" / ".installed").is_file()
    assert (course / ".git").is_dir()

    again = run_cell(colab, course, origin)
    assert again.returncode == 0, again.stderr[-3000:]
    assert again.stdout.splitlines() == [f"labkit from {course}/labkit/__init__.py", COURSE_FROM.format(course),
                                         "data True"]

    (course / ".colab" / ".installed").unlink()  # as if the install had been interrupted
    redo = run_cell(colab, course, origin)
    assert redo.returncode == 0, redo.stderr[-3000:]
    assert redo.stdout.splitlines()[0].startswith("installing labkit"), "no second clone, but a fresh install"
    assert (course / ".colab" / ".installed").is_file()


def test_a_repository_that_cannot_be_cloned_says_how_to_set_course_repo(colab, tmp_path):
    result = run_cell(colab, tmp_path / "course", tmp_path / "no-such-repository", after="")
    assert result.returncode != 0
    assert f"could not clone {tmp_path / 'no-such-repository'}" in result.stderr
    assert "%env COURSE_REPO=https://github.com/<owner>/<repository>" in result.stderr
    assert not (tmp_path / "course" / ".colab" / ".installed").exists()


def test_off_colab_the_cell_prints_nothing_and_does_nothing(colab, tmp_path):
    result = run_cell(colab, tmp_path / "course", tmp_path / "unused", on_colab=False, after="")
    assert result.returncode == 0 and result.stdout == "" and result.stderr == ""
    assert not (tmp_path / "course").exists()
