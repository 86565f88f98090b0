"""An online load generator: requests arrive as a Poisson process, and we watch the latencies.

An offline benchmark hands the engine every request at once; a server's clients arrive one by one
at random moments. Independent arrivals at an average `rate` per second form a Poisson process:
the gaps between them are exponential with mean 1/rate. Each request streams its answer, and the
client clocks

- TTFT: from sending the request to the first token's text (queueing + prefill),
- TPOT: (last token - first token) / (output tokens - 1), the pace of decoding,

and reports percentiles (p50/p90/p99) and throughput (output tokens per second of wall time) per
rate. The workload (prompts, output lengths, the shape of the arrival pattern) comes from one
seed, so every rate and both batching modes see the same requests; only the pace changes.

    labkit loadgen --rates 0.5 1 2 --batching continuous static   # spawns a server per mode
    labkit loadgen --url http://127.0.0.1:8000 --rates 1 2          # against a running server
"""

import argparse
import asyncio
import concurrent.futures
import contextlib
import json
import os
import time
from dataclasses import asdict, dataclass

import httpx
import numpy as np

PERCENTILES = (50, 90, 99)


def poisson_arrivals(rate: float, num_requests: int, seed: int = 0) -> np.ndarray:
    """Arrival times (seconds from the start) of `num_requests` Poisson arrivals at `rate` per second."""
    if rate <= 0:
        raise ValueError(f"rate must be > 0 requests per second, got {rate}")
    return np.cumsum(np.random.default_rng(seed).exponential(1.0 / rate, num_requests))


def percentiles(values, qs=PERCENTILES) -> dict[int, float]:
    """{50: p50, 90: p90, 99: p99} by linear interpolation between order statistics (numpy's default)."""
    values = [v for v in values if v is not None]
    if not values:
        return {q: float("nan") for q in qs}
    return {q: float(v) for q, v in zip(qs, np.percentile(values, qs), strict=True)}


@dataclass(frozen=True)
class Workload:
    """The same seeded requests at any rate: prompt token ids, output lengths, arrival shape."""

    num_requests: int = 32
    prompt_len: tuple[int, int] = (16, 96)  # inclusive ranges, drawn uniformly
    output_len: tuple[int, int] = (8, 32)
    token_range: tuple[int, int] = (1000, 20000)  # prompt ids drawn from here: plain-text tokens
    seed: int = 0

    def requests(self) -> list[tuple[list[int], int]]:
        rng = np.random.default_rng(self.seed)
        out = []
        for _ in range(self.num_requests):
            n = int(rng.integers(self.prompt_len[0], self.prompt_len[1] + 1))
            prompt = rng.integers(*self.token_range, size=n).tolist()
            out.append((prompt, int(rng.integers(self.output_len[0], self.output_len[1] + 1))))
        return out

    def arrivals(self, rate: float) -> np.ndarray:
        # One draw at rate 1, scaled: every rate sees the same pattern, only faster or slower.
        return poisson_arrivals(1.0, self.num_requests, self.seed + 1) / rate


@dataclass(frozen=True)
class RequestResult:
    sent: float  # seconds from the start of the run
    first_token: float | None
    finished: float | None
    num_output_tokens: int
    error: str | None = None

    @property
    def ttft(self) -> float | None:
        return None if self.first_token is None else self.first_token - self.sent

    @property
    def tpot(self) -> float | None:
        if self.finished is None or self.first_token is None or self.num_output_tokens < 2:
            return None
        return (self.finished - self.first_token) / (self.num_output_tokens - 1)


@dataclass(frozen=True)
class LoadReport:
    batching: str
    rate: float  # offered requests per second
    num_requests: int
    num_errors: int
    duration: float  # first send to last answer, seconds
    ttft: dict[int, float]  # percentile -> seconds
    tpot: dict[int, float]
    throughput: float  # output tokens per second of wall time
    request_throughput: float  # completed requests per second

    def row(self) -> str:
        ms = lambda d, q: f"{1000 * d[q]:8.0f}"  # noqa: E731
        return (f"{self.batching:>10} {self.rate:6.2f} {ms(self.ttft, 50)} {ms(self.ttft, 90)} {ms(self.ttft, 99)} "
                f"{ms(self.tpot, 50)} {ms(self.tpot, 90)} {ms(self.tpot, 99)} {self.throughput:8.1f} "
                f"{self.request_throughput:6.2f} {self.num_errors:4d}")

    HEADER = (f"{'batching':>10} {'rate':>6} {'TTFT p50':>8} {'p90':>8} {'p99':>8} {'TPOT p50':>8} {'p90':>8} "
              f"{'p99':>8} {'tok/s':>8} {'req/s':>6} {'errs':>4}   (latencies in ms)")


def report(results: list[RequestResult], rate: float, batching: str = "") -> LoadReport:
    ok = [r for r in results if r.error is None]
    end = max((r.finished for r in ok), default=0.0)
    start = min((r.sent for r in results), default=0.0)
    duration = max(end - start, 1e-9)
    return LoadReport(batching, rate, len(results), len(results) - len(ok), duration,
                      percentiles(r.ttft for r in ok), percentiles(r.tpot for r in ok),
                      sum(r.num_output_tokens for r in ok) / duration, len(ok) / duration)


