"""Each notebook is graded in a process of its own, which can be stopped at a hard wall-clock limit.

The process that grades a class never runs a grader itself: it forks one worker per notebook from a
server that loaded the graders once (multiprocessing's forkserver, so every worker starts from the
same state), at most `parallel` at a time. A worker runs the notebook's kernel and its graders
(`labkit_course.grading.session`) and sends back the outcomes as JSON, of which at most a few MiB are read.
A worker still running at the notebook's hard limit is killed with everything it started, and its
notebook gets a row that says so; the run goes on. Workers and the grading process are subreapers:
a process that a kernel detached (a double fork, a new session) comes back to one of them and is
killed with the rest, before any report is written.
"""

import json
import multiprocessing
import multiprocessing.forkserver
import os
import tempfile
import time
from collections import deque
from collections.abc import Callable
from dataclasses import asdict, dataclass
from multiprocessing.connection import wait
from pathlib import Path

from labkit_course.grading import plan, rules, sandbox
from labkit_course.grading.core import Outcome, exercises, keep_inputs_secret
from labkit_course.grading.session import NotANotebook, grade_contained, read_notebook

RESULT_BYTES = 16 * 2**20


@dataclass(frozen=True)
class Job:
    """One notebook to grade: whose, for which lab, where."""

    student: str
    lab: str
    path: Path


@dataclass
class Graded:
    """What grading one notebook gave: the outcomes, a note for the report, the seconds it took."""

    outcomes: list[Outcome]
    note: str
    seconds: float


def grade_one(job: Job, limits: sandbox.Limits, how: str, scratch: Path | None = None) -> Graded:
    """Check one notebook against the course's rules, then run and grade it here (a worker process);
    a broken file, a broken rule or a failed run is one row."""
    started = time.monotonic()
    try:
        nb = read_notebook(job.path)  # read once: what is checked is what runs
        handed_out = rules.handed_out(job.lab, sandbox.COURSE_ROOT)
        broken = rules.violations(nb, handed_out)
        if broken:
            reason = (f"not graded: {'; '.join(broken[:3])}{' (and more)' if len(broken) > 3 else ''}. The "
                      "course's rules forbid this in a graded notebook, so no exercise of this lab is graded: "
                      "remove or rewrite those lines and hand the notebook in again (README, \"No answers one "
                      "import away\")")
            return Graded(_zero(job.lab, reason), reason, time.monotonic() - started)
        skip = plan.skipped_cells(nb, handed_out, plan.graded_names(job.lab))
        run = grade_contained(nb, job.lab, limits, how, frozenset(skip), scratch)
    except Exception as error:  # noqa: BLE001 - one broken file is one row, never the whole run
        first = (str(error).strip().splitlines() or [""])[0][:200]
        reason = f"not graded: {error}" if isinstance(error, NotANotebook) else \
            f"not graded: grading failed with {type(error).__name__}: {first}"
        return Graded(_zero(job.lab, reason), reason, time.monotonic() - started)
    notes = [f"cell {run.stopped[0]} {run.stopped[1]}; the cells after it were not run"] if run.stopped else []
    return Graded(run.explained_outcomes(), "; ".join(notes + run.notes), time.monotonic() - started)


def grade_all(jobs: list[Job], parallel: int, limits: sandbox.Limits, how: str,
              on_done: Callable[[Job, Graded], None] = lambda job, graded: None) -> list[Graded]:
    """Grade every job in its own worker process, `parallel` at a time, in the order given."""
    sandbox.become_subreaper()
    context = multiprocessing.get_context("forkserver")
    context.set_forkserver_preload([__name__])
    multiprocessing.forkserver.ensure_running()
    helpers = sandbox.descendants(os.getpid()) - {os.getpid()}  # the forkserver and multiprocessing's own
    scratch = Path(tempfile.mkdtemp(prefix="labkit-grading-", dir=_short_temp()))  # every kernel's workdir
    scratch.chmod(0o711)
    todo, running, results = deque(enumerate(jobs)), {}, [None] * len(jobs)

    def finish(index: int, graded: Graded) -> None:
        results[index] = graded
        on_done(jobs[index], graded)

    try:
        while todo or running:
            while todo and len(running) < max(1, parallel):
                index, job = todo.popleft()
                reader, writer = context.Pipe(duplex=False)
                worker = context.Process(target=_work, args=(job, limits, how, scratch, writer), daemon=True)
                worker.start()
                writer.close()
                running[index] = (worker, reader, time.monotonic())
            deadline = min(started + limits.hard_s for _, _, started in running.values())
            wait([reader for _, reader, _ in running.values()], timeout=max(0.0, deadline - time.monotonic()))
            for index, (worker, reader, started) in list(running.items()):
                if reader.poll():
                    graded = _receive(reader, jobs[index].lab, time.monotonic() - started)
                elif time.monotonic() - started >= limits.hard_s:
                    reason = (f"not graded: grading this notebook took longer than its hard limit of "
                              f"{limits.hard_s:.0f} s and was stopped")
                    graded = Graded(_zero(jobs[index].lab, reason), reason, time.monotonic() - started)
                else:
                    continue
                del running[index]
                reader.close()
                sandbox.kill_tree(worker.pid)
                worker.join(5)
                sandbox.kill_descendants(spare=helpers)  # what the worker's processes left to us
                finish(index, graded)
    finally:
        for worker, reader, _ in running.values():
            sandbox.kill_tree(worker.pid)
            reader.close()
        sandbox.kill_descendants(spare=helpers)
        sandbox.remove_tree(scratch)  # also what a worker killed at its hard limit left there
    return results


def _short_temp() -> str:
    """The temporary folder, unless its path is too long for the kernels' Unix sockets below it (at most
    107 bytes a path): then /tmp."""
    base = tempfile.gettempdir()
    return base if len(base) <= 40 else "/tmp"


def _receive(reader, lab: str, seconds: float) -> Graded:
    """The worker's result, or a row saying it gave none."""
    try:
        data = json.loads(reader.recv_bytes(RESULT_BYTES))
        return Graded([Outcome(**o) for o in data["outcomes"]], data["note"], data["seconds"])
    except (EOFError, OSError, ValueError, KeyError, TypeError):
        reason = "not graded: the process grading this notebook stopped without a result"
        return Graded(_zero(lab, reason), reason, seconds)


def _work(job: Job, limits: sandbox.Limits, how: str, scratch: Path, writer) -> None:
    """A worker: grade the notebook with inputs no notebook can know in advance, send the result, and kill
    whatever its kernel left behind."""
    sandbox.become_subreaper()
    keep_inputs_secret()  # a secret of this notebook's own
    try:
        graded = grade_one(job, limits, how, scratch)
        survivors = sandbox.kill_descendants()
        if survivors:
            graded.note = "; ".join(filter(None, [graded.note, f"processes {survivors} survived grading"]))
        writer.send_bytes(json.dumps({"outcomes": [asdict(o) for o in graded.outcomes], "note": graded.note,
                                      "seconds": graded.seconds}).encode())
    finally:
        sandbox.kill_descendants()
        writer.close()


def _zero(lab: str, reason: str) -> list[Outcome]:
    return [Outcome(lab, ex.name, 0, ex.points, reason) for ex in exercises(lab)]


exercises()  # the forkserver imports this module first: every worker starts with all graders loaded
