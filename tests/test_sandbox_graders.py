"""The graders stay out of a kernel's reach: the empty folder that hides them is no disk to fill
(a kernel that owns it, in user mode, could otherwise write half the machine's memory into it), and
grading refuses a course package installed where every kernel can read it."""

import json
import subprocess
import sys

import pytest

from labkit_course.grading import sandbox
from labkit_course.grading.integrity import COURSE_ROOT

PROBE = """
import json, os, sys
graders = sys.argv[1]
seen = {"listing": os.listdir(graders), "mode": oct(os.stat(graders).st_mode & 0o7777)}
try:
    with open(os.path.join(graders, "filler"), "wb") as out:
        out.write(bytes(1 << 20))
    seen["write"] = "written"
except OSError as error:
    seen["write"] = type(error).__name__
try:
    os.chmod(graders, 0o777)
    seen["chmod"] = "changed"
except OSError as error:
    seen["chmod"] = type(error).__name__
print(json.dumps(seen))
"""


@pytest.mark.skipif(sandbox.bwrap_problem() is not None, reason="bubblewrap does not work on this machine")
def test_the_folder_hiding_the_graders_cannot_be_written_even_by_its_owner():
    workdir = sandbox.Workdir.create(None)  # no uid of its own: the kernel owns the mounts it is given
    graders = str(COURSE_ROOT / sandbox.GRADERS)
    try:
        command = sandbox.wrap_command([sys.executable, "-c", PROBE, graders], workdir, sandbox.Limits(), None, "bwrap")
        done = subprocess.run(command, capture_output=True, text=True, timeout=120, env=sandbox.kernel_env(workdir),
                              cwd=workdir.root)
    finally:
        workdir.remove()
    assert done.returncode == 0, done.stderr[-2000:]
    seen = json.loads(done.stdout)
    assert seen["listing"] == [] and seen["mode"] == "0o555"
    assert seen["write"] in ("OSError", "PermissionError") and seen["chmod"] in ("OSError", "PermissionError")


def test_grading_refuses_a_course_package_installed_outside_the_checkout(monkeypatch, tmp_path):
    """`pip install ./course` puts the graders in site-packages, which the sandbox lets kernels read."""
    assert sandbox.install_problem() is None, "this checkout's editable install is the one graded from"
    monkeypatch.setattr(sandbox, "COURSE_ROOT", tmp_path)  # as if labkit_course came from somewhere else
    (tmp_path / "course").mkdir()
    (tmp_path / "course" / "pyproject.toml").touch()
    with pytest.raises(sandbox.SandboxUnavailable, match=r"not from the checkout at .*course: .*pip install -e \. -e"):
        sandbox.mode()
    assert sandbox.mode(no_sandbox=True) == "none"
    (tmp_path / "course" / "pyproject.toml").unlink()  # labkit installed from a wheel too: no checkout to name
    with pytest.raises(sandbox.SandboxUnavailable, match=r"not from a checkout: .*pip install -e \. -e course"):
        sandbox.mode()
