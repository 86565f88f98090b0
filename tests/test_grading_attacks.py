"""Students' notebooks try to forge their scores (issue 11): every attack must fail.

The class attacks run through the real command, `python -m labkit.grading grade`, in a temporary
copy of the course (labkit imported from the copy, so an attack that escapes can only damage the
copy), one small lab-00 notebook per student. Tripwires, the channel and the codec are also
checked in-process and against one real kernel.
"""

import json
import os
import shutil
import socket
import subprocess
import sys
import time
from collections import OrderedDict, deque
from pathlib import Path

import nbformat
import pytest
import torch

from labkit.cache.block_manager import Block
from labkit.grading import ExerciseFailed, exercise, require, sandbox
from labkit.grading.codec import CodecError, Decoder, Encoder, dumps, identity, loads
from labkit.grading.core import _REGISTRY, exercises, get_exercise, run_exercise
from labkit.grading.forbidden import static_violations
from labkit.grading.integrity import COURSE_ROOT
from labkit.sampling import filter_logits

GOOD = "def softmax(x):\n    e = (x - x.max(-1, keepdim=True).values).exp()\n    return e / e.sum(-1, keepdim=True)"
WRONG = "def softmax(x):\n    return x"
MARKER = "labkit-attack-marker-7f3a"
CONTAINED = sandbox.mode() != "plain"
NOT_CONTAINED = "no OS sandbox and not root here: the README says this is not contained"


def _notebook(folder: Path, name: str, *cells: str) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    nb = nbformat.v4.new_notebook()
    nb.cells = [nbformat.v4.new_code_cell(c) for c in cells]
    nbformat.write(nb, folder / name)
    return folder / name


def _course_copy(root: Path) -> Path:
    course = root / "course"
    shutil.copytree(COURSE_ROOT / "labkit", course / "labkit", ignore=shutil.ignore_patterns("__pycache__"))
    shutil.copytree(COURSE_ROOT / "solutions", course / "solutions")
    for name in ("pyproject.toml", "Makefile", "requirements.txt"):
        shutil.copy(COURSE_ROOT / name, course / name)
    (course / "victim.txt").write_text("a file outside every student's folder\n")
    return course


def _grade(course: Path, klass: Path) -> tuple[subprocess.CompletedProcess, dict | None]:
    report = course / "reports" / "grades.json"
    env = {**os.environ, "PYTHONPATH": str(course), "OMP_NUM_THREADS": "1"}
    done = subprocess.run([sys.executable, "-m", "labkit.grading", "grade", str(klass), "--report", str(report),
                           "--jobs", "2", "--cell-timeout", "20"],
                          cwd=course, env=env, capture_output=True, text=True, timeout=600)
    return done, json.loads(report.read_text()) if report.exists() else None


def _marked_processes() -> list[int]:
    found = []
    for entry in Path("/proc").iterdir():
        try:
            if entry.name.isdigit() and MARKER.encode() in (entry / "cmdline").read_bytes() \
                    and entry.stat().st_uid is not None and (entry / "stat").read_text().split()[2] != "Z":
                found.append(int(entry.name))
        except OSError:
            continue
    return found


