"""One notebook graded from outside: its cells run in a contained kernel, the graders run here.

The notebook is copied into a fresh folder of the grader's and run cell by cell in a kernel started
through `labkit_course.grading.sandbox` (time limits per cell and per notebook, memory and file limits).
Nothing the kernel prints is kept: the graders never read outputs, so only which cells raised is
recorded, and every Jupyter message is size-limited where it arrives. A cell that raises only costs
what depends on it. A cell that runs out of time or kills the kernel stops the run there: if the
kernel survives an interrupt, what was defined before it is graded as is; if not, a fresh kernel
replays the cells before it. Then the lab's graders run in this (trusted) process against a
`RemoteNamespace` of that kernel, and finally everything the kernel started is killed.
"""

import os
import re
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

import nbformat
import zmq
import zmq.asyncio
from jupyter_client import AsyncKernelManager, BlockingKernelClient
from jupyter_client.kernelspec import KernelSpec
from jupyter_core.utils import run_sync
from nbclient import NotebookClient
from nbclient.exceptions import CellTimeoutError, DeadKernelError

from labkit_course.grading import sandbox
from labkit_course.grading.core import Outcome, exercises, run_exercise
from labkit_course.grading.remote import KernelLink, KernelLost, RemoteNamespace, kernel_alive


class NotANotebook(ValueError):
    """The file handed in cannot be read as a Jupyter notebook."""


@dataclass
class NotebookRun:
    """What happened to a notebook's cells, for the report."""

    outcomes: list[Outcome] = field(default_factory=list)
    failed_cells: dict[int, tuple[str, str]] = field(default_factory=dict)  # cell number -> (source, error)
    stopped: tuple[int, str] | None = None  # the cell that ran out of time or killed the kernel, and why
    notes: list[str] = field(default_factory=list)

    def explained_outcomes(self) -> list[Outcome]:
        """The outcomes, where a name was missing saying why: its cell raised, or the run stopped first."""
        return [self._explain_missing(o) if o.missing else o for o in self.outcomes]

    def _explain_missing(self, outcome: Outcome) -> Outcome:
        name = re.escape(outcome.missing)
        defines = re.compile(rf"^[ \t]*(def|class)[ \t]+{name}\b|^[ \t]*{name}[ \t]*=", re.MULTILINE)
        for index, (source, ename) in self.failed_cells.items():
            if defines.search(source):
                why = ("its cell is not filled in yet" if ename == "NotImplementedError"
                       else f"its cell (cell {index}) raised {ename}")
                return Outcome(outcome.lab, outcome.name, 0, outcome.max_points,
                               f"`{outcome.missing}` is not defined: {why}")
        if self.stopped is not None:
            return Outcome(outcome.lab, outcome.name, 0, outcome.max_points,
                           f"`{outcome.missing}` is not defined: cell {self.stopped[0]} {self.stopped[1]}, "
                           "so it and the cells after it did not run")
        return outcome


def _capped_context(kind, message_bytes: int):
    """A zmq context whose sockets drop any peer that sends a message over `message_bytes`."""
    context = kind()
    context.setsockopt(zmq.MAXMSGSIZE, message_bytes)
    return context


class _ContainedKernelManager(AsyncKernelManager):
    """A kernel manager whose kernel command runs behind `labkit_course.grading.sandbox`."""

    wrap = None  # callable: the kernel's argv -> the contained command line
    uid: int | None = None
    message_bytes = 0

    def format_kernel_cmd(self, extra_arguments=None):
        if self.uid is not None:  # written 0600 by the trusted side; the kernel's uid must read it
            os.chown(self.connection_file, self.uid, self.uid)
        return self.wrap(super().format_kernel_cmd(extra_arguments))

    def client(self, **kwargs):
        return super().client(context=_capped_context(zmq.asyncio.Context, self.message_bytes), **kwargs)


