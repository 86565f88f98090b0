"""A hostile class against `python -m labkit_course.grading grade` (issues 11 and 29): every attack must fail.

Each class is graded through the real command in a temporary copy of the course (labkit imported from
the copy, which is a git checkout with solutions, so an attack that escapes can only damage the copy),
in every containment mode this machine offers: bubblewrap (as root, a uid of its own per kernel), no
sandbox when asked for by name, and a refusal when bubblewrap is missing or broken. Students are
lab-00 notebooks (quick to run); their attack cells avoid what the course rules refuse outright
(`labkit_course.grading.rules`), so that the sandbox and the trusted side are what stop them. The pieces
(codec, channel, rules, fingerprint) are tested one by one in test_grading_channel.py.
"""

import hashlib
import json
import multiprocessing
import multiprocessing.forkserver
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import nbformat
import pytest
import torch
from grading_support import write_notebook

from labkit_course.grading import sandbox
from labkit_course.grading.core import exercises, get_exercise, run_exercise
from labkit_course.grading.integrity import COURSE_ROOT

GOOD = "def softmax(x):\n    e = (x - x.max(-1, keepdim=True).values).exp()\n    return e / e.sum(-1, keepdim=True)"
WRONG = "def softmax(x):\n    return x"
MARKER = "labkit-attack-marker-7f3a"
GRADING = Path("course", "labkit_course", "grading")  # in a course checkout
SECRET = "instructor-secret-9c1e"
BWRAP = sandbox.bwrap_problem() is None
NO_BWRAP = f"bubblewrap does not work here: {sandbox.bwrap_problem()}"


def _course_copy(root: Path) -> Path:
    """labkit, the course's package, the solutions and the handed-out notebooks in a git checkout, with an
    instructor's secret.

    Its lab 00 also hands out `RUN`, a cell that defines a helper starting processes: in a student's
    own cell the course rules would refuse it before it runs, but the course's cells are not checked
    and the rules are best effort, so the sandbox must contain what it starts all the same; attack
    notebooks include it verbatim and call `run` from their own cells to show that it does."""
    course = root / "course"
    for package in ("labkit", "course/labkit_course", "datasets"):
        shutil.copytree(COURSE_ROOT / package, course / package, ignore=shutil.ignore_patterns("__pycache__"))
    for folder in ("solutions", "notebooks"):
        shutil.copytree(COURSE_ROOT / folder, course / folder)
    lab00 = course / "notebooks" / "00_setup.ipynb"
    handed_out = nbformat.read(lab00, 4)
    handed_out.cells.append(nbformat.v4.new_code_cell(RUN))
    nbformat.write(handed_out, lab00)
    for name in ("pyproject.toml", "Makefile", "requirements.txt"):
        shutil.copy(COURSE_ROOT / name, course / name)
    (course / "victim.txt").write_text("a file outside every student's folder\n")
    git = ["git", "-c", "user.name=t", "-c", "user.email=t@t", "-C", str(course)]
    for command in (["init", "-q"], ["add", "-A"], ["commit", "-qm", "course"]):
        subprocess.run(git + command, check=True, capture_output=True)
    secret = course / "instructor-notes.txt"
    secret.write_text(SECRET)
    secret.chmod(0o600)
    return course


def _grade(course: Path, klass: Path, *options: str, env: dict | None = None, timeout: int = 600):
    """The real command on `klass`; also what it left in its temporary folder (nothing, it must be)."""
    report = course / "reports" / "grades.json"
    report.unlink(missing_ok=True)
    scratch = Path(tempfile.mkdtemp(prefix="rt-", dir="/tmp"))  # short: kernels' sockets go below it
    env = {**os.environ, "PYTHONPATH": f"{course}{os.pathsep}{course / 'course'}", "OMP_NUM_THREADS": "1",
           "TMPDIR": str(scratch), **(env or {})}
    try:
        done = subprocess.run([sys.executable, "-m", "labkit_course.grading", "grade", str(klass), "--report",
                               str(report), "--jobs", "2", "--cell-timeout", "20", "--call-timeout", "10", *options],
                              cwd=course, env=env, capture_output=True, text=True, timeout=timeout)
        left = sorted(p.name for p in scratch.iterdir())
    finally:
        shutil.rmtree(scratch)
    return done, json.loads(report.read_text()) if report.exists() else None, left