@pytest.fixture(scope="module")
def attacked(tmp_path_factory):
    root = tmp_path_factory.mktemp("attacks")
    course = _course_copy(root)
    klass = root / "class"
    report = course / "reports" / "grades.json"
    _notebook(klass / "patcher", "00_setup.ipynb", "import torch", WRONG,
              "import labkit.grading.core as core\nimport labkit.grading.report as report\n"
              "def full_marks(ex, ns):\n    return core.Outcome(ex.lab, ex.name, ex.points, ex.points, 'forged')\n"
              "core.run_exercise = report.run_exercise = full_marks\n"
              "torch.allclose = lambda *a, **k: True\ntorch.equal = lambda *a, **k: True")
    _notebook(klass / "patcher", "00_setup (1).ipynb", "import torch", WRONG)
    forged = json.dumps([{"lab": "00", "name": "softmax", "points": 99, "max_points": 1, "message": "forged",
                          "missing": None}])
    _notebook(klass / "hooker", "00_setup.ipynb", "import torch",
              "def softmax(x):\n    raise ValueError('\\x1b[2J\\x1b[31mred\\x1b[0m\\rcarriage\\x07')",
              f"import json\nforged = {forged!r}\n"
              "def forge(*args):\n    print(forged)\n    print('total 99/1')\n"
              "    print(json.dumps({'points': 99, 'max_points': 1}))\n"
              "get_ipython().events.register('post_run_cell', forge)\n"
              "get_ipython().events.register('pre_run_cell', forge)")
    _notebook(klass / "printer", "Copy of 00_setup.ipynb", "import torch", 'print(".", end="")',
              "for _ in range(40):\n    print('x' * 100_000)",
              GOOD.replace("def softmax(x):\n", "def softmax(x):\n    print('.', end='')\n"))
    (klass / "printer" / "01_text_to_tensors.ipynb").write_text("{ this is not a notebook")
    _notebook(klass / "printer", "my_notes.ipynb", "1 + 1")
    _notebook(klass / "specialist", "00_setup.ipynb", "import torch",
              "def softmax(x):\n    return torch.special.softmax(x, -1)")
    _notebook(klass / "aliaser", "00_setup.ipynb", "import torch\nfrom torch.nn.functional import softmax as sm",
              "def softmax(x):\n    return sm(x, -1)")
    (klass / "linker").mkdir()
    (klass / "linker" / "00_setup.ipynb").symlink_to(course / "solutions" / "00_setup.ipynb")
    listener = socket.create_server(("127.0.0.1", 0))
    _notebook(klass / "spawner", "00_setup.ipynb", "import torch", GOOD,
              f"import socket\ntry:\n    socket.create_connection(('127.0.0.1', {listener.getsockname()[1]}), "
              "timeout=3).sendall(b'out')\nexcept OSError as error:\n    print('no network:', error)",
              "import os, subprocess, sys\n"
              f"try:\n    os.remove({str(course / 'victim.txt')!r})\nexcept OSError as error:\n"
              "    print('remove failed:', error)\n"
              "rewrite = ('import pathlib, time\\n'\n"
              "           'for _ in range(150):\\n'\n"
              "           '    time.sleep(0.1)\\n'\n"
              f"           '    try: pathlib.Path({str(report)!r}).write_text(\"{{}}\")\\n'\n"
              "           '    except OSError: pass\\n')\n"
              f"subprocess.Popen([sys.executable, '-c', rewrite, {MARKER!r}], start_new_session=True,\n"
              "                 stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)\n"
              f"subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(1000)', {MARKER!r}])")
    _notebook(klass / "sleeper", "00_setup.ipynb", "import torch", GOOD, "import time\ntime.sleep(1000)",
              "def never_defined():\n    pass")
    _notebook(klass / "crasher", "00_setup.ipynb", "import torch", GOOD, "import os\nos._exit(3)")
    if CONTAINED:
        _tamper(klass)
    lab00_before = (course / "labkit" / "grading" / "labs" / "lab00.py").read_text()
    started = time.monotonic()
    done, data = _grade(course, klass)
    elapsed = time.monotonic() - started
    survivors = _marked_processes()
    listener.setblocking(False)
    try:
        listener.accept()
        reached_network = True
    except BlockingIOError:
        reached_network = False
    listener.close()
    rows = {s["student"]: s for s in data["students"]} if data else {}
    return {"course": course, "done": done, "data": data, "students": rows, "survivors": survivors,
            "elapsed": elapsed, "report": report, "lab00_before": lab00_before, "network": reached_network}


def _lab(attacked, student: str, lab: str = "00") -> dict:
    labs = [row for row in attacked["students"][student]["labs"] if row["lab"] == lab and row["exercises"]]
    assert len(labs) == 1, labs
    return labs[0]


def _softmax(attacked, student: str) -> dict:
    return _lab(attacked, student)["exercises"][0]


def test_the_class_is_graded_and_a_lab00_only_folder_exits_nonzero(attacked):
    done, data = attacked["done"], attacked["data"]
    assert data is not None, done.stderr[-3000:]
    assert done.returncode == 1, done.stderr[-3000:]
    assert set(attacked["students"]) - {"tamperer", "later"} == {
        "patcher", "hooker", "printer", "specialist", "aliaser", "linker", "spawner", "sleeper", "crasher"}
    printer = attacked["students"]["printer"]
    all_labs = {row["lab"] for row in printer["labs"] if row["exercises"]}
    assert all_labs == {ex.lab for ex in exercises()}, "every lab the course grades has a row"
    assert printer["missing_labs"] == sorted({ex.lab for ex in exercises()} - {"00", "01"})
    missing = _lab(attacked, "printer", "05")
    assert missing["points"] == 0 and missing["max_points"] == sum(ex.points for ex in exercises("05"))
    assert "no notebook for lab 05" in missing["note"] + missing["exercises"][0]["feedback"]


