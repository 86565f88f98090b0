"""Timing that a conclusion can rest on: warm-up runs first, then repeats, reported as a median and spread.

One run of a function says little: the first call allocates, compiles and fills caches, and any run
can be slowed by whatever else the machine does. `measure` discards warm-up runs, times several more
(waiting for a GPU to finish each one), and returns all of them so the caller can say how sure it is.
"""

import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class Timing:
    """Seconds of each timed run (warm-up runs excluded)."""

    seconds: tuple[float, ...]

    @property
    def median(self) -> float:
        return statistics.median(self.seconds)

    @property
    def best(self) -> float:
        return min(self.seconds)

    @property
    def spread(self) -> float:
        """(slowest - fastest) / median: how far one run can be from another."""
        return (max(self.seconds) - min(self.seconds)) / self.median

    def __str__(self) -> str:
        return f"{self.median * 1e3:.2f} ms (median of {len(self.seconds)}, spread ±{self.spread * 50:.0f}%)"


def _synchronize(device) -> None:
    if device is not None and torch.device(device).type == "cuda":
        torch.cuda.synchronize(device)


def measure(fn: Callable[[], object], repeats: int = 5, warmup: int = 1, device=None,
            clock: Callable[[], float] = time.perf_counter, setup: Callable[[], object] | None = None) -> Timing:
    """Time `fn()` `repeats` times after `warmup` untimed calls. On CUDA, pass `device` so each run
    is timed to the end of its kernels (launches return before the GPU is done). `setup()`, when
    given, runs untimed before every call of `fn` (to start each run from the same state, e.g. an
    emptied cache)."""
    if repeats < 1 or warmup < 0:
        raise ValueError(f"need repeats >= 1 and warmup >= 0, got repeats={repeats}, warmup={warmup}")
    for _ in range(warmup):
        if setup is not None:
            setup()
        fn()
    _synchronize(device)
    seconds = []
    for _ in range(repeats):
        if setup is not None:
            setup()
            _synchronize(device)
        start = clock()
        fn()
        _synchronize(device)
        seconds.append(clock() - start)
    return Timing(tuple(seconds))