def _marked_processes() -> list[int]:
    found = []
    for entry in Path("/proc").iterdir():
        try:
            if entry.name.isdigit() and MARKER.encode() in (entry / "cmdline").read_bytes() \
                    and (entry / "stat").read_text().rsplit(")", 1)[1].split()[0] != "Z":
                found.append(int(entry.name))
        except OSError:
            continue
    return found


def _students(data: dict) -> dict:
    return {s["student"]: s for s in data["students"]}


def _lab(students: dict, student: str, lab: str = "00") -> dict:
    labs = [row for row in students[student]["labs"] if row["lab"] == lab and row["exercises"]]
    assert len(labs) == 1, labs
    return labs[0]


def _softmax(students: dict, student: str) -> dict:
    return _lab(students, student)["exercises"][0]


# Cells of attack notebooks. `seen` collects what an attack could do; the student's softmax raises it,
# so that it lands in the report's feedback, where the tests read it.
RECORD = ("import os, json\nseen = {}\n"
          "def attempt(name, action):\n    try:\n        seen[name] = repr(action())[:300]\n"
          "    except BaseException as error:\n        seen[name] = type(error).__name__\n")
SHOW = "def softmax(x):\n    raise ValueError('SEEN' + json.dumps(seen))"
RUN = ("import asyncio\n"
       "async def run(*argv, **kw):\n"
       "    process = await asyncio.create_subprocess_exec(*argv, stdout=-1, stderr=-2, **kw)\n"
       "    out, _ = await process.communicate()\n"
       "    return process.returncode, out.decode()[-100:]\n")


def _detached_rewriter(reports: Path) -> str:
    """A cell that starts a process which double-forks into a session of its own (out of the kernel's
    process tree and group) and then rewrites the report every 0.1 s for 30 s; `seen['spawn']` says
    whether the start worked (needs RECORD and RUN before it)."""
    report = reports / "grades.json"
    code = ("import os, pathlib, time\n"
            "if os.fork():\n    os._exit(0)\n"
            "os.setsid()\n"
            "if os.fork():\n    os._exit(0)\n"
            "quiet = os.open(os.devnull, os.O_RDWR)\n"
            "for fd in (0, 1, 2):\n    os.dup2(quiet, fd)\n"
            "for _ in range(300):\n    time.sleep(0.1)\n"
            f"    try:\n        pathlib.Path({str(report)!r}).write_text('{{}}')\n"
            "    except OSError:\n        pass\n")
    return f"import sys\nseen['spawn'] = await run(sys.executable, '-c', {code!r}, {MARKER!r})"


def _seen(students: dict, student: str) -> dict:
    feedback = _softmax(students, student)["feedback"]
    assert "SEEN" in feedback, feedback
    return json.JSONDecoder().raw_decode(feedback.split("SEEN", 1)[1])[0]  # feedback goes on: where it was raised