def test_replacing_run_exercise_and_torch_allclose_from_a_cell_earns_nothing(attacked):
    softmax = _softmax(attacked, "patcher")
    assert softmax["points"] == 0
    assert softmax["feedback"] == "the values are not exp(x) / sum(exp(x)) along the last dimension"


def test_a_forged_json_line_from_an_ipython_hook_is_never_read(attacked):
    hooker = attacked["students"]["hooker"]
    assert _softmax(attacked, "hooker")["points"] == 0
    assert "forged" not in json.dumps(hooker)


def test_forged_totals_cannot_exceed_the_maximum(attacked):
    data = attacked["data"]
    for student in data["students"]:
        for lab in student["labs"]:
            assert all(0 <= e["points"] <= e["max_points"] for e in lab["exercises"])
            assert lab["points"] == sum(e["points"] for e in lab["exercises"]) <= lab["max_points"]
        assert student["points"] == sum(lab["points"] for lab in student["labs"])
    assert data["points"] == sum(s["points"] for s in data["students"]) <= data["max_points"]
    table = attacked["done"].stdout.replace(str(attacked["course"]), "<course>")
    assert "99" not in table.replace("0/1", ""), "a forged 99 reached the printed table"


def test_feedback_is_plain_text(attacked):
    feedback = _softmax(attacked, "hooker")["feedback"]
    assert feedback.startswith("your code raised ValueError: red")
    assert not any(ord(c) < 32 or c == "\x7f" for c in json.dumps(attacked["data"], ensure_ascii=False)
                   .replace("\n", ""))


def test_a_stray_print_neither_crashes_grading_nor_costs_points(attacked):
    assert _softmax(attacked, "printer")["points"] == 1, "`Copy of 00_setup.ipynb` is recognised as lab 00"


def test_output_beyond_the_limit_is_dropped_and_said_so(attacked):
    printer = _lab(attacked, "printer")
    assert printer["points"] == 1 and "outputs beyond 2048 KiB were dropped" in printer["note"]


def test_the_kernel_has_no_network_under_bubblewrap(attacked):
    if sandbox.mode() != "bwrap":
        pytest.skip("only bubblewrap cuts the network (README)")
    assert not attacked["network"]


def test_a_malformed_file_is_one_row_with_its_reason(attacked):
    broken = _lab(attacked, "printer", "01")
    assert broken["notebook"] == "01_text_to_tensors.ipynb" and broken["points"] == 0
    assert "not a readable notebook" in broken["note"]
    stray = [row for row in attacked["students"]["printer"]["labs"] if row["notebook"] == "my_notes.ipynb"]
    assert stray and "not named like a lab notebook" in stray[0]["note"]


def test_duplicates_are_flagged_not_summed(attacked):
    patcher = attacked["students"]["patcher"]
    notes = [row["note"] for row in patcher["labs"] if row["lab"] == "00" and not row["exercises"]]
    assert notes == ["duplicate: also handed in 00_setup (1).ipynb; only 00_setup.ipynb is graded"]
    assert sum(row["max_points"] for row in patcher["labs"] if row["lab"] == "00") == \
        sum(ex.points for ex in exercises("00"))


def test_torch_special_softmax_is_caught_where_the_builtin_is_forbidden(attacked):
    softmax = _softmax(attacked, "specialist")
    assert softmax["points"] == 0 and "`torch.special.softmax` is what this exercise asks you to write" in \
        softmax["feedback"]


def test_an_alias_of_a_forbidden_function_is_caught(attacked):
    softmax = _softmax(attacked, "aliaser")
    assert softmax["points"] == 0 and "`torch.nn.functional.softmax`" in softmax["feedback"]


def test_a_symlink_to_the_solutions_is_refused(attacked):
    linked = _lab(attacked, "linker")
    assert linked["points"] == 0 and "symbolic link" in linked["note"]


def test_a_timeout_keeps_the_points_earned_before_it_and_names_the_cell(attacked):
    sleeper = _lab(attacked, "sleeper")
    assert sleeper["points"] == 1
    assert sleeper["note"].startswith("cell 3 ran out of time (the cell limit of 20 s)")


def test_a_dead_kernel_keeps_the_points_earned_before_it_and_names_the_cell(attacked):
    crasher = _lab(attacked, "crasher")
    assert crasher["points"] == 1, crasher
    assert crasher["note"].startswith("cell 3 stopped the kernel")


