"""Run a function on `world_size` fresh processes joined in one torch.distributed group.

Rendezvous goes through a file in a temporary directory (no TCP port to pick, nothing left listening),
each rank's return value comes back through a file, and the processes are always joined: when a rank
raises, the others (perhaps blocked in an all-reduce waiting for it) are terminated and the error is
re-raised here with the traceback of the rank that failed first. A hung group is killed after `timeout` seconds.
The worker must be importable (a module-level function), since ranks are spawned, not forked.
"""

import os
import tempfile
import time
import traceback
from datetime import timedelta

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch.multiprocessing.spawn import ProcessException


def _rank_main(rank: int, worker, world_size: int, backend: str, workdir: str, timeout: float, args: tuple):
    torch.set_num_threads(1)
    if backend == "nccl":
        torch.cuda.set_device(rank)
    dist.init_process_group(backend, init_method=f"file://{workdir}/rendezvous", rank=rank,
                            world_size=world_size, timeout=timedelta(seconds=timeout))
    try:
        result = worker(rank, world_size, *args)
    except BaseException:
        # Other ranks then fail too (their peer vanished); the time says which error came first.
        with open(os.path.join(workdir, f"error{rank}.txt"), "w") as f:
            f.write(f"{time.time()}\n{traceback.format_exc()}")
        raise
    finally:
        dist.destroy_process_group()
    torch.save(result, os.path.join(workdir, f"result{rank}.pt"))


def run_ranks(worker, world_size: int = 2, *args, backend: str = "gloo", timeout: float = 60.0,
              start_method: str = "spawn") -> list:
    """worker(rank, world_size, *args) on each rank; returns their results in rank order.

    "spawn" (the default) is safe with CUDA and in Jupyter; "fork" starts in a fraction of the time
    (no re-import of torch) and suits CPU-only callers that have not started threads or CUDA.
    """
    if world_size < 1:
        raise ValueError(f"world_size must be >= 1, got {world_size}")
    if backend == "nccl" and torch.cuda.device_count() < world_size:
        raise ValueError(f"nccl needs one GPU per rank: {world_size} ranks, {torch.cuda.device_count()} GPUs")
    with tempfile.TemporaryDirectory(prefix="labkit-tp-") as workdir:
        context = mp.start_processes(_rank_main, args=(worker, world_size, backend, workdir, timeout, args),
                                     nprocs=world_size, join=False, start_method=start_method)
        deadline = time.monotonic() + timeout
        try:
            while not context.join(timeout=0.1):
                if time.monotonic() > deadline:
                    raise TimeoutError(f"{world_size} ranks still running after {timeout:.0f} s")
        except ProcessException as error:
            raise RuntimeError(_first_failure(workdir, world_size) or str(error)) from error
        finally:
            for process in context.processes:
                if process.is_alive():
                    process.terminate()
                process.join()
        return [torch.load(os.path.join(workdir, f"result{rank}.pt"), weights_only=False)
                for rank in range(world_size)]


def _first_failure(workdir: str, world_size: int) -> str | None:
    """The traceback of the rank that failed first, from the files the failing ranks wrote."""
    failures = []
    for rank in range(world_size):
        path = os.path.join(workdir, f"error{rank}.txt")
        if os.path.exists(path):
            with open(path) as f:
                when, text = f.read().split("\n", 1)
            failures.append((float(when), rank, text))
    if not failures:
        return None
    _, rank, text = min(failures)
    return f"rank {rank} of {world_size} failed first:\n{text}"
