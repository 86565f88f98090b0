"""One notebook graded from outside: its cells run in a contained kernel, the graders run here.

The notebook is copied into a fresh temporary folder and run cell by cell in a kernel started by
`labkit.grading.sandbox` (time limits per cell and per notebook, an output limit, memory and file
limits). A cell that raises only costs what depends on it. A cell that runs out of time or kills
the kernel stops the run there: if the kernel survives an interrupt, what was defined before it
is graded as is; if not, a fresh kernel replays the cells before it. Then the lab's graders run in
this (trusted) process against a `RemoteNamespace` of that kernel, and finally everything the
kernel started is killed before the caller writes any report.
"""

import os
import shutil
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import nbformat
from jupyter_client import AsyncKernelManager, BlockingKernelClient
from jupyter_client.kernelspec import KernelSpec
from jupyter_core.utils import run_sync
from nbclient import NotebookClient
from nbclient.exceptions import CellTimeoutError, DeadKernelError

from labkit.grading import sandbox
from labkit.grading.core import Outcome, exercises, run_exercise
from labkit.grading.remote import KernelLink, KernelLost, RemoteNamespace, kernel_alive


class NotANotebook(ValueError):
    """The file handed in cannot be read as a Jupyter notebook."""


@dataclass
class NotebookRun:
    """What happened to a notebook's cells, for the report."""

    outcomes: list[Outcome] = field(default_factory=list)
    failed_cells: dict[int, tuple[str, str]] = field(default_factory=dict)  # cell number -> (source, error)
    stopped: tuple[int, str] | None = None  # the cell that ran out of time or killed the kernel, and why
    notes: list[str] = field(default_factory=list)


class _ContainedKernelManager(AsyncKernelManager):
    """A kernel manager whose kernel command runs behind `labkit.grading.sandbox`."""

    wrap = None  # callable: the kernel's argv -> the contained command line
    uid: int | None = None

    def format_kernel_cmd(self, extra_arguments=None):
        if self.uid is not None:  # written 0600 by the trusted side; the kernel's uid must read it
            os.chown(self.connection_file, self.uid, self.uid)
        return self.wrap(super().format_kernel_cmd(extra_arguments))


class _LimitedClient(NotebookClient):
    """Keeps at most `output_bytes` of a notebook's outputs; the rest is dropped, not buffered."""

    output_bytes = 0
    kept_bytes = 0
    truncated = False

    def output(self, outs, msg, display_id, cell_index):
        size = len(str(msg.get("content", "")))
        if self.kept_bytes + size > self.output_bytes:
            self.truncated = True
            return None
        self.kept_bytes += size
        return super().output(outs, msg, display_id, cell_index)


def _kernel_spec() -> KernelSpec:
    return KernelSpec(argv=[sys.executable, "-m", "ipykernel_launcher", "-f", "{connection_file}"],
                      display_name="student", language="python", interrupt_mode="message")


class ContainedKernel:
    """A kernel for one notebook in one temporary folder, and its certain end."""

    def __init__(self, workdir: Path, hidden: list[Path], limits: sandbox.Limits, uid: int | None):
        self.workdir, self.hidden, self.limits, self.uid = workdir, hidden, limits, uid
        self.leaders: list[int] = []  # every process we launched (a replay starts a second kernel)

    def client(self, nb: nbformat.NotebookNode) -> _LimitedClient:
        km = _ContainedKernelManager(transport="ipc", ip=str(self.workdir / "ipc"),
                                     connection_file=str(self.workdir / "kernel.json"))
        km._kernel_spec = _kernel_spec()
        km.wrap = lambda argv: sandbox.wrap_command(argv, self.workdir, self.hidden, self.limits, self.uid)
        km.uid = self.uid
        client = _LimitedClient(nb, km=km, timeout=self.limits.cell_s, allow_errors=True, record_timing=False,
                                store_widget_state=False, resources={"metadata": {"path": str(self.workdir)}})
        client.output_bytes = self.limits.output_bytes
        return client

    def start(self, client: _LimitedClient) -> None:
        client.start_new_kernel(env=sandbox.kernel_env(self.workdir))
        self.leaders.append(client.km.provisioner.pid)
        client.start_new_kernel_client()

    def kill(self) -> list[int]:
        survivors = []
        for pid in self.leaders:
            survivors += sandbox.kill_everything(pid, self.uid)
        return survivors