def test_spawned_and_detached_processes_are_killed(attacked):
    if not CONTAINED:
        pytest.skip(NOT_CONTAINED)
    assert attacked["survivors"] == []
    assert "survived" not in json.dumps(attacked["data"])


def test_a_detached_process_cannot_rewrite_the_report_after_grading(attacked):
    if not CONTAINED:
        pytest.skip(NOT_CONTAINED)
    time.sleep(1.0)  # the rewriter retries every 0.1 s for 15 s, if it is alive
    assert json.loads(attacked["report"].read_text()) == attacked["data"]


def test_deleting_a_file_outside_the_students_folder_fails(attacked):
    if not CONTAINED:
        pytest.skip(NOT_CONTAINED)
    assert (attacked["course"] / "victim.txt").exists()


def _tamper(klass: Path) -> None:
    always_pass = '\n\n@exercise("00", "softmax")\ndef softmax(ns):\n    return "forged"\n'
    _notebook(klass / "tamperer", "00_setup.ipynb", "import torch", WRONG,
              f"import labkit.grading.labs.lab00 as lab00\nwith open(lab00.__file__, 'a') as f:\n"
              f"    f.write({always_pass!r})")
    _notebook(klass / "later", "00_setup.ipynb", "import torch", WRONG)


def test_appending_an_always_pass_grader_to_the_course_cannot_help_anyone(attacked, tmp_path):
    if CONTAINED:  # the tamperer was one of the class: the write fails, nobody passes
        grader = attacked["course"] / "labkit" / "grading" / "labs" / "lab00.py"
        assert grader.read_text() == attacked["lab00_before"], "the course is not writable to a student's kernel"
        assert _softmax(attacked, "tamperer")["points"] == _softmax(attacked, "later")["points"] == 0
        return
    course = _course_copy(tmp_path)  # without a sandbox the write succeeds: the fingerprint stops the run
    _tamper(tmp_path / "class")
    done, data = _grade(course, tmp_path / "class")
    assert done.returncode == 2 and data is None
    assert "course files changed during grading" in done.stderr


# --- one real kernel, graded in-process: the channel, tripwires and write-backs ------------------------

@pytest.fixture
def lab99():
    """Exercises of a lab the course does not have, registered for this test only."""
    registered = []

    def register(name, forbidden=()):
        def decorate(grader):
            registered.append(("99", name))
            return exercise("99", name, forbidden=forbidden)(grader)
        return decorate

    yield register
    for key in registered:
        _REGISTRY.pop(key, None)