@pytest.fixture(scope="module")
def bwrap_class(tmp_path_factory):
    """A class graded as root (or as this user) with bubblewrap."""
    if not BWRAP:
        pytest.skip(NO_BWRAP)
    root = tmp_path_factory.mktemp("attacks")
    course = _course_copy(root)
    klass = root / "class"
    report_dir = course / "reports"
    write_notebook(klass / "victim", "00_setup.ipynb", "import torch", GOOD)
    victim_hash = hashlib.sha256((klass / "victim" / "00_setup.ipynb").read_bytes()).hexdigest()
    site_packages = Path(sys.prefix) / "lib"
    # escape: mounts, capabilities, the course, the classmate, the report, the venv
    write_notebook(klass / "escaper", "00_setup.ipynb", "import torch", RECORD, RUN,
                   "attempt('ids', lambda: [os.getuid(), os.geteuid(), os.getgroups()])\n"
                   "status = dict(l.split(':', 1) for l in open('/proc/self/status') if ':' in l)\n"
                   "seen['caps'] = [status[k].strip() for k in ('CapEff', 'CapBnd', 'NoNewPrivs')]\n"
                   "seen['umount'] = await run('umount', '/tmp')\n"
                   "seen['remount'] = await run('mount', '-o', 'remount,rw', '/')\n"
                   "seen['nested'] = await run('unshare', '-Urm', 'sh', '-c', 'umount -l /tmp && ls /tmp')\n"
                   f"attempt('classmate', lambda: open({str(klass / 'victim' / '00_setup.ipynb')!r}, 'a').write('x'))\n"
                   f"attempt('report', lambda: open({str(report_dir / 'grades.json')!r}, 'w').write('{{}}'))\n"
                   f"attempt('checkout', lambda: os.remove({str(course / 'victim.txt')!r}))\n"
                   f"attempt('grader', lambda: open({str(course / GRADING / 'core.py')!r}, 'a').write('#'))\n"
                   f"attempt('venv', lambda: open({str(site_packages / 'zz_attack.pth')!r}, 'w').write('import os'))\n"
                   "attempt('big_file', lambda: open('big', 'wb').write(b'x' * (600 * 2**20)))\n"
                   "import socket\nattempt('network', lambda: socket.create_connection(('1.1.1.1', 53), timeout=3))",
                   SHOW)
    # reading what is hidden: .git, solutions, graders, the instructor's file, classmates, the parent
    write_notebook(klass / "reader", "00_setup.ipynb", "import torch", RECORD, RUN,
                   f"course = {str(course)!r}\n"
                   "attempt('git', lambda: open(course + '/.git/HEAD').read())\n"
                   "seen['git_show'] = await run('git', '-C', course, 'show', 'HEAD:solutions/00_setup.ipynb')\n"
                   "attempt('solution', lambda: open(course + '/solutions/00_setup.ipynb').read()[:50])\n"
                   f"attempt('grader', lambda: open({str(course / GRADING / 'labs/lab00.py')!r}).read()[:50])\n"
                   "attempt('secret', lambda: open(course + '/instructor-notes.txt').read())\n"
                   f"attempt('classmate', lambda: open({str(klass / 'victim' / '00_setup.ipynb')!r}).read()[:50])\n"
                   f"attempt('class', lambda: os.listdir({str(klass)!r}))\n"
                   "attempt('root', lambda: os.listdir('/root'))\n"
                   f"cmdline = lambda p: open(f'/proc/{{p}}/cmdline', 'rb').read()\n"
                   f"attempt('cmdlines', lambda: any({str(klass)!r}.encode() in cmdline(p)\n"
                   "                             for p in os.listdir('/proc') if p.isdigit()))\n",
                   SHOW)
    # a module written into its own folder must not shadow the one it imports (python -P)
    write_notebook(klass / "shadower", "00_setup.ipynb", "import torch", RECORD,
                   "open('tabnanny.py', 'w').write('PLANTED = True')\nimport tabnanny\n"
                   "seen['planted'] = hasattr(tabnanny, 'PLANTED')", SHOW)
    # stalling and exhausting the trusted side
    write_notebook(klass / "half_frame", "00_setup.ipynb", "import torch", GOOD,
                   "import socket, time\nsend = socket.socket.sendall\n"
                   "def stall(self, data, *args):\n    if len(data) > 64:\n        send(self, data[:40])\n"
                   "        time.sleep(1000)\n    return send(self, data, *args)\nsocket.socket.sendall = stall")
    write_notebook(klass / "collider", "00_setup.ipynb", "import torch",
                   "def softmax(x):\n    return {1 + k * (2**61 - 1) for k in range(15_000)}")
    write_notebook(klass / "broadcaster", "00_setup.ipynb", "import torch",
                   "def softmax(x):\n    return torch.zeros(1).expand(2**31)")
    write_notebook(klass / "blank_lines", "00_setup.ipynb", "import torch", "\n" * 200_000 + GOOD)
    write_notebook(klass / "flooder", "00_setup.ipynb", "import torch", GOOD,
                   "from IPython.display import display\nhandle = display('x', display_id=True)\n"
                   "for _ in range(300):\n    handle.update('y' * 200_000)",
                   "print('z' * 20_000_000)", "import os\nos.write(1, b'w' * 10_000_000)")
    write_notebook(klass / "big_error", "00_setup.ipynb", "import torch", WRONG,
                   "import json\nreal = json.dumps\n"
                   "def bigger(obj, *args, **kwargs):\n"
                   "    if isinstance(obj, dict) and 'nonce' in obj and 'updates' in obj:\n"
                   "        error = {'type': 'ValueError', 'message': 'E' * 50_000_000}\n"
                   "        obj = {'nonce': obj['nonce'], 'error': error}\n"
                   "    return real(obj, *args, **kwargs)\njson.dumps = bigger")
    # forging the score or the table
    write_notebook(klass / "patcher", "00_setup.ipynb", "import torch", WRONG,
                   "import json\ntorch.allclose = lambda *a, **k: True\ntorch.equal = lambda *a, **k: True\n"
                   "print(json.dumps({'points': 99, 'max_points': 1}))")
    write_notebook(klass / "printer", "00_setup.ipynb", "import torch",
                   "def softmax(x):\n    raise ValueError('\\x1b[2J\\x1b[31mred\\x1b[0m\\rcarriage\\x07')",
                   "print('student  00  softmax  1/1  ✔ forged')\nprint('total 99/1')")
    forged = "00_setup\nvictim   00   softmax  1∕1  ✔ forged\ntotal 93∕93\x1b[2K.ipynb"
    write_notebook(klass / "namer", forged, "import torch", GOOD)
    write_notebook(klass / "namer", "00_setup.ipynb", "import torch", WRONG)
    write_notebook(klass / "namer", "Copy of 00_setup.ipynb", "import torch", WRONG)
    (klass / "namer" / "01_text_to_tensors.ipynb").write_text("{ this is not a notebook")
    write_notebook(klass / "namer", "my_notes.ipynb", "1 + 1")
    (klass / "linker").mkdir()
    (klass / "linker" / "00_setup.ipynb").symlink_to(course / "solutions" / "00_setup.ipynb")
    # tripwires
    write_notebook(klass / "specialist", "00_setup.ipynb", "import torch",
                   "def softmax(x):\n    return torch.special.softmax(x, -1)")
    write_notebook(klass / "aliaser", "00_setup.ipynb", "import torch\nfrom torch.nn.functional import softmax as sm",
                   "def softmax(x):\n    return sm(x, -1)")
    for name, cell in BYPASSES.items():
        write_notebook(klass / name, "00_setup.ipynb", "import torch", cell, WRONG)
    write_notebook(klass / "precomputer", "00_setup.ipynb", "import torch", PRECOMPUTED)
    # processes and time
    write_notebook(klass / "spawner", "00_setup.ipynb", "import torch", RECORD, RUN, _detached_rewriter(report_dir),
                   SHOW)
    write_notebook(klass / "sleeper", "00_setup.ipynb", "import torch", GOOD, "import time\ntime.sleep(1000)",
                   "def never_defined():\n    pass")
    write_notebook(klass / "crasher", "00_setup.ipynb", "import torch", GOOD, "import os\nos._exit(3)")
    started = time.monotonic()
    done, data, left = _grade(course, klass)
    elapsed = time.monotonic() - started
    survivors = _marked_processes()
    time.sleep(1.0)  # a surviving rewriter would rewrite the report within 0.1 s
    return {"course": course, "klass": klass, "done": done, "data": data, "students": _students(data) if data else {},
            "survivors": survivors, "elapsed": elapsed, "report": report_dir / "grades.json",
            "victim_hash": victim_hash, "site_packages": site_packages, "left": left}


