"""What `/metrics` shows, in Prometheus' text format (names follow vLLM's, with labkit's prefix).

Latencies are histograms: a scraper (or Lab 16) reads percentiles off their cumulative buckets.
TTFT is counted from the moment the *server* accepted the request, so time spent waiting for a
static batch to drain shows up in it. The gauges are refreshed by the engine thread after every
step; each server has its own registry, so two servers in one process do not mix their numbers.
"""

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.exposition import CONTENT_TYPE_LATEST

CONTENT_TYPE = CONTENT_TYPE_LATEST
LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.5, 0.75, 1.0, 1.5, 2.0, 3.0, 5.0,
                   7.5, 10.0, 20.0, 40.0, 80.0)


class ServerMetrics:
    def __init__(self):
        self.registry = r = CollectorRegistry()
        self.ttft = Histogram("labkit_time_to_first_token_seconds", "Time from arrival to the first token.",
                              buckets=LATENCY_BUCKETS, registry=r)
        self.tpot = Histogram("labkit_time_per_output_token_seconds", "Mean time between later tokens, per request.",
                              buckets=LATENCY_BUCKETS, registry=r)
        self.e2e = Histogram("labkit_e2e_request_latency_seconds", "Time from arrival to the last token.",
                             buckets=LATENCY_BUCKETS, registry=r)
        self.waiting = Gauge("labkit_num_requests_waiting", "Requests accepted and not running yet.", registry=r)
        self.running = Gauge("labkit_num_requests_running", "Requests in the running batch.", registry=r)
        self.swapped = Gauge("labkit_num_requests_swapped", "Requests whose KV blocks are in CPU memory.", registry=r)
        self.kv_usage = Gauge("labkit_kv_cache_usage_ratio", "Fraction of KV-cache blocks in use.", registry=r)
        self.prefix_queries = Counter("labkit_prefix_cache_queries", "Prompt tokens looked up in the prefix cache.",
                                      unit="tokens", registry=r)
        self.prefix_hits = Counter("labkit_prefix_cache_hits", "Prompt tokens found in the prefix cache.",
                                   unit="tokens", registry=r)
        self.preemptions = Counter("labkit_num_preemptions", "Sequences preempted (recompute or swap).", registry=r)
        self.prompt_tokens = Counter("labkit_prompt_tokens", "Prompt tokens of finished requests.", registry=r)
        self.generation_tokens = Counter("labkit_generation_tokens", "Tokens generated.", registry=r)
        self.requests = Counter("labkit_requests", "Requests that ended, by how.", ["finished_reason"], registry=r)
        self._seen = {"queried": 0, "hits": 0, "preemptions": 0, "generated": 0}

    def observe_engine(self, llm, num_waiting: int) -> None:
        """Refresh gauges and counters from the engine's state (the engine thread calls this)."""
        scheduler, bm, m = llm.scheduler, llm.block_manager, llm.metrics
        self.waiting.set(num_waiting)
        self.running.set(len(scheduler.running))
        self.swapped.set(len(scheduler.swapped))
        self.kv_usage.set(bm.num_used_blocks / bm.num_blocks)
        # The engine's counters only grow (unless someone resets them); the exported ones follow by deltas.
        for key, counter, value in (("queried", self.prefix_queries, bm.stats.queried_tokens),
                                    ("hits", self.prefix_hits, bm.stats.hit_tokens),
                                    ("preemptions", self.preemptions, m.num_preemptions + m.num_swaps),
                                    ("generated", self.generation_tokens, m.num_generated_tokens)):
            counter.inc(max(value - self._seen[key], 0))
            self._seen[key] = value

    def finished(self, submitted_at: float, reason: str, request) -> None:
        """A request ended with OpenAI's finish `reason`; `request` is its engine `RequestMetrics`."""
        self.requests.labels(reason).inc()
        self.prompt_tokens.inc(request.num_prompt_tokens)
        if request.first_token_time is not None:
            self.ttft.observe(request.first_token_time - submitted_at)
        if request.tpot is not None:
            self.tpot.observe(request.tpot)
        if request.finish_time is not None:
            self.e2e.observe(request.finish_time - submitted_at)

    def aborted(self) -> None:
        self.requests.labels("abort").inc()

    def render(self) -> bytes:
        return generate_latest(self.registry)