def test_through_a_real_kernel_references_are_tripped_the_stack_is_ours_and_mutations_come_back(tmp_path, lab99):
    from labkit.grading.session import grade_contained

    def same_as_filter_logits(name):
        def grader(ns):
            logits = torch.randn(3, 9, generator=torch.Generator().manual_seed(0))
            got = require(ns, name)(logits.clone(), 2)
            if not torch.equal(got, filter_logits(logits, top_k=2)):
                raise ExerciseFailed("wrong")
            return "ok"
        return grader

    for name in ("top_k", "top_k_caught"):
        lab99(name, forbidden=("labkit.sampling.filter_logits",))(same_as_filter_logits(name))

    @lab99("peek")
    def peek(ns):
        want = torch.arange(5.0) * 3
        if not torch.equal(require(ns, "peek")(torch.arange(5.0)), want):
            raise ExerciseFailed("wrong")
        return "ok"

    @lab99("mutate")
    def mutate(ns):
        buffer = torch.zeros(10)
        view = buffer[2:6]
        queue, order, table = deque([1, 2]), OrderedDict([(3, None), (4, None)]), {7: 1}
        blocks = [Block(0), Block(1)]
        generator = torch.Generator().manual_seed(5)
        result = require(ns, "mutate")(view, queue, order, table, blocks, blocks[1], generator)
        expected_draw = torch.rand(1, generator=torch.Generator().manual_seed(5).manual_seed(5))
        checks = [buffer.tolist() == [0, 0, 1, 1, 1, 1, 0, 0, 0, 0], list(queue) == [2], list(order) == [4, 3],
                  table == {}, blocks[1].ref_count == 2, blocks[1].token_ids == (9, 9),
                  result[0] is blocks[1], result[1] is view, not torch.equal(torch.rand(1, generator=generator),
                                                                            expected_draw)]
        if not all(checks):
            raise ExerciseFailed(f"mutations lost: {checks}")
        return "ok"

    student = _notebook(
        tmp_path / "student", "99_attacks.ipynb",
        "import sys, torch\nfrom labkit.sampling import filter_logits as keep_it",
        "def top_k(logits, k):\n    return keep_it(logits, top_k=k)",
        "import labkit.sampling\ndef top_k_caught(logits, k):\n    try:\n"
        "        return labkit.sampling.filter_logits(logits, top_k=k)\n    except Exception:\n        return logits",
        "def peek(x):\n    frame = sys._getframe()\n    while frame is not None:\n"
        "        if 'want' in frame.f_locals:\n            return frame.f_locals['want']\n"
        "        frame = frame.f_back\n    return x",
        "def mutate(view, queue, order, table, blocks, block, generator):\n    view.fill_(1)\n    queue.popleft()\n"
        "    order.move_to_end(3)\n    table.clear()\n    block.ref_count = 2\n    block.token_ids = (9, 9)\n"
        "    torch.rand(1, generator=generator)\n    return block, view")
    uids = sandbox.UidPool() if sandbox.mode() == "uid" else None
    run = grade_contained(student, "99", [], sandbox.Limits(cell_s=60), uids)
    got = {o.name: o for o in run.outcomes}
    assert got["top_k"].message == "`filter_logits` is labkit's answer to this exercise: write your own"
    assert got["top_k_caught"].message == got["top_k"].message, "catching the tripwire does not help"
    assert got["peek"].message == "wrong", "the grader's frames are not in the student's process"
    assert got["mutate"].passed, got["mutate"].message
    # in-process (a notebook's check cell), the same peek does see the grader's frame: only the
    # trusted path is a score
    namespace = {}
    exec("import sys\n" + nbformat.read(student, 4).cells[3].source, namespace)
    assert run_exercise(get_exercise("99", "peek"), namespace).passed


# --- in-process: tripwires, static checks and the codec ------------------------------------------------

def test_tripwires_catch_aliases_and_restore_everything():
    originals = torch.softmax, torch.Tensor.softmax, torch.special.softmax, torch.nn.functional.softmax
    namespace = {}
    exec("from torch.special import softmax as s\ndef softmax(x):\n    return s(x, -1)", namespace)
    outcome = run_exercise(get_exercise("00", "softmax"), namespace)
    assert not outcome.passed and "`torch.special.softmax`" in outcome.message
    assert namespace["s"] is torch.special.softmax
    assert (torch.softmax, torch.Tensor.softmax, torch.special.softmax, torch.nn.functional.softmax) == originals
    assert "softmax" not in vars(torch.Tensor), "an inherited method is restored by removing the tripwire"


def test_the_static_check_sees_a_forbidden_call_on_a_path_the_tests_never_take():
    source = "def softmax(x):\n    if x.numel() < 0:\n        return x.softmax(-1)\n    return x"
    assert static_violations(source, "softmax", ("torch.Tensor.softmax",)) == ["torch.Tensor.softmax"]
    assert static_violations("%time\n" + source, "softmax", ("labkit.sampling.filter_logits",)) == []
    imports = "def f(x):\n    from labkit.sampling import filter_logits\n    return filter_logits(x)"
    assert static_violations(imports, "f", ("labkit.sampling.filter_logits",)) == ["labkit.sampling.filter_logits"]


def test_the_codec_keeps_views_and_shared_objects_and_writes_back_in_place():
    buffer = torch.arange(12.0)
    block = Block(3, 1, 77, (1, 2))
    value = [buffer[2:5], buffer.view(3, 4), {"b": block, "again": block}, (None, 1.5, float("nan")), b"\x00"]
    sender = Encoder()
    receiver = Decoder()
    decoded = receiver.decode(loads(dumps(sender.encode(value))))
    assert decoded[0].untyped_storage().data_ptr() == decoded[1].untyped_storage().data_ptr()
    assert decoded[2]["b"] is decoded[2]["again"] and decoded[2]["b"].hash == 77
    assert decoded[3][2] != decoded[3][2] and decoded[4] == b"\x00"
    decoded[1][0, 0] = -1.0  # what the far side does to its copies...
    decoded[2]["b"].ref_count = 5
    decoded[0].unsqueeze_(0)
    replier = Encoder(known={identity(obj): n for n, obj in receiver.objects.items()})
    updates = loads(dumps([[n, replier.contents(obj, n)] for n, obj in receiver.objects.items()]))
    originals = {sender.ids[identity(obj)]: obj for obj in sender.keep}
    writer = Decoder(known=originals)
    for n, node in updates:
        writer.fill(originals[n], node)
    assert buffer[0] == -1.0, "...lands in the caller's own tensor"
    assert block.ref_count == 5 and value[0].shape == (1, 3) and value[0].storage_offset() == 2