class _CellClient(NotebookClient):
    """Runs the cells and keeps none of their outputs, only which cells raised (error names cut short):
    display updates, clears and widget messages are ignored, so nothing a kernel sends piles up here."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.errors: dict[int, str] = {}

    def output(self, outs, msg, display_id, cell_index):
        if msg.get("msg_type") == "error":
            name = msg.get("content", {}).get("ename")
            self.errors[cell_index] = name[:80] if isinstance(name, str) else "an error"
        return None

    def _update_display_id(self, display_id, msg):
        return None

    def clear_output(self, outs, msg, cell_index):
        return None

    def handle_comm_msg(self, outs, msg, cell_index):
        return None


def _kernel_spec() -> KernelSpec:
    """The kernel's command: -P keeps its working folder off sys.path, so that a module the notebook
    writes there (a `tabnanny.py`) never shadows one it imports."""
    return KernelSpec(argv=[sys.executable, "-P", "-m", "ipykernel_launcher", "-f", "{connection_file}"],
                      display_name="student", language="python", interrupt_mode="message")


class ContainedKernel:
    """A kernel for one notebook, in one workdir, and its certain end."""

    def __init__(self, workdir: sandbox.Workdir, limits: sandbox.Limits, how: str, uid: int | None):
        self.workdir, self.limits, self.how, self.uid = workdir, limits, how, uid
        self.leaders: list[subprocess.Popen] = []  # every process we launched (a replay starts a second kernel)

    def client(self, nb: nbformat.NotebookNode) -> _CellClient:
        # each kernel its own connection file and sockets: a replaced kernel's manager removes its files when
        # it is cleaned up, which could be after its replacement made the same ones
        n = len(self.leaders)
        km = _ContainedKernelManager(transport="ipc", ip=str(self.workdir.channel / f"ipc{n}"),
                                     connection_file=str(self.workdir.channel / f"kernel{n}.json"))
        km._kernel_spec = _kernel_spec()
        km.wrap = lambda argv: sandbox.wrap_command(argv, self.workdir, self.limits, self.uid, self.how)
        km.uid, km.message_bytes = self.uid, self.limits.message_bytes
        return _CellClient(nb, km=km, timeout=self.limits.cell_s, allow_errors=True, record_timing=False,
                           store_widget_state=False, resources={"metadata": {"path": str(self.workdir.home)}})

    def start(self, client: _CellClient) -> None:
        self.workdir.unlock_channel(self.uid)
        errors = _Tail()  # what the kernel writes to stderr, its last lines kept to say why it failed to start
        client.start_new_kernel(env=sandbox.kernel_env(self.workdir), stdout=subprocess.DEVNULL, stderr=errors.fd)
        errors.listen()
        self.leaders.append(client.km.provisioner.process)
        try:
            client.start_new_kernel_client()  # waits for the kernel's first reply: its sockets exist
        except RuntimeError as error:
            raise RuntimeError(f"{error} ({errors.text() or 'it wrote nothing'})") from None
        self.workdir.lock_channel(self.uid)


    def kill(self) -> list[int]:
        survivors = []
        for process in self.leaders:  # one already reaped may have handed its pid on to a stranger
            survivors += sandbox.kill_tree(process.pid if process.poll() is None else None, self.uid)
        return survivors


class _Tail(threading.Thread):
    """A pipe for a process's stderr whose last few lines are kept (nothing else is)."""

    def __init__(self, keep: int = 1024):
        super().__init__(daemon=True)
        self._read, self.fd = os.pipe()
        self.kept, self.keep = b"", keep

    def listen(self) -> None:
        os.close(self.fd)  # the kernel holds the write end now
        self.start()

    def run(self) -> None:
        with os.fdopen(self._read, "rb", buffering=0) as pipe:
            while chunk := pipe.read(65536):
                self.kept = (self.kept + chunk)[-self.keep:]

    def text(self) -> str:
        self.join(timeout=2)
        return " | ".join(self.kept.decode(errors="replace").strip().splitlines()[-3:])