def run_cells(kernel: ContainedKernel, client: _LimitedClient, nb, run: NotebookRun, deadline: float) -> None:
    """Execute the code cells in order until one runs out of time or kills the kernel."""
    for index, cell in enumerate(nb.cells):
        if cell.cell_type != "code":
            continue
        left = deadline - time.monotonic()
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
        for output in cell.get("outputs", []):
            if output.get("output_type") == "error":
                run.failed_cells[index + 1] = (cell.source, output.get("ename", "an error"))


def grade_contained(path: Path, lab: str, hidden: list[Path], limits: sandbox.Limits,
                    uids: sandbox.UidPool | None) -> NotebookRun:
    """Run and grade one notebook (already checked to be a regular file within the size limit)."""
    run = NotebookRun()
    uid = uids.take() if uids is not None else None
    workdir = Path(tempfile.mkdtemp(prefix="labkit-grade-"))
    kernel = ContainedKernel(workdir, hidden, limits, uid)
    try:
        shutil.copyfile(path, workdir / path.name)
        try:  # the copy: what was checked is what runs
            nb = nbformat.read(workdir / path.name, as_version=4)
            nbformat.validate(nb)
        except Exception as error:  # noqa: BLE001 - nbformat raises many kinds for a broken file
            first = (str(error).strip().splitlines() or [type(error).__name__])[0][:200]
            raise NotANotebook(f"the file is not a readable notebook ({first})") from None
        sandbox.prepare_workdir(workdir, uid)
        run.outcomes = _run_and_grade(kernel, nb, lab, run)
    finally:
        try:
            survivors = kernel.kill()
            if survivors:
                run.notes.append(f"processes {survivors} survived grading (no OS sandbox here)")
        finally:
            if uid is not None:
                uids.give_back(uid)
            shutil.rmtree(workdir, ignore_errors=True)
    return run


def _run_and_grade(kernel: ContainedKernel, nb, lab: str, run: NotebookRun) -> list[Outcome]:
    deadline = time.monotonic() + kernel.limits.notebook_s
    client = kernel.client(nb)
    kernel.start(client)
    run_cells(kernel, client, nb, run, deadline)
    if client.truncated:
        run.notes.append(f"outputs beyond {kernel.limits.output_bytes // 2**10} KiB were dropped")
    if run.stopped is not None and not _kernel_answers(client):
        _stop(client)
        kernel.kill()  # the stuck kernel goes before its replacement starts
        replay = nbformat.v4.new_notebook(cells=[c for c in nb.cells[:run.stopped[0] - 1]])
        client = kernel.client(replay)
        kernel.start(client)
        stopped, run.stopped = run.stopped, None
        run_cells(kernel, client, replay, run, time.monotonic() + kernel.limits.notebook_s)
        if run.stopped is not None:  # what ran in time before did not this time: grade nothing
            return [Outcome(lab, ex.name, 0, ex.points, f"not graded: cell {run.stopped[0]} {run.stopped[1]} "
                                                        "when re-run") for ex in exercises(lab)]
        run.stopped = stopped
    sources = [c.source for c in nb.cells if c.cell_type == "code"]
    _stop(client)  # the cells' client stops listening: what the student prints while graded is not kept
    link = KernelLink(client.km, _blocking_client(client), kernel.workdir / "grading.sock",
                      kernel.limits.call_s, kernel.uid, deadline=time.monotonic() + kernel.limits.notebook_s)
    try:
        link.install_agent()
        return [run_exercise(ex, RemoteNamespace(link, sources)) for ex in exercises(lab)]
    except KernelLost as lost:
        return [Outcome(lab, ex.name, 0, ex.points, f"not graded: {lost}") for ex in exercises(lab)]
    finally:
        link.close()
        link.kc.stop_channels()


def _kernel_answers(client: _LimitedClient) -> bool:
    """After a timeout: interrupt the kernel; if it answers again, its definitions are still there."""
    if not kernel_alive(client.km):
        return False
    kc = _blocking_client(client)
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


def _blocking_client(client: _LimitedClient) -> BlockingKernelClient:
    kc = BlockingKernelClient()
    kc.load_connection_info(client.km.get_connection_info())
    kc.start_channels(iopub=False, stdin=False, hb=False)
    return kc


def _stop(client: _LimitedClient) -> None:
    try:
        client.kc.stop_channels()
    except Exception:  # noqa: BLE001, S110 - the kernel is killed by the caller anyway
        pass