@pytest.mark.parametrize(
    ("node", "error"),
    [
        ({"t": "obj", "type": "os:system", "fields": {}}, "may not cross"),
        ({"t": "obj", "type": "labkit.grading.labs.lab00:torch", "fields": {}}, "not a course dataclass"),
        ({"t": "tensor", "storage": {"t": "storage", "device": "cpu", "b": "AAAA"}, "dtype": "float32",
          "shape": [100], "stride": [1], "offset": 0}, "reach outside its storage"),
        ({"t": "tensor", "storage": {"t": "storage", "device": "cpu", "b": ""}, "dtype": "os", "shape": [],
          "stride": [], "offset": 0}, "unknown dtype"),
        ({"t": "pickle", "b": "gASVAAAA"}, "unknown node type"),
        ({"ref": 5}, "unknown object"),
    ],
)
def test_the_codec_refuses_what_is_not_on_its_list(node, error):
    with pytest.raises(CodecError, match=error):
        Decoder().decode(node)
    with pytest.raises(CodecError, match="bare NaN"):
        loads('{"a": NaN}')
    with pytest.raises(CodecError, match="cannot be sent"):
        Encoder().encode(object())


def _alive(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def test_killing_a_kernel_takes_its_whole_tree():
    leader = subprocess.Popen([sys.executable, "-c", "import subprocess, time\n"
                               "subprocess.Popen(['sleep', '1000'])\ntime.sleep(1000)"], start_new_session=True)
    deadline = time.monotonic() + 20
    while len(sandbox.descendants(leader.pid)) < 2 and time.monotonic() < deadline:
        time.sleep(0.05)
    tree = sandbox.descendants(leader.pid)
    assert len(tree) == 2
    assert sandbox.kill_everything(leader.pid, None) == []
    leader.wait(timeout=10)
    assert not any(_alive(pid) for pid in tree)


@pytest.mark.skipif(os.geteuid() != 0, reason="a kernel gets a uid of its own only when grading as root")
def test_every_process_of_a_kernels_uid_dies_even_detached():
    uid = sandbox.UidPool().take()
    detached = subprocess.Popen(["sleep", "1000"], user=uid, group=uid, extra_groups=[], start_new_session=True,
                                cwd="/")
    leader = subprocess.Popen(["sleep", "1000"], user=uid, group=uid, extra_groups=[], cwd="/")
    assert sandbox.processes_of_uid(uid)
    assert sandbox.kill_everything(leader.pid, uid) == []
    for process in (detached, leader):
        process.wait(timeout=10)
    assert not any(_alive(pid) for pid in sandbox.processes_of_uid(uid))


def test_a_course_under_tmp_is_bound_back_into_the_sandbox(monkeypatch):
    """bubblewrap gives the kernel an empty /tmp: a clone there (as CI may make) must stay visible."""
    monkeypatch.setattr(sandbox, "COURSE_ROOT", Path("/tmp/ci/course"))
    monkeypatch.setattr(sandbox.sys, "prefix", "/tmp/ci/course/.venv")
    needed = sandbox._needed_under_scratch()
    assert needed[0] == Path("/tmp/ci/course") and Path("/tmp/ci/course/.venv") not in needed
    assert all(not p.is_relative_to("/tmp/ci/course") or p == Path("/tmp/ci/course") for p in needed)


def test_numpy_arrays_and_generators_cross_the_codec():
    """Lab 16 hands the student a numpy Generator and gets an array back: both must travel as data."""
    import numpy as np

    rng, array = np.random.default_rng(3), np.arange(6.0).reshape(2, 3)
    got_rng, got_array = Decoder().decode(loads(dumps(Encoder().encode([rng, array]))))
    assert got_rng.random() == np.random.default_rng(3).random()
    assert got_array.dtype == array.dtype and np.array_equal(got_array, array)
    with pytest.raises(CodecError, match="unknown numpy bit generator"):
        Decoder().decode(loads(dumps({"t": "np_generator", "state": json.dumps({"bit_generator": "os.system"})})))