# Answers computed at notebook time (nothing is armed then), for the inputs Lab 00's grader draws from its
# published seed, and looked up when graded: what a red team did to Lab 06 and Lab 11.
PRECOMPUTED = ("from torch.nn.functional import softmax as sm\n"
               "g = torch.Generator().manual_seed(0)\n"
               "logits = torch.randn(3, 7, generator=g, dtype=torch.float64)\n"
               "square = torch.randn(4, 4, generator=g, dtype=torch.float64)\n"
               "spread = logits * 1000 + torch.tensor([[0.0], [3000.0], [-3000.0]], dtype=torch.float64)\n"
               "key = lambda x: (x.dtype, tuple(x.shape), x.numpy().tobytes())\n"
               "ANSWERS = {key(x): sm(x, -1) for x in (logits, square, spread, logits.float(), logits[1])}\n"
               "def softmax(x):\n    return ANSWERS[key(x)].clone()")


# A red team's way around secret inputs: learn seeds while one exercise is graded (Lab 06's sample_next is
# handed seeded generators) and run labkit, not forbidden then, on what another exercise draws from the same
# seed number (apply_penalties draws its logits from seed 6, with literal token ids and settings).
CROSS_EXERCISE = """
import torch
from labkit.sampling import apply_penalties as reference
TABLE, SEEN = {}, set()
def pad(rows):
    width = max(map(len, rows))
    return torch.tensor([r + [-1] * (width - len(r)) for r in rows])
ARGS = (pad([[1, 2, 2, 3], [4, 5], [1, 1, 7], [0, 9]]), pad([[3, 3, 6, 2], [5, 8, 8, 8], [], [9, 9, 4]]),
        torch.tensor([1.3, 2.0, 1.0, 1.5]), torch.tensor([0.5, 0.0, 0.0, 0.7]), torch.tensor([0.2, 0.0, 0.4, 0.3]))
def sample_next(logits, temperature, generator):
    if len(SEEN) < 30 and generator.initial_seed() not in SEEN:
        SEEN.add(generator.initial_seed())
        drawn = torch.randn(4, 10, generator=torch.Generator().manual_seed(generator.initial_seed())) * 2
        TABLE[drawn.numpy().tobytes()] = reference(drawn, *ARGS)
    if temperature == 0:
        return int(logits.argmax())
    return int(torch.multinomial((logits / temperature).softmax(-1), 1, generator=generator))
def apply_penalties(logits, *args):
    return TABLE.get(logits.numpy().tobytes(), logits).clone()
"""