class _ChannelWatch(threading.Thread):
    """Stops a kernel that fills its channel folder (a kernel of the instructor's own uid can write
    there; as root the folder is locked instead)."""

    def __init__(self, kernel: ContainedKernel):
        super().__init__(daemon=True)
        self.kernel, self.reason, self.done = kernel, None, threading.Event()

    def run(self):
        while not self.done.wait(1.0):
            self.reason = self.kernel.workdir.channel_overflow(self.kernel.limits.channel_bytes)
            if self.reason:
                self.kernel.kill()
                return


def run_cells(kernel: ContainedKernel, client: _CellClient, nb, run: NotebookRun, deadline: float,
              skip: frozenset[int] = frozenset()) -> None:
    """Execute the code cells in order (but those in `skip`) until one runs out of time or kills the kernel."""
    for index, cell in enumerate(nb.cells):
        if cell.cell_type != "code" or index in skip:
            continue
        left = deadline - time.monotonic()
        if left < 1:
            run.stopped = (index + 1, f"was not reached (the notebook's limit of {kernel.limits.notebook_s:.0f} s)")
            return
        client.timeout = max(1, int(min(kernel.limits.cell_s, left)))
        try:
            client.execute_cell(cell, index)
        except CellTimeoutError:
            limit = "the notebook's" if left < kernel.limits.cell_s else "the cell"
            run.stopped = (index + 1, f"ran out of time ({limit} limit of {client.timeout} s)")
            return
        except DeadKernelError:
            run.stopped = (index + 1, "stopped the kernel (it ran out of memory or exited)")
            return
        if index in client.errors:
            run.failed_cells[index + 1] = (cell.source, client.errors.pop(index))


def read_notebook(path: Path) -> nbformat.NotebookNode:
    """The notebook at `path`, or NotANotebook saying why it cannot be read as one."""
    try:
        nb = nbformat.read(path, as_version=4)
        nbformat.validate(nb)
    except Exception as error:  # noqa: BLE001 - nbformat raises many kinds for a broken file
        first = (str(error).strip().splitlines() or [type(error).__name__])[0][:200]
        raise NotANotebook(f"the file is not a readable notebook ({first})") from None
    return nb


def grade_contained(nb: nbformat.NotebookNode, lab: str, limits: sandbox.Limits, how: str,
                    skip: frozenset[int] = frozenset(), scratch: Path | None = None) -> NotebookRun:
    """Run and grade one notebook (read by `read_notebook`) in a kernel contained `how` ("bwrap" or
    "none"), without running the cells whose indexes are in `skip`; its workdir goes in `scratch`."""
    run = NotebookRun()
    uid = sandbox.UIDS.take() if how == "bwrap" and sandbox.is_root() else None
    workdir = sandbox.Workdir.create(uid, scratch)
    kernel = ContainedKernel(workdir, limits, how, uid)
    watch = _ChannelWatch(kernel)
    try:
        watch.start()
        run.outcomes = _run_and_grade(kernel, nb, lab, run, skip)
        if watch.reason:
            run.outcomes = [Outcome(lab, o.name, 0, o.max_points, f"not graded: {watch.reason}")
                            for o in run.outcomes]
    finally:
        watch.done.set()
        try:
            survivors = kernel.kill()
            if survivors:
                run.notes.append(f"processes {survivors} survived grading")
        finally:
            if uid is not None:
                sandbox.UIDS.give_back(uid)
            workdir.remove()
    return run


