"""A class graded on a Dask cluster: each notebook one task, graded on a worker as it would be here.

Dask distributed schedules the tasks: on a `LocalCluster` of N worker processes on this machine
(`--dask local:N`, over TLS with credentials made for it), or on the scheduler at a TLS address
(`--dask tls://host:8786`, certificates from Dask's configuration), whose workers run wherever they
were started (by hand with `dask worker`, by dask-jobqueue's SLURMCluster, by the
Dask Kubernetes operator: README). A task carries the notebook's bytes (workers need not share a
filesystem with this machine), the limits, the containment and the course's fingerprint. A worker
refuses a task whose fingerprint is not its own course's (another commit, a changed file), then
grades the notebook with `labkit_course.grading.workers` (a process of its own under the hard limit, the
kernel contained as here) and returns the outcomes. Only this machine writes the report, from what
the tasks return, in the same order as with `--jobs`.
"""

import multiprocessing
import shutil
import tempfile
from collections.abc import Callable
from pathlib import Path

from labkit_course.grading import integrity, sandbox, workers
from labkit_course.grading.workers import Graded, Job


def grade_on_dask(jobs: list[Job], address: str, limits: sandbox.Limits, how: str,
                  on_done: Callable[[Job, Graded], None] = lambda job, graded: None) -> list[Graded]:
    """Grade every job as a task of the Dask cluster at `address` ("local:N" starts one here)."""
    import dask
    from distributed import Client, LocalCluster, as_completed

    if not address.startswith(("local:", "tls://")):
        raise ValueError(f"refusing the Dask scheduler {address}: anyone who can connect to a scheduler without "
                         "TLS can run code on every worker (as the grader, root perhaps); use tls:// with "
                         "certificates (README, \"More than one machine\"), or local:N here")
    digest = integrity.digest(integrity.fingerprint())
    cluster, scratch = None, None
    if address.startswith("local:"):
        scratch = tempfile.mkdtemp(prefix="labkit-dask-")  # the workers' own files, gone with the run
        # A worker forks a process per notebook, so it may not be a daemon; its files go to the scratch folder.
        with dask.config.set({"distributed.worker.daemon": False, "temporary-directory": scratch}):
            cluster = LocalCluster(n_workers=int(address.removeprefix("local:")), threads_per_worker=1,
                                   processes=True, dashboard_address=None, local_directory=scratch,
                                   security=True)  # TLS with fresh credentials: no other user can connect
    client = Client(cluster or address)
    try:
        futures = {client.submit(grade_remotely, job.student, job.lab, job.path.name, job.path.read_bytes(),
                                 limits, how, digest, pure=False): index for index, job in enumerate(jobs)}
        results: list[Graded | None] = [None] * len(jobs)
        for future in as_completed(futures):
            index = futures[future]
            results[index] = future.result()  # a refused worker's error stops the run here
            on_done(jobs[index], results[index])
        return results
    finally:
        client.close()
        if cluster is not None:
            cluster.close()
            shutil.rmtree(scratch, ignore_errors=True)


def grade_remotely(student: str, lab: str, name: str, notebook: bytes, limits: sandbox.Limits, how: str,
                   digest: str) -> Graded:
    """A Dask task: grade one notebook on this worker, if its course is the grader's."""
    mine = integrity.digest(integrity.fingerprint())
    if mine != digest:
        raise integrity.CourseTampered(f"this worker's course ({integrity.course_commit()}, fingerprint "
                                       f"{mine[:12]}) is not the grader's (fingerprint {digest[:12]}): give every "
                                       "worker the course at the same commit, unchanged")
    if multiprocessing.current_process().daemon:
        raise RuntimeError("this Dask worker is a daemonic process, which cannot start a process per notebook: "
                           "start workers with DASK_DISTRIBUTED__WORKER__DAEMON=False")
    if how == "bwrap":
        sandbox.mode()  # SandboxUnavailable, if this worker cannot contain a kernel as the grader's machine does
    with tempfile.TemporaryDirectory(prefix="labkit-task-") as folder:
        path = Path(folder) / name
        path.write_bytes(notebook)
        return workers.grade_all([Job(student, lab, path)], 1, limits, how)[0]