def test_a_seed_handed_over_while_one_exercise_is_graded_tells_nothing_of_another(secret_inputs):
    namespace = {}
    exec(CROSS_EXERCISE, namespace)
    assert run_exercise(get_exercise("06", "sample_next"), namespace).passed
    assert not run_exercise(get_exercise("06", "apply_penalties"), namespace).passed


# The five ways around the tripwires a red team found (issue 29), each in a cell of its own.
BYPASSES = {
    "getsource": "import inspect\nfrom labkit import sampling\nexec(inspect.getsource(sampling.filters))",
    "code_copy": "import torch.nn.functional as F\ncopy = type(lambda: 0)(F.softmax.__code__, F.softmax.__globals__)",
    "reloader": "import importlib, torch\nimportlib.reload(torch.nn.functional)",
    "restorer": "def restore():\n    import gc\n    return [o for o in gc.get_objects() if hasattr(o, '_saved')]",
    "key_reader": "from labkit_course.grading.labs import lab00\nanswers = dict(lab00.QUESTIONS)",
}


def test_the_class_is_graded_and_the_run_says_not_all_passed(bwrap_class):
    done, data = bwrap_class["done"], bwrap_class["data"]
    assert data is not None, done.stderr[-3000:]
    assert done.returncode == 0 and "exercises passed, not all passed" in done.stdout, done.stderr[-3000:]
    assert data["sandbox"] == "bwrap"
    namer = bwrap_class["students"]["namer"]
    all_labs = {row["lab"] for row in namer["labs"] if row["exercises"]}
    assert all_labs == {ex.lab for ex in exercises()}, "every lab the course grades has a row"
    assert namer["missing_labs"] == sorted({ex.lab for ex in exercises()} - {"00", "01"})


def test_a_classmate_keeps_full_marks_and_an_untouchedwrite_notebook(bwrap_class):
    students = bwrap_class["students"]
    assert _softmax(students, "victim")["points"] == 1
    victim = bwrap_class["klass"] / "victim" / "00_setup.ipynb"
    assert hashlib.sha256(victim.read_bytes()).hexdigest() == bwrap_class["victim_hash"]


def test_a_kernel_cannot_escape_bubblewrap_even_as_root(bwrap_class):
    seen = _seen(bwrap_class["students"], "escaper")
    uid, euid, groups = json.loads(seen["ids"])
    if sandbox.is_root():
        assert uid == euid >= sandbox.FIRST_UID and groups == [], "a uid of its own, in no group"
    assert seen["caps"] == ["0000000000000000", "0000000000000000", "1"]
    for attempt in ("umount", "remount", "nested"):
        assert seen[attempt][0] != 0, (attempt, seen[attempt])
    for attempt in ("classmate", "report", "checkout", "grader", "venv"):
        assert seen[attempt] in ("FileNotFoundError", "PermissionError", "OSError"), (attempt, seen[attempt])
    assert seen["big_file"] == "OSError", "its HOME is a tmpfs of limited size"
    assert seen["network"] in ("OSError", "TimeoutError")
    course = bwrap_class["course"]
    assert (course / "victim.txt").exists() and not (course / GRADING / "core.py").read_text().endswith("#")
    assert not (bwrap_class["site_packages"] / "zz_attack.pth").exists()