def _run_and_grade(kernel: ContainedKernel, nb, lab: str, run: NotebookRun, skip: frozenset[int]) -> list[Outcome]:
    client = kernel.client(nb)
    kernel.start(client)
    _install_guards(client, lab, kernel.limits)
    deadline = time.monotonic() + kernel.limits.notebook_s  # starting kernels has its own share of the hard limit
    run_cells(kernel, client, nb, run, deadline, skip)
    if run.stopped is not None and not _kernel_answers(client, kernel.limits):
        _stop(client)
        kernel.kill()  # the stuck kernel goes before its replacement starts
        replay = nbformat.v4.new_notebook(cells=[c for c in nb.cells[:run.stopped[0] - 1]])
        client = kernel.client(replay)
        kernel.start(client)
        _install_guards(client, lab, kernel.limits)
        stopped, run.stopped = run.stopped, None
        run_cells(kernel, client, replay, run, deadline, skip)
        if run.stopped is not None:  # what ran in time before did not this time: grade nothing
            return [Outcome(lab, ex.name, 0, ex.points, f"not graded: cell {run.stopped[0]} {run.stopped[1]} "
                                                        "when re-run") for ex in exercises(lab)]
        run.stopped = stopped
    sources = [c.source for c in nb.cells if c.cell_type == "code"]
    _stop(client)  # the cells' client stops listening: what the student prints while graded is not kept
    link = KernelLink(client.km, _blocking_client(client, kernel.limits), kernel.workdir.channel / "grading.sock",
                      kernel.limits.call_s, kernel.uid, deadline=time.monotonic() + kernel.limits.notebook_s,
                      interrupt_grace_s=kernel.limits.interrupt_s, reply_bytes=kernel.limits.reply_bytes)
    try:
        link.install_agent()
        return [run_exercise(ex, RemoteNamespace(link, sources)) for ex in exercises(lab)]
    except KernelLost as lost:
        return [Outcome(lab, ex.name, 0, ex.points, f"not graded: {lost}") for ex in exercises(lab)]
    finally:
        link.close()
        link.kc.stop_channels()


def _install_guards(client: _CellClient, lab: str, limits: sandbox.Limits) -> None:
    """Before the notebook's first cell, the lab's forbidden functions become guards in the kernel
    (labkit_course.grading.forbidden.install_guards), so that nothing the notebook keeps is labkit's own,
    and Triton is kept as imported, for compiling and launching the student's kernels (kernels.remember_triton)."""
    paths = sorted({path for ex in exercises(lab) for path in ex.forbidden})
    kc = _blocking_client(client, limits)
    try:
        msg_id = kc.execute(f"import labkit_course.grading.forbidden as _guards\n"
                            f"_guards.install_guards({paths!r})\ndel _guards\n"
                            "import labkit_course.grading.kernels as _kernels\n_kernels.remember_triton()\n"
                            "del _kernels", silent=True, store_history=False)
        reply = kc.get_shell_msg(timeout=limits.cell_s)
        while reply["parent_header"].get("msg_id") != msg_id:
            reply = kc.get_shell_msg(timeout=limits.cell_s)
    finally:
        kc.stop_channels()
    if reply["content"]["status"] != "ok":
        raise RuntimeError(f"the grader's guards could not be installed: {reply['content'].get('evalue', '')}")


def _kernel_answers(client: _CellClient, limits: sandbox.Limits) -> bool:
    """After a timeout: interrupt the kernel; if it answers again, its definitions are still there."""
    if not kernel_alive(client.km):
        return False
    kc = _blocking_client(client, limits)
    try:
        run_sync(client.km.interrupt_kernel)()
        msg_id = kc.execute("None", silent=True, store_history=False)
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            reply = kc.get_shell_msg(timeout=max(0.1, deadline - time.monotonic()))
            if reply["parent_header"].get("msg_id") == msg_id:
                return True
    except Exception:  # noqa: BLE001 - no answer (queue.Empty, a dead kernel): start afresh
        return False
    finally:
        kc.stop_channels()
    return False


def _blocking_client(client: _CellClient, limits: sandbox.Limits) -> BlockingKernelClient:
    kc = BlockingKernelClient(context=_capped_context(zmq.Context, limits.message_bytes))
    kc.load_connection_info(client.km.get_connection_info())
    kc.start_channels(iopub=False, stdin=False, hb=False)
    return kc


def _stop(client: _CellClient) -> None:
    try:
        client.kc.stop_channels()
    except Exception:  # noqa: BLE001, S110 - the kernel is killed by the caller anyway
        pass
