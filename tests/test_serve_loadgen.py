"""The load generator: its arrival process and statistics, and a short run against a tiny server
in each batching mode, timed from the client's side."""

import math

import numpy as np
import pytest
from serve_support import MODEL_NAME, assert_engine_idle, tiny_llm

from labkit.serve.app import create_app
from labkit.serve.loadgen import RequestResult, Workload, percentiles, poisson_arrivals, report, run_load
from labkit.serve.server import ServerThread


def test_poisson_arrivals_have_exponential_gaps_with_mean_one_over_the_rate():
    times = poisson_arrivals(5.0, 50_000, seed=3)
    gaps = np.diff(np.concatenate([[0.0], times]))
    assert (gaps > 0).all() and len(times) == 50_000
    assert math.isclose(gaps.mean(), 0.2, rel_tol=0.02) and math.isclose(gaps.std(), 0.2, rel_tol=0.03)
    assert math.isclose((gaps > 0.2).mean(), math.exp(-1), abs_tol=0.01)  # memoryless: P(gap > mean) = 1/e
    # Arrivals in any one second are Poisson-distributed: variance equals mean.
    counts = np.bincount(times.astype(int))[:-1]
    assert math.isclose(counts.mean(), 5.0, rel_tol=0.03) and math.isclose(counts.var(), 5.0, rel_tol=0.1)
    np.testing.assert_array_equal(times, poisson_arrivals(5.0, 50_000, seed=3))
    with pytest.raises(ValueError, match="rate must be > 0"):
        poisson_arrivals(0, 3)


def test_a_workload_is_the_same_requests_at_every_rate_only_faster():
    w = Workload(20, (4, 9), (2, 5), seed=4)
    requests = w.requests()
    assert requests == w.requests() and requests != Workload(20, (4, 9), (2, 5), seed=5).requests()
    assert all(4 <= len(p) <= 9 and 2 <= m <= 5 for p, m in requests)
    assert {len(p) for p, _ in requests} == set(range(4, 10))  # the whole inclusive range is drawn
    np.testing.assert_allclose(w.arrivals(2.0) * 2, w.arrivals(1.0))


def test_percentiles_and_per_request_latencies():
    assert percentiles([4.0, 1.0, 3.0, 2.0]) == {50: 2.5, 90: pytest.approx(3.7), 99: pytest.approx(3.97)}
    assert all(math.isnan(v) for v in percentiles([None]).values())
    r = RequestResult(sent=1.0, first_token=1.5, finished=2.5, num_output_tokens=5)
    assert (r.ttft, r.tpot) == (0.5, 0.25)
    assert RequestResult(0.0, 0.1, 0.1, 1).tpot is None
    rep = report([r, RequestResult(2.0, None, None, 0, "HTTP 503")], rate=1.0)
    assert rep.num_errors == 1 and rep.duration == 1.5 and rep.throughput == 5 / 1.5


@pytest.mark.parametrize("batching", ["continuous", "static"])
def test_a_short_load_run_against_a_tiny_server(batching):
    llm = tiny_llm(max_num_seqs=4)
    workload = Workload(12, (4, 24), (2, 12), seed=1)
    with ServerThread(create_app(llm, MODEL_NAME, batching=batching)) as server:
        rep = run_load(server.url, workload, rate=20.0, batching=batching)
    assert (rep.batching, rep.rate, rep.num_requests, rep.num_errors) == (batching, 20.0, 12, 0)
    assert llm.metrics.num_generated_tokens == sum(m for _, m in workload.requests())  # ignore_eos: all of them
    assert 0 < rep.ttft[50] <= rep.ttft[90] <= rep.ttft[99] < rep.duration
    assert 0 < rep.tpot[50] <= rep.tpot[99] and rep.throughput > 0
    assert rep.HEADER.split()[:3] == ["batching", "rate", "TTFT"] and rep.row().split()[:2] == [batching, "20.00"]
    assert_engine_idle(llm)