def test_nothing_hidden_can_be_read(bwrap_class):
    seen = _seen(bwrap_class["students"], "reader")
    for attempt in ("git", "solution", "grader", "secret", "classmate", "class"):
        assert seen[attempt] in ("FileNotFoundError", "PermissionError"), (attempt, seen[attempt])
    python = Path(sys.base_prefix).resolve()  # /root holds nothing but the way to the interpreter, if that
    assert seen["root"] == (repr([python.parts[2]]) if python.is_relative_to("/root") else "FileNotFoundError")
    assert seen["git_show"][0] != 0
    assert seen["cmdlines"] == "False", "the grader's command line (naming the class) is out of sight"
    report = bwrap_class["report"].read_text()
    assert SECRET not in report and "nbformat" not in json.dumps(seen)


def test_a_module_written_next_to_the_notebook_shadows_nothing(bwrap_class):
    assert _seen(bwrap_class["students"], "shadower")["planted"] is False


def test_answers_computed_ahead_for_the_published_inputs_earn_nothing_when_graded(bwrap_class):
    namespace = {"torch": torch}
    exec(PRECOMPUTED, namespace)  # in a notebook's own check the grader draws from the published seed
    assert run_exercise(get_exercise("00", "softmax"), namespace).passed, "the table should fool the check cell"
    assert _softmax(bwrap_class["students"], "precomputer")["points"] == 0, "graded, the inputs are secret"


def test_half_a_reply_then_silence_costs_that_student_only(bwrap_class):
    half = _lab(bwrap_class["students"], "half_frame")
    assert half["points"] == 0 and "cut off" in half["exercises"][0]["feedback"]
    assert half["seconds"] < 60, "the call's limit (10 s) and a grace, not forever"


@pytest.mark.parametrize(("student", "reason"), [
    ("collider", "share one hash"), ("broadcaster", "zero strides")])
def test_a_reply_built_to_blow_up_the_grader_is_refused(bwrap_class, student, reason):
    softmax = _softmax(bwrap_class["students"], student)
    assert softmax["points"] == 0 and reason in softmax["feedback"]
    assert _lab(bwrap_class["students"], student)["seconds"] < 60


def test_a_cell_of_blank_lines_is_graded_at_once(bwrap_class):
    lab = _lab(bwrap_class["students"], "blank_lines")
    assert lab["points"] == 1 and lab["seconds"] < 60


def test_floods_of_output_and_display_updates_cost_nothing(bwrap_class):
    flooder = _lab(bwrap_class["students"], "flooder")
    assert flooder["points"] == 1, flooder
    assert bwrap_class["report"].stat().st_size < 2**20


def test_a_50_mb_error_is_cut_where_it_enters(bwrap_class):
    feedback = _softmax(bwrap_class["students"], "big_error")["feedback"]
    assert feedback.startswith("your code raised ValueError: EEE") and len(feedback) <= 1000
    assert "E" * 5000 not in bwrap_class["done"].stdout + bwrap_class["done"].stderr


def test_patching_torch_and_printing_scores_earn_nothing(bwrap_class):
    softmax = _softmax(bwrap_class["students"], "patcher")
    assert softmax["points"] == 0
    assert softmax["feedback"] == "the values are not exp(x) / sum(exp(x)) along the last dimension"
    assert "forged" not in json.dumps(bwrap_class["students"]["printer"])


def test_forged_totals_cannot_exceed_the_maximum(bwrap_class):
    data = bwrap_class["data"]
    for student in data["students"]:
        for lab in student["labs"]:
            assert all(0 <= e["points"] <= e["max_points"] for e in lab["exercises"])
            assert lab["points"] == sum(e["points"] for e in lab["exercises"]) <= lab["max_points"]
        assert student["points"] == sum(lab["points"] for lab in student["labs"])
    assert data["points"] == sum(s["points"] for s in data["students"]) <= data["max_points"]


