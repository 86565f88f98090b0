"""The trusted side of grading, piece by piece: the channel to a kernel, the codec, the tripwires and
the course rules, the sandbox's command line and its kill, the fingerprint of what grades.

Whole classes of attack notebooks, graded through the real command, are in test_grading_attacks.py.
"""

import functools
import json
import os
import socket
import subprocess
import sys
import threading
import time
from collections import OrderedDict, deque
from pathlib import Path

import nbformat
import pytest
import torch
from grading_support import write_back, write_notebook

from labkit.cache.block_manager import Block
from labkit.sampling import filter_logits
from labkit_course.grading import ExerciseFailed, exercise, integrity, require, rules, sandbox
from labkit_course.grading.codec import CodecError, Decoder, Encoder, dumps, loads
from labkit_course.grading.core import _REGISTRY, get_exercise, run_exercise
from labkit_course.grading.forbidden import Tripwires, static_violations
from labkit_course.grading.integrity import COURSE_ROOT
from labkit_course.grading.remote import receive_frame, send_frame
from labkit_course.grading.report import _cell, escape, format_table
from labkit_course.grading.session import ContainedKernel

HOW = "bwrap" if sandbox.bwrap_problem() is None else "none"


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
    from labkit_course.grading.session import grade_contained, read_notebook

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

    student = write_notebook(
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
    run = grade_contained(read_notebook(student), "99", sandbox.Limits(cell_s=60), HOW)
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


def test_whatever_holds_a_forbidden_function_from_before_grading_holds_a_guard(tmp_path, lab99):
    """Guards replace the lab's forbidden functions, labkit's and torch's, before the notebook's first cell, so
    the holders the second red team hid them in (an OrderedDict, a weakref, a generator, a class claiming
    another module) and lists deeper than the tripwires' scan (HOLDER_DEPTH) hold a guard that trips;
    outside a graded call the guard is the function (the notebook's own cells run)."""
    from labkit_course.grading.session import grade_contained, read_notebook

    def same_as(name, answer):
        def grader(ns):
            x = torch.randn(3, 9, generator=torch.Generator().manual_seed(0))
            if not torch.allclose(require(ns, name)(x.clone()), answer(x)):
                raise ExerciseFailed("wrong")
            return "ok"
        return grader

    top_k = "`apply_top_k` is labkit's answer to this exercise: write your own"
    expected = {"ordered": top_k, "weak": top_k, "generated": top_k, "disguised_class": top_k, "notebook_time": top_k}
    for name in expected:
        lab99(name, forbidden=("labkit.sampling.filters.apply_top_k",))(
            same_as(name, lambda x: filter_logits(x, top_k=2)))
    for name, path in (("deep", "torch.softmax"), ("method_in_generator", "torch.Tensor.softmax"), ("mine", None)):
        lab99(name, forbidden=("torch.softmax", "torch.Tensor.softmax"))(same_as(name, lambda x: x.softmax(-1)))
        expected[name] = path and f"`{path}` is what this exercise asks you to write: build it from simpler operations"
    student = write_notebook(
        tmp_path / "student", "99_holders.ipynb",
        "import collections, weakref, torch\nfrom labkit.sampling.filters import apply_top_k\n"
        "HELD = collections.OrderedDict(f=apply_top_k)\nWEAK = weakref.ref(apply_top_k)\n"
        "def forever(f):\n    while True:\n        yield f\nGEN = forever(apply_top_k)\n"
        "Elsewhere = type('Elsewhere', (), {'__module__': 'torch.nn', 'f': staticmethod(apply_top_k)})\n"
        "BEFORE = apply_top_k(torch.tensor([[1.0, 3.0, 2.0]]), torch.tensor([1]))  # not graded: labkit's own\n"
        "DEEP = [[[[[torch.softmax]]]]]\nSOFTMAXES = forever(torch.Tensor.softmax)\n"
        "DEEP[0][0][0][0][0](torch.ones(2), 0)  # not graded: torch's own",
        "def ordered(logits):\n    return HELD['f'](logits, 2)",
        "def weak(logits):\n    return WEAK()(logits, 2)",
        "def generated(logits):\n    return next(GEN)(logits, 2)",
        "def disguised_class(logits):\n    return Elsewhere.f(logits, 2)",
        "def notebook_time(logits):\n    return BEFORE if False else HELD['f'](logits, 2)",
        "def deep(x):\n    return DEEP[0][0][0][0][0](x, -1)",
        "def method_in_generator(x):\n    return next(SOFTMAXES)(x, -1)",
        "def mine(x):\n    e = (x - x.max(-1, keepdim=True).values).exp()\n    return e / e.sum(-1, keepdim=True)")
    run = grade_contained(read_notebook(student), "99", sandbox.Limits(cell_s=60), HOW)
    assert not run.failed_cells, run.failed_cells
    assert {o.name: None if o.passed else o.message for o in run.outcomes} == expected


def test_a_grader_launches_the_students_triton_kernel_in_the_students_kernel(tmp_path, lab99):
    """`kernel[grid](...)` on a proxy runs the launch in the student's process; outputs come back in place."""
    from labkit_course.grading.session import grade_contained, read_notebook

    def launches(name):
        def grader(ns):
            kernel = require(ns, name)()
            src, dst = torch.arange(10.0), torch.zeros(10)
            kernel[(3,)](src, dst, 10, BLOCK=4)
            if not torch.equal(dst, src):
                raise ExerciseFailed(f"copied {dst.tolist()}")
            return "ok"
        return grader

    names = ("copy", "not_a_kernel", "torch_behind_kernel_interface", "calls_labkit", "disguised", "held_by_a_class",
             "reached_at_run_time", "raw_function", "rewritten_function", "python_inside", "compile_time_python",
             "prints", "two_defs", "hooked", "launcher_replaced", "init_args_replaced", "after_grid_descriptor",
             "device_print_replaced")  # from launcher_replaced on, they patch triton: they stay last
    for name in names:
        lab99(name, forbidden=("labkit.attention.triton_kernels.jit_kernels",))(launches(name))
    student = write_notebook(
        tmp_path / "student", "99_triton.ipynb",
        "import os\nos.environ['TRITON_INTERPRET'] = '1'\nimport triton, triton.language as tl",
        "@triton.jit\ndef copy_kernel(src, dst, n, BLOCK: tl.constexpr):\n"
        "    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)\n"
        "    tl.store(dst + offs, tl.load(src + offs, mask=offs < n), mask=offs < n)",
        "def copy():\n    return copy_kernel",
        "def not_a_kernel():\n    return lambda src, dst, n, BLOCK: dst.copy_(src)",
        "from triton.runtime.jit import KernelInterface\n"
        "class Launcher(KernelInterface):\n"
        "    def run(self, src, dst, n, *, grid, warmup, **constexprs):\n        dst.copy_(src)\n"
        "def torch_behind_kernel_interface():\n    return Launcher()",
        "from labkit.attention import triton_kernels\nLABKIT_STORE = triton_kernels.jit_kernels()[0]\n"
        "@triton.jit\ndef through_labkit(src, dst, n, BLOCK: tl.constexpr):\n"
        "    LABKIT_STORE(src, src, dst, dst, src, 0, 0, BLOCK, BLOCK)\n"
        "@triton.jit\ndef helper_of_mine(src, dst, n, BLOCK: tl.constexpr):\n    through_labkit(src, dst, n, BLOCK)\n"
        "def calls_labkit():\n    return helper_of_mine",
        # the red team's ways to the same kernel: its module renamed, kept on a class, looked up as the kernel runs
        "DISGUISED = triton_kernels.jit_kernels()[0]\nDISGUISED.fn.__module__ = '__main__'\n"
        "@triton.jit\ndef mine(src, dst, n, BLOCK: tl.constexpr):\n"
        "    DISGUISED(src, src, dst, dst, src, 0, 0, BLOCK, BLOCK)\n"
        "def disguised():\n    return mine",
        "class Holder:\n    store = triton_kernels.jit_kernels()[0]\n"
        "@triton.jit\ndef held(src, dst, n, BLOCK: tl.constexpr):\n"
        "    Holder.store(src, src, dst, dst, src, 0, 0, BLOCK, BLOCK)\n"
        "def held_by_a_class():\n    return held",
        "triton_kernels.tl = tl  # what the interpreter asks of a kernel's module\n"
        "@triton.jit\ndef looked_up(src, dst, n, BLOCK: tl.constexpr):\n"
        "    globals()['LABKIT_' + 'STORE'](src, src, dst, dst, src, 0, 0, BLOCK, BLOCK)\n"
        "def reached_at_run_time():\n    return looked_up",
        # labkit's kernel as the plain Python the interpreter runs: its function, or the interpreter's rewrite of it
        "RAW = LABKIT_STORE.fn\n"
        "@triton.jit\ndef raw(src, dst, n, BLOCK: tl.constexpr):\n"
        "    RAW(src, src, dst, dst, src, 0, 0, BLOCK, BLOCK)\n"
        "def raw_function():\n    return raw",
        "from triton.runtime.interpreter import InterpretedFunction\n"
        "REWRITTEN = LABKIT_STORE.rewrite()\nInterpretedFunction.rewritten_fn.clear()\n"
        "@triton.jit\ndef rewritten(src, dst, n, BLOCK: tl.constexpr):\n"
        "    REWRITTEN(src, src, dst, dst, src, 0, 0, BLOCK, BLOCK)\n"
        "def rewritten_function():\n    return rewritten",
        # the fourth red team's: plain Python (torch, numpy over raw memory) called from the interpreted kernel, and
        # Python that Triton's compiler would run while compiling, so that compiled and interpreted kernels differ
        "def _by_torch(src, dst):\n    pass  # would view the pointers' memory and copy with torch\n"
        "@triton.jit\ndef python(src, dst, n, BLOCK: tl.constexpr):\n    _by_torch(src, dst)\n"
        "def python_inside():\n    return python",
        "@triton.constexpr_function\ndef width(block):\n    return block\n"
        "@triton.jit\ndef compile_time(src, dst, n, BLOCK: tl.constexpr):\n"
        "    offs = tl.program_id(0) * BLOCK + tl.arange(0, width(BLOCK))\n"
        "    tl.store(dst + offs, tl.load(src + offs, mask=offs < n), mask=offs < n)\n"
        "def compile_time_python():\n    return compile_time",
        "@triton.jit\ndef printing(src, dst, n, BLOCK: tl.constexpr):\n    tl.static_print('row', src, dst, n)\n"
        "def prints():  # the interpreter's print is Python's, whose sys.stdout the notebook may have replaced\n"
        "    return printing",
        "@triton.jit\ndef twice(src, dst, n, BLOCK: tl.constexpr):\n"
        "    tl.static_assert(BLOCK > 0, 'x'\n        'y')  # a string could hold a line starting with def\n"
        "    if BLOCK < 0:\n        def twice(src, dst, n, BLOCK):\n            pass\n"
        "def two_defs():  # the interpreter runs the function from the last line starting with def\n"
        "    return twice",
        # the second red team's: an empty kernel whose pre-run hook, or a replaced launcher, copies with torch
        "@triton.jit\ndef empty(src, dst, n, BLOCK: tl.constexpr):\n    pass\n"
        "def hooked():\n    empty.add_pre_run_hook(lambda src, dst, n, BLOCK=None: dst.copy_(src))\n    return empty",
        "from triton.runtime.interpreter import GridExecutor\nORIGINAL_RUN = InterpretedFunction.run\n"
        "keep_init, keep_restore = GridExecutor._init_args_hst, GridExecutor._restore_args_dev\n"
        "def launcher_replaced():\n"
        "    InterpretedFunction.run = lambda self, src, dst, n, grid, warmup, **kw: dst.copy_(src)\n"
        "    return copy_kernel",
        "@triton.jit\ndef nothing(src, dst, n, BLOCK: tl.constexpr):\n    pass\n"
        "def init_args_replaced():  # a step of every launch that is handed the grader's tensors\n"
        "    InterpretedFunction.run = ORIGINAL_RUN\n    keep = GridExecutor._init_args_hst\n"
        "    def copying(self, args, kwargs):\n        args[1].copy_(args[0])\n"
        "        return keep(self, args, kwargs)\n"
        "    GridExecutor._init_args_hst = copying\n    return nothing",
        # the fifth red team's: a step of the launch replaced by an object that is not a function (a descriptor),
        # and a member of triton.language the compiler sees as imported but the interpreter would run
        "import functools\n"
        "class AfterGrid:\n    def __get__(self, executor, owner=None):\n"
        "        return functools.partial(lambda executor, dev, hst, kw, kw_hst: dev[1].copy_(dev[0]), executor)\n"
        "def after_grid_descriptor():\n    GridExecutor._init_args_hst = keep_init\n"
        "    GridExecutor._restore_args_dev = AfterGrid()\n    return nothing",
        "class Printer:\n    __call__ = staticmethod(lambda prefix, src, dst, n: None)\n"
        "@triton.jit\ndef quiet(src, dst, n, BLOCK: tl.constexpr):\n    tl.device_print('row', src)\n"
        "def device_print_replaced():\n    GridExecutor._restore_args_dev = keep_restore\n"
        "    tl.device_print = Printer()\n    return quiet")
    run = grade_contained(read_notebook(student), "99", sandbox.Limits(cell_s=60), HOW)
    got = {o.name: o for o in run.outcomes}
    assert got["copy"].passed, got["copy"].message
    assert "function is not a Triton kernel" in got["not_a_kernel"].message
    assert "Launcher is not a Triton kernel" in got["torch_behind_kernel_interface"].message
    for name in ("calls_labkit", "disguised", "held_by_a_class"):
        assert "`store_kv_kernel` is labkit's answer to this exercise" in got[name].message, name
    assert "would not compile for a GPU" in got["reached_at_run_time"].message
    assert "NameError('globals is not defined')" in got["reached_at_run_time"].message
    for name, kernel, used, kind in (("raw_function", "raw", "RAW", "function"),
                                     ("rewritten_function", "rewritten", "REWRITTEN", "function"),
                                     ("python_inside", "python", "_by_torch", "function"),
                                     ("compile_time_python", "compile_time", "width", "ConstexprFunction")):
        assert f"your kernel `{kernel}` uses `{used}`, a {kind} that is not Triton's, which Triton would run as " \
            "Python" in got[name].message, got[name].message
    assert "the kernel has pre-run hooks" in got["hooked"].message
    assert "your kernel `printing` prints" in got["prints"].message
    assert "the source of your kernel `twice` has more than one line starting with `def`" in got["two_defs"].message
    assert "your kernel `quiet` prints" in got["device_print_replaced"].message
    for name, replaced in (("launcher_replaced", "InterpretedFunction.run"),
                           ("init_args_replaced", "GridExecutor._init_args_hst"),
                           ("after_grid_descriptor", "GridExecutor._restore_args_dev")):
        assert f"`triton.runtime.interpreter.{replaced}` is not the function its package defines" \
            in got[name].message, got[name].message


# --- in-process: tripwires, static checks and the codec ------------------------------------------------

def test_a_kernel_compiles_and_launches_on_triton_as_imported(monkeypatch):
    """What a notebook puts into Triton's modules or classes (here tl.device_print and a step of the launch) is
    not what the compiler checked, so it is not there while a graded kernel compiles or runs; it is afterwards."""
    import triton.language as tl
    from triton.runtime.interpreter import GridExecutor

    from labkit_course.grading.kernels import pristine_triton

    imported = tl.device_print, GridExecutor._restore_args_dev
    monkeypatch.setattr(tl, "device_print", object())
    monkeypatch.setattr(GridExecutor, "_restore_args_dev", object())
    with pristine_triton():
        assert (tl.device_print, GridExecutor._restore_args_dev) == imported
    assert tl.device_print is not imported[0] and GridExecutor._restore_args_dev is not imported[1]


def test_while_a_kernel_launches_labkits_kernels_refuse_to_run_in_any_form():
    """Behind the checks before a launch, labkit's kernels refuse while the student's runs: launched, called,
    as their Python function or as the interpreter's rewrite of it, and everything is restored afterwards."""
    import triton.language as tl
    from triton.runtime.interpreter import InterpretedFunction

    from labkit.attention.triton_kernels import jit_kernels
    from labkit_course.grading.forbidden import ForbiddenCall
    from labkit_course.grading.kernels import labkit_kernels_refused

    store = jit_kernels()[0]
    rewrite = store.rewrite()
    wires = Tripwires(("labkit.attention.triton_kernels.jit_kernels",))
    attempts = (lambda: store[(1,)](), lambda: store(), lambda: store.fn(0, 0, 0, 0, 0, 0, 0, 1, 1),
                lambda: rewrite(0, 0, 0, 0, 0, 0, 0, 1, 1))
    with labkit_kernels_refused(store, [], wires):
        for attempt in attempts:
            with pytest.raises(ForbiddenCall):
                attempt()
    assert len(wires.tripped) == len(attempts)
    assert type(store) is InterpretedFunction and store.fn.__closure__[0].cell_contents is tl
    assert rewrite.__globals__["tl"] is tl

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
    write_back(sender, receiver)
    assert buffer[0] == -1.0, "...lands in the caller's own tensor"
    assert block.ref_count == 5 and value[0].shape == (1, 3) and value[0].storage_offset() == 2


@pytest.mark.parametrize(
    ("node", "error"),
    [
        ({"t": "obj", "type": "os:system", "fields": {}}, "may not cross"),
        ({"t": "obj", "type": "labkit_course.grading.labs.lab00:torch", "fields": {}}, "may not cross"),
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
    assert sandbox.kill_tree(leader.pid) == []
    leader.wait(timeout=10)
    assert not any(_alive(pid) for pid in tree)


STARTING_WORKER = """
import subprocess, time
end, born, killed = time.monotonic() + 3, 0, 0
while time.monotonic() < end:
    born, killed = born + 1, killed + (subprocess.Popen(['sleep', '0.01']).wait() == -9)
print(born, killed)
"""
SPARING_GRADER = f"""
import subprocess, sys
from labkit_course.grading import sandbox
worker = subprocess.Popen([sys.executable, "-c", {STARTING_WORKER!r}], stdout=subprocess.PIPE, text=True)
while worker.poll() is None:
    sandbox.kill_descendants(spare={{worker.pid}})
print(worker.stdout.read())
"""


def test_finishing_one_worker_kills_nothing_another_is_starting():
    """The grader kills what a finished worker left behind while other workers start kernels: none of
    their new processes may be taken for a leftover (a class once lost a starting kernel that way)."""
    done = subprocess.run([sys.executable, "-c", SPARING_GRADER], capture_output=True, text=True, timeout=60)
    born, killed = map(int, done.stdout.split())
    assert born > 50 and killed == 0, (born, killed)


def test_a_replaced_kernels_cleanup_leaves_its_replacement_alone(tmp_path):
    """A dead kernel's manager removes its connection file and sockets when it is cleaned up, which may come
    after its replacement made its own: the two must not share paths (a replacement then never answered, and
    the notebook earned nothing)."""
    from labkit_course.grading.session import _blocking_client

    workdir = sandbox.Workdir.create(None, tmp_path)
    limits = sandbox.Limits(cell_s=30)
    kernel = ContainedKernel(workdir, limits, "none", None)
    try:
        first = kernel.client(nbformat.v4.new_notebook())
        kernel.start(first)
        first.kc.stop_channels()
        kernel.kill()
        for leftover in workdir.channel.glob("ipc*"):  # as after a crash: nothing of the first kernel is left
            leftover.unlink()
        second = kernel.client(nbformat.v4.new_notebook())
        kernel.start(second)
        second.kc.stop_channels()
        first.km.cleanup_connection_file()
        first.km.cleanup_ipc_files()
        client = _blocking_client(second, limits)
        try:  # a new connection to the replacement, as grading makes: it answers (its sockets are still there)
            assert client.execute("1 + 1", reply=True, timeout=60)["content"]["status"] == "ok"
        finally:
            client.stop_channels()
    finally:
        kernel.kill()
        workdir.remove()


def test_a_leader_already_reaped_is_not_killed_by_its_old_pid():
    stranger = subprocess.Popen(["sleep", "1000"])  # stands in for a process given a dead leader's pid
    reaped = subprocess.Popen(["true"])
    reaped.wait()
    reaped.pid = stranger.pid
    kernel = ContainedKernel(None, sandbox.Limits(), "none", None)
    kernel.leaders.append(reaped)
    try:
        assert kernel.kill() == [] and stranger.poll() is None
    finally:
        stranger.kill()
        stranger.wait()


@pytest.mark.skipif(os.geteuid() != 0, reason="a kernel gets a uid of its own only when grading as root")
def test_every_process_of_a_kernels_uid_dies_even_detached():
    uid = sandbox.UIDS.take()
    try:
        detached = subprocess.Popen(["sleep", "1000"], user=uid, group=uid, extra_groups=[], start_new_session=True,
                                    cwd="/")
        leader = subprocess.Popen(["sleep", "1000"], user=uid, group=uid, extra_groups=[], cwd="/")
        assert sandbox.processes_of_uid(uid)
        assert sandbox.kill_tree(leader.pid, uid) == []
        for process in (detached, leader):
            process.wait(timeout=10)
        assert not any(_alive(pid) for pid in sandbox.processes_of_uid(uid))
    finally:
        sandbox.UIDS.give_back(uid)


def test_numpy_arrays_and_generators_cross_the_codec():
    """Lab 16 hands the student a numpy Generator and gets an array back: both must travel as data."""
    import numpy as np

    rng, array = np.random.default_rng(3), np.arange(6.0).reshape(2, 3)
    got_rng, got_array = Decoder().decode(loads(dumps(Encoder().encode([rng, array]))))
    assert got_rng.random() == np.random.default_rng(3).random()
    assert got_array.dtype == array.dtype and np.array_equal(got_array, array)
    with pytest.raises(CodecError, match="unknown numpy bit generator"):
        Decoder().decode(loads(dumps({"t": "np_generator", "state": json.dumps({"bit_generator": "os.system"})})))


# --- the sandbox: what a kernel sees, and what it is --------------------------------------------------

def _mounts(command: list[str]) -> list[tuple[str, ...]]:
    """bubblewrap's options as (option, its arguments) in order, up to the command it runs."""
    arity = {"--ro-bind": 2, "--bind": 2, "--symlink": 2, "--tmpfs": 1, "--dir": 1, "--perms": 1, "--size": 1,
             "--proc": 1, "--dev": 1, "--chdir": 1, "--setenv": 2}
    found, i = [], 1
    while command[i] != "--":
        n = arity.get(command[i], 0)
        found.append(tuple(command[i:i + 1 + n]))
        i += 1 + n
    return found


def test_a_kernel_is_given_labkit_and_its_python_never_the_checkout(monkeypatch, tmp_path):
    """A course cloned under /tmp (as CI does) is bound onto the sandbox's fresh /tmp, but only its two
    packages and environment: not .git, solutions/, notebooks/ or the reports; the graders are hidden."""
    monkeypatch.setattr(sandbox, "COURSE_ROOT", Path("/tmp/ci/course"))
    monkeypatch.setattr(sandbox.sys, "prefix", "/tmp/ci/course/.venv")
    workdir = sandbox.Workdir.create(None)
    try:
        mounts = _mounts(sandbox.wrap_command(["python"], workdir, sandbox.Limits(), None, "bwrap"))
    finally:
        workdir.remove()
    binds = [m[1] for m in mounts if m[0] in ("--ro-bind", "--bind")]
    assert {"/tmp/ci/course/labkit", "/tmp/ci/course/course/labkit_course", "/tmp/ci/course/datasets",
            "/tmp/ci/course/.venv"} <= set(binds)
    assert not any(b in ("/tmp/ci/course", "/", "/tmp", "/root", "/home") for b in binds)
    labkit = mounts.index(("--ro-bind", "/tmp/ci/course/labkit", "/tmp/ci/course/labkit"))
    graders = mounts.index(("--tmpfs", "/tmp/ci/course/course/labkit_course/grading/labs"))
    assert mounts.index(("--tmpfs", "/tmp")) < labkit < graders
    assert ("--tmpfs", str(workdir.home)) in mounts and ("--bind", str(workdir.channel), str(workdir.channel)) in mounts
    assert [m for m in mounts if m[0] == "--size"] == [("--size", str(sandbox.Limits().tmpfs_bytes))] * 3
    assert {("--unshare-net",), ("--unshare-pid",), ("--die-with-parent",), ("--new-session",)} <= set(mounts)


PROBE = """
import ctypes, json, os, sys
seen = {}
def attempt(name, action):
    try:
        seen[name] = repr(action())[:200]
    except Exception as error:
        seen[name] = type(error).__name__
status = dict(line.split(':', 1) for line in open('/proc/self/status') if ':' in line)
seen['ids'] = [os.getuid(), os.geteuid(), os.getgid(), os.getgroups()]
seen['caps'] = [status[k].strip() for k in ('CapPrm', 'CapEff', 'CapBnd', 'CapAmb', 'NoNewPrivs')]
course = sys.argv[1]
attempt('course', lambda: sorted(os.listdir(course)))
attempt('graders', lambda: sorted(os.listdir(course + '/course/labkit_course/grading/labs')))
attempt('secret', lambda: open(sys.argv[2]).read())
attempt('write_labkit', lambda: open(course + '/labkit/planted.py', 'w'))
attempt('write_venv', lambda: open(sys.prefix + '/planted.pth', 'w'))
attempt('setuid0', lambda: os.setuid(0))
libc = ctypes.CDLL(None, use_errno=True)
seen['umount_tmp'] = [libc.umount2(b'/tmp', 2), ctypes.get_errno()]
seen['remount_root'] = [libc.mount(b'none', b'/', None, 32 | 4096 | 1 ^ 1, None), ctypes.get_errno()]
attempt('processes', lambda: sorted(p for p in os.listdir('/proc') if p.isdigit()))
attempt('etc', lambda: sorted(os.listdir('/etc')))
print(json.dumps(seen))
"""


@pytest.mark.skipif(HOW != "bwrap", reason="bubblewrap does not work on this machine")
def test_a_sandboxed_process_has_no_privilege_and_sees_only_what_it_needs(tmp_path):
    secret = tmp_path / "instructor-secret.txt"
    secret.write_text("the instructor's secret")
    secret.chmod(0o600)
    uid = sandbox.UIDS.take() if sandbox.is_root() else None
    workdir = sandbox.Workdir.create(uid)
    try:
        command = sandbox.wrap_command([sys.executable, "-c", PROBE, str(COURSE_ROOT), str(secret)], workdir,
                                       sandbox.Limits(), uid, "bwrap")
        done = subprocess.run(command, capture_output=True, text=True, timeout=120, env=sandbox.kernel_env(workdir),
                              cwd=workdir.root)
    finally:
        workdir.remove()
        if uid is not None:
            sandbox.UIDS.give_back(uid)
    assert done.returncode == 0, done.stderr[-2000:]
    seen = json.loads(done.stdout)
    if uid is not None:
        assert seen["ids"] == [uid, uid, uid, []], "as root, the kernel runs as a uid of its own"
    assert seen["caps"] == ["0000000000000000"] * 4 + ["1"], "no capabilities, and no way to gain any"
    bound = {"labkit", "course", "datasets", ".venv"} & set(os.listdir(COURSE_ROOT))
    assert json.loads(seen["course"].replace("'", '"')) == sorted(bound)
    assert seen["graders"] == "[]", "the graders and the knowledge checks' keys are not there"
    assert seen["secret"] == "FileNotFoundError"
    assert seen["write_labkit"] in ("OSError", "PermissionError") and seen["write_venv"] in ("OSError",
                                                                                               "PermissionError")
    assert not (COURSE_ROOT / "labkit" / "planted.py").exists()
    assert seen["setuid0"] == "PermissionError"
    assert seen["umount_tmp"][0] == -1 and seen["remount_root"][0] == -1
    assert len(json.loads(seen["processes"].replace("'", '"'))) <= 3, "its own process namespace"
    assert "shadow" not in seen["etc"] and "sudoers" not in seen["etc"]


@pytest.mark.skipif(not sandbox.is_root(), reason="only root drops to another uid")
def test_confine_drops_every_capability_for_good():
    uid = sandbox.UIDS.take()
    try:
        done = subprocess.run([sys.executable, "-I", "-S", str(sandbox.CONFINE), "--uid", str(uid), "--file-bytes",
                               "1024", "--processes", "8", "--", "/bin/sh", "-c",
                               "cat /proc/self/status; echo FSIZE $(ulimit -f)"],
                              capture_output=True, text=True, timeout=60, cwd="/")
    finally:
        sandbox.UIDS.give_back(uid)
    assert done.returncode == 0, done.stderr
    status = dict(line.split(":", 1) for line in done.stdout.splitlines() if ":" in line)
    assert all(int(status[k], 16) == 0 for k in ("CapPrm", "CapEff", "CapBnd", "CapAmb"))
    assert status["NoNewPrivs"].strip() == "1" and status["Uid"].split() == [str(uid)] * 4
    assert "FSIZE 2" in done.stdout, "ulimit -f counts 512-byte blocks"


def test_a_full_channel_folder_is_noticed(tmp_path):
    workdir = sandbox.Workdir.create(None)
    try:
        assert workdir.channel_overflow(100) is None
        (workdir.channel / "junk").write_bytes(b"x" * 101)
        assert "101 bytes" in workdir.channel_overflow(100)
        (workdir.channel / "junk").unlink()
        (workdir.channel / "a" / "b").mkdir(parents=True)  # below the top level counts too
        (workdir.channel / "a" / "b" / "deep").write_bytes(b"x" * 101)
        assert "101 bytes" in workdir.channel_overflow(100)
        for i in range(70):
            (workdir.channel / "a" / f"f{i}").touch()
        assert "too many files" in workdir.channel_overflow(10**9)
    finally:
        workdir.remove()


# --- reading a kernel's replies: bounded in time, size and work ----------------------------------------

def test_half_a_frame_then_silence_times_out_instead_of_blocking():
    ours, theirs = socket.socketpair()
    try:
        theirs.sendall(b"\x00\x00\x00\x00\x00\x00\x00\x64" + b"x" * 10)  # says 100 bytes, sends 10
        started = time.monotonic()
        with pytest.raises(TimeoutError, match="stopped after 10 of its 100 bytes"):
            receive_frame(ours, 1000, time.monotonic() + 0.5)
        assert time.monotonic() - started < 2
        theirs.sendall(b"\x00\x00\x00\x00\x7f\x00\x00\x00")
        with pytest.raises(CodecError, match="exceeds the limit of 1000"):
            receive_frame(ours, 1000, time.monotonic() + 0.5)
    finally:
        ours.close()
        theirs.close()
    slow, reader = socket.socketpair()  # a frame that keeps trickling in is cut at the deadline all the same
    stop = threading.Event()

    def trickle():
        slow.sendall(b"\x00\x00\x00\x00\x00\x00\x10\x00")
        while not stop.wait(0.05):
            slow.sendall(b"x")

    sender = threading.Thread(target=trickle, daemon=True)
    sender.start()
    started = time.monotonic()
    with pytest.raises(TimeoutError, match="stopped after"):
        receive_frame(reader, 2**20, time.monotonic() + 0.6)
    assert time.monotonic() - started < 1.0
    stop.set()
    sender.join()
    slow.close()
    reader.close()
    a, b = socket.socketpair()
    send_frame(a, '{"nonce": 1}')
    assert receive_frame(b, 100, time.monotonic() + 1) == '{"nonce": 1}'
    a.close()
    b.close()


def _timed_decode(node):
    started = time.monotonic()
    try:
        return Decoder().decode(loads(dumps(node)))
    finally:
        assert time.monotonic() - started < 2, "decoding is linear in the message"


@pytest.mark.parametrize("kind", ["set", "dict", "frozenset"])
def test_elements_that_collide_in_hash_are_refused_not_inserted(kind):
    modulus = 2**61 - 1  # hash(n) == n mod this, for ints: these all hash to 1
    items = [1 + k * modulus for k in range(20_000)]
    node = {"t": kind, "items": [[i, None] for i in items] if kind == "dict" else items}
    with pytest.raises(CodecError, match="share one hash"):
        _timed_decode(node)
    assert _timed_decode({"t": kind, "items": [[i, 0] for i in range(20_000)] if kind == "dict"
                          else list(range(20_000))})


def test_a_tensor_repeated_by_zero_strides_is_refused():
    storage = {"t": "storage", "device": "cpu", "b": "AAAAAA=="}  # 4 bytes
    huge = {"t": "tensor", "storage": storage, "dtype": "float32", "shape": [2**28, 4], "stride": [0, 0],
            "offset": 0}
    with pytest.raises(CodecError, match="zero strides"):
        _timed_decode(huge)
    small = dict(huge, shape=[1000, 4])  # a broadcast view of a few KiB is still a value a grader may get
    assert _timed_decode(small).shape == (1000, 4)
    with pytest.raises(CodecError, match="non-negative integers"):
        _timed_decode(dict(huge, shape=[2**60], stride=[0]))


def test_deep_nesting_and_lying_arrays_are_refused_before_any_work():
    node = {"t": "list", "items": []}
    for _ in range(100):
        node = {"t": "list", "items": [node]}
    with pytest.raises(CodecError, match="nested deeper"):
        _timed_decode(node)
    with pytest.raises(CodecError, match="do not match its shape"):
        _timed_decode({"t": "ndarray", "dtype": "<f8", "shape": [2**40], "b": ""})


# --- the report: what a student names is shown, never obeyed --------------------------------------------

def test_names_with_newlines_and_escape_sequences_stay_on_their_row():
    from labkit_course.grading.core import Outcome
    from labkit_course.grading.report import LabReport

    name = "00_x\nstudent  00  softmax  1/1  ✔ forged\ntotal 93∕93\x1b[2K\u202e.ipynb"
    reports = [LabReport("00", name, [Outcome("00", "softmax", 0, 1, "wrong")], "mallory\nbob: total 93/93",
                         note="duplicate: also handed in " + escape(name)),
               LabReport("00", "00_setup.ipynb", [Outcome("00", "softmax", 1, 1, "ok")], "alice")]
    lines = format_table(reports).splitlines()
    assert not any("\x1b" in line or "\u202e" in line for line in lines)
    assert not any(line.startswith(("bob", "total", "student  00  softmax")) for line in lines), lines
    assert lines[-2:] == ["mallory\\nbob: total 93/93: total 0/1", "alice: total 1/1"]
    assert escape(name).count("\\n") == 2 and "\\x1b[2K\\u202e" in escape(name)
    assert [_cell(n) for n in ("=HYPERLINK(1)", "+1", "-2", "@x", "alice")] == \
        ["'=HYPERLINK(1)", "'+1", "'-2", "'@x", "alice"]


# --- the course rules, read from the notebook as handed in ------------------------------------------

@pytest.mark.parametrize(("source", "named"), [
    ("import inspect, labkit.sampling\nexec(inspect.getsource(labkit.sampling.filter_logits))", "inspect"),
    ("import labkit.sampling as s\nf = type(s.filter_logits)(s.filter_logits.__code__, s.filter_logits.__globals__)",
     "__code__"),
    ("import importlib, labkit.sampling\nimportlib.reload(labkit.sampling)", "importlib"),
    ("def top_k(x, k):\n    import sys\n    return sys._getframe(1).f_locals['wires']", "f_locals"),
    ("try:\n    1 / 0\nexcept Exception as e:\n    frame = e.__traceback__.tb_frame", "tb_frame"),
    ("from labkit_course.grading.labs import lab06\nanswers = dict(lab06.QUESTIONS)", "labkit_course.grading.labs"),
    ("from labkit_course import grading\nkey = grading.labs", "labkit_course.grading"),
    ("import gc\nsaved = [o for o in gc.get_objects()]", "gc"),
    ("f = getattr(torch, '_' + 'C')", "getattr"),
    ("from torch import _C", "torch._C"),
    ("import torch\ny = torch.ops.aten._softmax(x, -1, False)", "torch.ops"),
    ("!cp /course/labkit/sampling/filters.py mine.py", "shell command"),
    ("%%writefile mine.py\ndef f(): pass", "%writefile"),
    ("get_ipython().run_cell('1')", "get_ipython"),
    ("import asyncio, subprocess\nsubprocess.run(['python'])", "subprocess"),
    ("import os\nos.system('cat /course/solutions/06_sampling.ipynb')", "os.system"),
    ("x = 1\n" * 200_000, "too long"),
    ("import asyncio\nawait asyncio.create_subprocess_exec('python3', '-c', 'print(1)')", "create_subprocess_exec"),
    ("import torch.multiprocessing as mp", "torch.multiprocessing"),
    ("from os import *\nsystem('ls')", "imports *"),
    ("%time exec(inspect.getsource(f))", "exec"),  # the code a %time runs is checked too...
    ("%timeit -n 1 -r 1 eval('1')", "eval"),
    ("listing = !cat /course/labkit/sampling/filters.py\nx = 1", "shell command"),  # ...and magics in expressions
    ("a = %sx ls", "%sx"),
    ("__builtins__.exec(open('/course/labkit/x.py').read())", "__builtins__"),  # the red teams' (issue 29)
    ("import sys\ngetattr(sys, 'path').insert(0, '.')", "sys.path"),  # getattr(x, 'y') reaches what x.y does
    ("import os\ngetattr(os, 'fork')()", "os.fork"),
    ("import operator\ncode = operator.attrgetter('__co' + 'de__')", "attrgetter"),
    ("import py_compile", "py_compile"),
    ("import site\nsite.addsitedir('.')", "site"),
    # the fourth red team's: a guard's original on the C base class, and torch's internals imported by name
    ("def f(x):\n    return super(torch.Tensor, x).softmax(-1)", "super"),
    ("f = torch.Tensor.mro()[1].softmax", "mro"),
    ("f = torch.Tensor.add.__objclass__.softmax", "__objclass__"),
    ("import torch._C as C\nC._VariableFunctions.softmax(x, -1)", "torch._C"),
    ("import torch._VF as VF", "torch._VF"),
    ("import torch._C._nn as NN", "torch._C"),
    ("import torch._ops as O\nO.ops.aten._softmax(x, -1, False)", "torch._ops"),
    ("import torch.library as L", "torch.library"),
    ("import labkit_course as lc\ngrading = vars(lc)['grad' + 'ing']", "vars"),
    ("import torch\nf = vars(torch)['soft' + 'max']", "vars"),
    ("import functools, labkit_course\nfunctools.reduce(getattr, ['grading', 'forbidden'], labkit_course)",
     "getattr"),
    ("reach = vars\nreach(obj)['x']", "vars"),
    ("import labkit_course\n_lc = labkit_course\n_lc.grading.kernels.check_triton_kernel = None", "grading"),
    ("import sys\ns = sys\ns.modules['x'] = None", "sys.modules"),
    ("import triton.runtime.interpreter\ni = triton.runtime.interpreter\ni.inspect.getcallargs = None", "inspect"),
    ("import numpy as np\na = np.asarray(type('M', (), {'__array_interface__': {}})())", "__array_interface__"),
])
def test_the_rules_name_each_way_around_the_tripwires(source, named):
    found = rules.cell_violations(source)
    assert found and any(named in line for line in found), found


def test_a_forbidden_function_kept_in_a_default_argument_or_a_closure_is_tripped_too():
    namespace = {}
    exec("import torch\n_sm = torch.softmax\ndef softmax(x, _f=_sm):\n    return _f(x, -1)\n"
         "def make():\n    keep = torch.softmax\n    def softmax(x):\n        return keep(x, -1)\n    return softmax\n"
         "closed = make()", namespace)
    for candidate in (namespace["softmax"], namespace["closed"]):
        outcome = run_exercise(get_exercise("00", "softmax"), {"softmax": candidate})
        assert not outcome.passed and "`torch.softmax`" in outcome.message
    assert namespace["softmax"].__defaults__[0] is torch.softmax, "restored afterwards"
    assert namespace["closed"].__closure__[0].cell_contents is torch.softmax


def test_a_reference_handed_in_as_the_answer_itself_is_tripped():
    from labkit_course.engine_parts import labkit_schedule_step

    outcome = run_exercise(get_exercise("00", "softmax"), {"softmax": torch.softmax})
    assert not outcome.passed and "`torch.softmax`" in outcome.message
    parts = type("CapstoneParts", (), {"schedule_step": staticmethod(labkit_schedule_step)})
    wires = Tripwires(("labkit_course.engine_parts.labkit_schedule_step",))
    with wires.armed({}, functions=(parts().schedule_step,)):
        pass
    assert wires.tripped == ["labkit_course.engine_parts.labkit_schedule_step"]
    wires = Tripwires(("torch.softmax",))
    with wires.armed({}, functions=(functools.partial(torch.softmax, dim=-1),)):
        pass
    assert wires.tripped == ["torch.softmax"]


def test_the_static_check_reads_getattr_with_a_constant_name():
    from labkit_course.grading.labs.lab00 import FORBIDDEN

    source = "def softmax(x):\n    return getattr(torch.sparse, 'softmax')(x.to_sparse(), -1).to_dense()"
    assert static_violations(source, "softmax", FORBIDDEN) == ["torch.sparse.softmax"]
    assert static_violations("def softmax(x):\n    return F.softmin(-x, -1)", "softmax", FORBIDDEN) == \
        ["torch.nn.functional.softmin"]


def test_the_static_check_reads_the_real_definition_not_a_decoy_in_a_string():
    from labkit_course.grading.remote import RemoteNamespace

    real = "def softmax(x):\n    return x.softmax(-1)"
    namespace = RemoteNamespace(None, [real, 'decoy = """\ndef softmax(x):\n    return x\n"""'])
    assert namespace.definition_source("softmax") == real


def test_imports_are_read_through_their_aliases_and_module_attributes():
    import nbformat as nbf

    assert rules.cell_violations("import torch as T\ny = T.ops.aten._softmax(x, -1, False)")
    assert rules.cell_violations("import os\nos.sys.modules['x'] = None")
    assert rules.cell_violations("import dataclasses\ndataclasses.inspect.getsource(f)")
    assert rules.cell_violations("import posix\nposix.system('id')")
    assert rules.cell_violations("from unittest import mock\n"
                                 "mock.patch('labkit_course.grading.forbidden.Tripwires.armed')")
    assert rules.cell_violations("import labkit_course.grading as G\nG.core.run_exercise") != []
    assert rules.cell_violations("y = model.modules()\nimport torch.nn.functional as F\nF.relu(x)") == []
    course_cell = nbf.v4.new_code_cell("import subprocess, sys")  # a course cell may import what a student may not
    student = nbf.v4.new_notebook(cells=[course_cell, nbf.v4.new_code_cell("def f():\n    return subprocess.run(1)")])
    found = rules.violations(student, nbf.v4.new_notebook(cells=[course_cell]))
    assert found and all(line.startswith("cell 2") for line in found)


@pytest.mark.parametrize("source", [  # what the student review found honest students write (issue 29)
    "import re\nDATA = re.compile(r'^data: (.*)$', re.MULTILINE)", "fast = torch.compile(softmax)", "model.eval()",
    "code = softmax(x)\nprint(code.sum())", "print(vars(run))", "print(globals().keys())",
    "def update(self, key, value):\n    setattr(self, key, value)", "%load_ext autoreload\n%autoreload 2", "%who",
    "softmax?", "from math import *", "import pandas", "import numpy as np\nnp.exp(1)",
    "import timeit\ntimeit.timeit('softmax(x)', globals=globals(), number=10)", "%%capture\nprint(1)",
    "%timeit -n 10 -r 3 softmax(x)", "site = 'Paris'\ntypes = [1, 2]\ngc = 3\nmock = None",
    "class Net(torch.nn.Module):\n    def __init__(self):\n        super().__init__()",
    "import torch.nn.functional as F\nimport torch.utils.data", "from torch.nn import functional",
])
def test_honest_code_breaks_no_rule(source):
    assert rules.cell_violations(source) == []


def test_an_edited_course_cell_answers_only_for_what_the_edit_adds():
    import nbformat as nbf

    course = nbf.v4.new_code_cell("import subprocess, sys\nsys.path.insert(0, '.')\nsubprocess.run(['true'])")
    handed_out = nbf.v4.new_notebook(cells=[course])
    edited = nbf.v4.new_notebook(cells=[nbf.v4.new_code_cell(course.source.replace("'.'", "'/content'") + "\n")])
    assert rules.violations(edited, handed_out) == [], "a student's path, a trailing newline: nothing added"
    edited.cells[0].source += "\nsubprocess.run(['python', '-c', 'print(1)'])"
    assert "cell 1 (`import subprocess, sys`) uses `subprocess.run`, which runs other processes" in \
        rules.violations(edited, handed_out)


def test_honest_cells_and_the_handed_out_cells_break_no_rule():
    assert rules.cell_violations("%time y = softmax(torch.randn(3))\nimport torch, math\nfrom collections import "
                                 "deque\nprint(torch.__version__)\n%matplotlib inline\nsoftmax??") == []
    assert rules.cell_violations("def f(:\n    exec('x')") == [], "a cell IPython cannot parse never runs"
    for path in sorted((COURSE_ROOT / "solutions").glob("*.ipynb")):
        lab = path.name[:2]
        assert rules.violations(nbformat.read(path, 4), rules.handed_out(lab, COURSE_ROOT)) == [], path.name
    handed_out = rules.handed_out("00", COURSE_ROOT)
    first = next(c for c in handed_out.cells if c.cell_type == "code")
    assert rules.cell_violations(first.source), "the course's own setup cell would break the rules..."
    assert rules.violations(handed_out, handed_out) == [], "...so the course's cells, as handed out, are exempt"
    changed = nbformat.from_dict(handed_out)
    next(c for c in changed.cells if c.cell_type == "code").source += "\n# changed"
    assert rules.violations(changed, handed_out) == [], "an edit that adds nothing forbidden is fine"
    next(c for c in changed.cells if c.cell_type == "code").source += "\nsys.modules.clear()"
    assert rules.violations(changed, handed_out), "what an edit adds is checked"


# --- what grades: the course and its Python, fingerprinted ---------------------------------------------

def test_a_planted_pth_file_stops_grading(monkeypatch, tmp_path):
    site_dir = tmp_path / "site-packages"
    site_dir.mkdir()
    monkeypatch.setattr(integrity.site, "getsitepackages", lambda: [str(site_dir)])
    monkeypatch.setattr(integrity.site, "ENABLE_USER_SITE", False)
    integrity.check_site_packages()
    (site_dir / "zz_student.pth").write_text("import os; os.system('touch /tmp/pwned')\n")
    with pytest.raises(integrity.CourseTampered, match="zz_student.pth is not a file an installed package"):
        integrity.check_site_packages()


def test_a_compiled_file_rewritten_to_its_old_size_and_time_fails_the_fingerprint(monkeypatch, tmp_path):
    """A trojaned .pyc with the header, size and modification time of the one it replaces (what a
    notebook graded --no-sandbox can leave for later runs) still changes the inode's change time."""
    pyc = tmp_path / "venv" / "lib" / "__pycache__" / "client.cpython-311.pyc"
    pyc.parent.mkdir(parents=True)
    pyc.write_bytes(b"A" * 64)
    monkeypatch.setattr(integrity.sys, "prefix", str(tmp_path / "venv"))
    monkeypatch.setattr(integrity.sys, "base_prefix", str(tmp_path / "venv"))
    before = integrity.fingerprint(python=True)
    stat = pyc.stat()
    time.sleep(0.01)
    pyc.write_bytes(b"B" * 64)
    os.utime(pyc, ns=(stat.st_atime_ns, stat.st_mtime_ns))
    with pytest.raises(integrity.CourseTampered, match="client.cpython-311.pyc"):
        integrity.verify(before)


def test_a_changed_environment_fails_the_fingerprint(monkeypatch, tmp_path):
    prefix = tmp_path / "venv"
    (prefix / "lib").mkdir(parents=True)
    (prefix / "lib" / "module.py").write_text("x = 1\n")
    monkeypatch.setattr(integrity.sys, "prefix", str(prefix))
    monkeypatch.setattr(integrity.sys, "base_prefix", str(prefix))
    before = integrity.fingerprint(python=True)
    integrity.verify(before)
    (prefix / "lib" / "evil.pth").write_text("import os\n")
    with pytest.raises(integrity.CourseTampered, match="evil.pth"):
        integrity.verify(before)


def test_a_kernels_folder_is_removed_even_where_it_locked_itself_out(tmp_path):
    outside = tmp_path / "outside"
    outside.mkdir()
    folder = tmp_path / "workdir"
    (folder / "locked" / "deeper").mkdir(parents=True)
    (folder / "locked" / "deeper" / "file").write_text("x")
    (folder / "link").symlink_to(outside)
    (folder / "locked" / "deeper").chmod(0)
    (folder / "locked").chmod(0)
    sandbox.remove_tree(folder)
    assert not folder.exists()
    assert outside.exists() and (outside.stat().st_mode & 0o777) == 0o755, "a link is removed, never followed"