async def _one(client: httpx.AsyncClient, url: str, body: dict, start: float, at: float) -> RequestResult:
    await asyncio.sleep(max(0.0, start + at - time.perf_counter()))
    sent = time.perf_counter() - start
    first = finished = None
    tokens = 0
    try:
        async with client.stream("POST", url + "/v1/completions", json=body) as response:
            if response.status_code != 200:
                await response.aread()
                return RequestResult(sent, None, None, 0, f"HTTP {response.status_code}: {response.text[:200]}")
            async for line in response.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                now = time.perf_counter() - start
                chunk = json.loads(line[6:])
                if chunk.get("usage"):
                    tokens = chunk["usage"]["completion_tokens"]
                for choice in chunk["choices"]:
                    if first is None and (choice["text"] or choice["finish_reason"]):
                        first = now
                    if choice["finish_reason"] is not None:
                        finished = now
    except httpx.HTTPError as error:
        return RequestResult(sent, first, None, 0, f"{type(error).__name__}: {error}")
    return RequestResult(sent, first, finished, tokens, None if finished else "stream ended without finishing")


async def _run_load(url: str, workload: Workload, rate: float, model: str | None,
                    api_key: str | None) -> list[RequestResult]:
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else None
    async with httpx.AsyncClient(timeout=httpx.Timeout(600.0), limits=httpx.Limits(max_connections=None,
                                                                                  max_keepalive_connections=64),
                                 headers=headers, trust_env=False) as client:
        if model is None:
            model = (await client.get(url + "/v1/models")).json()["data"][0]["id"]
        bodies = [{"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0,
                   "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True}}
                  for prompt, max_tokens in workload.requests()]
        start = time.perf_counter()
        return list(await asyncio.gather(*(_one(client, url, body, start, float(at))
                                           for body, at in zip(bodies, workload.arrivals(rate), strict=True))))


def run_load(url: str, workload: Workload, rate: float, *, model: str | None = None,
             batching: str = "", api_key: str | None = None) -> LoadReport:
    """Send `workload` to the server at `url` at `rate` requests per second; wait for every answer.
    `api_key`: the server's --api-key (default: $LABKIT_API_KEY, which a server started here reads too)."""
    coro = _run_load(url, workload, rate, model, api_key or os.environ.get("LABKIT_API_KEY"))
    try:
        asyncio.get_running_loop()
    except RuntimeError:
        results = asyncio.run(coro)
    else:  # called from a running event loop (a notebook): run ours in a thread of its own
        with concurrent.futures.ThreadPoolExecutor(1) as pool:
            results = pool.submit(asyncio.run, coro).result()
    return report(results, rate, batching)


def sweep(workload: Workload, rates, batching_modes=("continuous", "static"), server_args=(),
          warmup: int = 2) -> list[LoadReport]:
    """Start a server per batching mode (all at once) and measure each at every rate.

    The modes take turns at each rate rather than one after the other, so a machine whose load
    drifts during the sweep (a shared CPU) tilts both modes' figures alike. On one GPU, give the
    servers a fixed "--num-kvcache-blocks" in server_args: each otherwise sizes its cache from the
    memory it finds free, and the last to start finds the others' caches.
    """
    from labkit.serve.server import ServerProcess

    with contextlib.ExitStack() as stack:
        servers = {mode: stack.enter_context(ServerProcess("--batching", mode, *server_args).start())
                   for mode in batching_modes}
        for server in servers.values():
            server.wait()
            if warmup:  # the first forward passes are slower (allocation, caches); keep them out
                run_load(server.url, Workload(warmup, workload.prompt_len, (2, 2), seed=99), 100.0)
        return [run_load(servers[mode].url, workload, rate, batching=mode) for rate in rates for mode in servers]


def main(argv=None) -> None:
    p = argparse.ArgumentParser(prog="labkit loadgen", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--url", help="a running server; without it, a server is started per --batching mode")
    p.add_argument("--rates", type=float, nargs="+", default=[0.5, 1.0, 2.0], help="requests per second")
    p.add_argument("--batching", nargs="+", default=["continuous", "static"], choices=["continuous", "static"])
    p.add_argument("--num-requests", type=int, default=32)
    p.add_argument("--prompt-len", type=int, nargs=2, default=[16, 96], metavar=("MIN", "MAX"))
    p.add_argument("--output-len", type=int, nargs=2, default=[8, 32], metavar=("MIN", "MAX"))
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", action="store_true", help="print one JSON object per rate instead of a table")
    p.add_argument("server_args", nargs=argparse.REMAINDER,
                   help="after --: arguments for the spawned `labkit serve` (e.g. -- --max-num-seqs 8)")
    args = p.parse_args(argv)
    workload = Workload(args.num_requests, tuple(args.prompt_len), tuple(args.output_len), seed=args.seed)
    server_args = [a for a in args.server_args if a != "--"]
    if args.url:
        reports = [run_load(args.url.rstrip("/"), workload, rate) for rate in args.rates]
    else:
        reports = sweep(workload, args.rates, args.batching, server_args)
    if not args.json:
        print(LoadReport.HEADER)
    for r in reports:
        print(json.dumps(asdict(r)) if args.json else r.row(), flush=True)


if __name__ == "__main__":
    main()