def test_feedback_is_plain_text(bwrap_class):
    feedback = _softmax(bwrap_class["students"], "printer")["feedback"]
    assert feedback.startswith("your code raised ValueError: red")
    assert not any(ord(c) < 32 or c == "\x7f" for c in json.dumps(bwrap_class["data"], ensure_ascii=False)
                   .replace("\n", ""))


def test_a_file_name_cannot_forge_rows_in_the_table(bwrap_class):
    lines = bwrap_class["done"].stdout.splitlines()
    assert not any(line.startswith(("total", "victim   00")) or "\x1b" in line for line in lines)
    assert any("00_setup\\nvictim   00   softmax  1∕1  ✔ forged\\ntotal 93∕93\\x1b[2K.ipynb" in line for line in lines)
    victim_total = [line for line in lines if line.startswith("victim: total")]
    assert victim_total == [f"victim: total 1/{sum(ex.points for ex in exercises())} (missing labs: "
                            + ", ".join(sorted({ex.lab for ex in exercises()} - {"00"})) + ")"]


def test_malformed_files_duplicates_and_links_are_rows_with_reasons(bwrap_class):
    students = bwrap_class["students"]
    broken = _lab(students, "namer", "01")
    assert broken["notebook"] == "01_text_to_tensors.ipynb" and "not a readable notebook" in broken["note"]
    namer = students["namer"]
    stray = [row for row in namer["labs"] if row["notebook"] == "my_notes.ipynb"]
    assert stray and "not named like a lab notebook" in stray[0]["note"]
    notes = [row["note"] for row in namer["labs"] if row["lab"] == "00" and not row["exercises"]]
    assert len(notes) == 1 and notes[0].startswith("duplicate: also handed in ")
    assert _lab(students, "namer")["notebook"] == "00_setup.ipynb", "the exact name is the one graded"
    linked = _lab(students, "linker")
    assert linked["points"] == 0 and "symbolic link" in linked["note"]


def test_forbidden_functions_and_their_aliases_are_caught(bwrap_class):
    students = bwrap_class["students"]
    assert "`torch.special.softmax` is what this exercise asks you to write" in \
        _softmax(students, "specialist")["feedback"]
    assert "`torch.nn.functional.softmax`" in _softmax(students, "aliaser")["feedback"]
    assert _softmax(students, "specialist")["points"] == _softmax(students, "aliaser")["points"] == 0


@pytest.mark.parametrize("student", sorted(BYPASSES))
def test_each_way_around_the_tripwires_fails_the_lab_by_the_rules(bwrap_class, student):
    lab = _lab(bwrap_class["students"], student)
    assert lab["points"] == 0 and "The course's rules forbid this" in lab["note"], lab
    assert all(e["feedback"] == lab["note"] for e in lab["exercises"])
    assert lab["seconds"] < 10, "decided from the notebook as handed in, without running it"


def test_a_timeout_keeps_the_points_earned_before_it_and_names_the_cell(bwrap_class):
    sleeper = _lab(bwrap_class["students"], "sleeper")
    assert sleeper["points"] == 1
    assert sleeper["note"].startswith("cell 3 ran out of time (the cell limit of 20 s)")


def test_a_dead_kernel_keeps_the_points_earned_before_it_and_names_the_cell(bwrap_class):
    crasher = _lab(bwrap_class["students"], "crasher")
    assert crasher["points"] == 1, crasher
    assert crasher["note"].startswith("cell 3 stopped the kernel")


def test_no_workdir_or_socket_is_left_behind(bwrap_class):
    assert bwrap_class["left"] == []


def test_spawned_and_detached_processes_die_and_the_report_stays(bwrap_class):
    assert _seen(bwrap_class["students"], "spawner")["spawn"][0] == 0, "the detached rewriter did start"
    assert bwrap_class["survivors"] == []
    assert json.loads(bwrap_class["report"].read_text()) == bwrap_class["data"]


# --- without bubblewrap: refused, unless asked for by name ---------------------------------------------

@pytest.fixture(scope="module")
def course(tmp_path_factory):
    return _course_copy(tmp_path_factory.mktemp("course"))


