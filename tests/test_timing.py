"""labkit.timing: warm-up runs are not timed, every repeat is, and the summary says median and spread."""

import pytest

from labkit.timing import Timing, measure


def test_warmup_runs_are_excluded_and_each_repeat_is_timed():
    ticks = iter(range(100))
    calls = []
    timing = measure(lambda: calls.append(1), repeats=3, warmup=2, clock=lambda: next(ticks))
    assert len(calls) == 5
    assert timing.seconds == (1, 1, 1)


def test_median_best_and_spread():
    timing = Timing((1.0, 2.0, 4.0))
    assert (timing.median, timing.best, timing.spread) == (2.0, 1.0, 1.5)
    assert "median of 3" in str(timing)


@pytest.mark.parametrize(("repeats", "warmup"), [(0, 1), (3, -1)])
def test_bad_counts_are_refused(repeats, warmup):
    with pytest.raises(ValueError, match="repeats"):
        measure(lambda: None, repeats=repeats, warmup=warmup)


def test_setup_runs_before_every_call_and_is_not_timed():
    now, calls = [0], []

    def setup():
        calls.append("setup")
        now[0] += 100

    def fn():
        calls.append("fn")
        now[0] += 1

    timing = measure(fn, repeats=2, warmup=1, clock=lambda: now[0], setup=setup)
    assert calls == ["setup", "fn"] * 3
    assert timing.seconds == (1, 1)