def test_without_bubblewrap_grading_refuses_and_says_what_to_do(course, tmp_path):
    write_notebook(tmp_path / "class" / "alice", "00_setup.ipynb", "import torch", GOOD)
    (tmp_path / "bin").mkdir()
    missing, no_report, _ = _grade(course, tmp_path / "class", env={"PATH": str(tmp_path / "bin")})
    assert missing.returncode == 2 and no_report is None
    assert "bubblewrap (bwrap) is not installed" in missing.stderr and "--no-sandbox" in missing.stderr
    fake = tmp_path / "bin" / "bwrap"
    fake.write_text("#!/bin/sh\necho 'bwrap: setting up uid map: Permission denied' >&2\nexit 1\n")
    fake.chmod(0o755)
    broken, no_report, _ = _grade(course, tmp_path / "class", env={"PATH": f"{tmp_path / 'bin'}:/usr/bin:/bin"})
    assert broken.returncode == 2 and no_report is None
    assert "bwrap fails here (bwrap: setting up uid map: Permission denied)" in broken.stderr


def test_with_no_sandbox_a_detached_process_is_killed_before_the_report(course, tmp_path):
    report = course / "reports" / "grades.json"
    klass = tmp_path / "class"
    write_notebook(klass / "alice", "00_setup.ipynb", "import torch", GOOD)
    write_notebook(klass / "mallory", "00_setup.ipynb", "import torch", RECORD, RUN, _detached_rewriter(report.parent),
                   SHOW)
    done, data, left = _grade(course, klass, "--no-sandbox")
    assert data is not None, done.stderr[-3000:]
    assert left == []
    assert data["sandbox"] == "none"
    assert _softmax(_students(data), "alice")["points"] == 1
    assert _seen(_students(data), "mallory")["spawn"][0] == 0, "the detached rewriter did start"
    assert _marked_processes() == []
    time.sleep(1.0)
    assert json.loads(report.read_text()) == data


def test_with_no_sandbox_a_changed_course_stops_the_run(course, tmp_path):
    always_pass = '\n\n@exercise("00", "softmax")\ndef softmax(ns):\n    return "forged"\n'
    grader = course / GRADING / "labs" / "lab00.py"
    before = grader.read_text()
    write_notebook(tmp_path / "class" / "tamperer", "00_setup.ipynb", "import torch", WRONG,
                   f"with open({str(grader)!r}, 'a') as f:\n    f.write({always_pass!r})")
    write_notebook(tmp_path / "class" / "later", "00_setup.ipynb", "import torch", WRONG)
    try:
        done, data, _ = _grade(course, tmp_path / "class", "--no-sandbox")
    finally:
        grader.write_text(before)
    assert done.returncode == 2 and data is None
    assert "changed during grading" in done.stderr


# --- the hard limit: a notebook whose grading will not end is stopped, the run goes on ------------------

def test_a_notebook_past_its_hard_limit_is_stopped_and_the_run_goes_on(tmp_path, monkeypatch):
    from labkit_course.grading.report import Options, grade_folder

    klass = tmp_path / "class"
    write_notebook(klass / "stuck", "00_setup.ipynb", "import torch",
                   "def softmax(x):\n    import time\n    while True:\n        try:\n            time.sleep(100)\n"
                   "        except BaseException:\n            pass")
    write_notebook(klass / "fine", "00_setup.ipynb", "import torch", GOOD)
    # A call that ignores its interrupt would hold the grader 5 + 300 s; the hard limit is 2 x 5 + 10 s.
    limits = sandbox.Limits(cell_s=5, notebook_s=5, call_s=5, interrupt_s=300, startup_s=10)
    multiprocessing.get_context("forkserver")
    multiprocessing.forkserver.ensure_running()  # its own socket folder stays in the usual temporary folder
    scratch = Path(tempfile.mkdtemp(prefix="rt-", dir="/tmp"))  # short: the kernels' sockets go below it
    monkeypatch.setattr(tempfile, "tempdir", str(scratch))
    started = time.monotonic()
    reports = grade_folder(klass, Options(jobs=2, limits=limits, no_sandbox=not BWRAP))
    left = [p.name for p in scratch.iterdir()]
    shutil.rmtree(scratch)
    assert left == [], "the killed worker's workdir is removed with the run"
    assert time.monotonic() - started < 60
    lab00 = {r.student: r for r in reports if r.lab == "00" and r.outcomes}
    assert lab00["fine"].points == 1
    assert lab00["stuck"].points == 0
    assert "took longer than its hard limit of 20 s" in lab00["stuck"].note
