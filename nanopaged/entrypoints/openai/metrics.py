"""`/metrics`: the engine's live figures in Prometheus' text format, with vLLM's names.

The seed article's advice for production: watch the KV cache usage and the number of
preemptions. A usage that sits near 1 with preemptions climbing means the pool is too
small for the load (recompute is wasted work); a usage far below 1 means memory to spare.
The names are vLLM's (vllm/v1/metrics/loggers.py) under a `nanopaged:` prefix, so a vLLM
dashboard maps across by renaming the prefix.

Two feeds, in either process layout: the engine's figures (core_messages.Figures: the gauges
as they are, the counts as totals, from engine/stats.py, their one owner), sent by the engine
core a few times a second or taken by the in-process engine loop after every round; and the
outputs handed to this server's clients, which time their requests from the arrival the loop
reports. With several API servers, each one's latencies are its own clients'; the engine's
figures are the same on all. The scraper only reads (prometheus-client is thread-safe).
docs/08_server.md, "Metrics".
"""
from __future__ import annotations

import threading
import time

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from nanopaged.entrypoints.core_messages import Figures
from nanopaged.entrypoints.openai.dashboard import FiguresHistory

PREFIX = "nanopaged:"
# Seconds; wide enough for a 2-core CPU and a GPU alike.
LATENCY_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0,
                   7.5, 10.0, 20.0, 40.0, 80.0, 160.0)
TOKEN_BUCKETS = (0.001, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0,
                 2.5, 5.0, 10.0)


class ServerMetrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry()    # the server's own: no clash with other registries
        r = dict(registry=self.registry)
        self.running = Gauge(PREFIX + "num_requests_running", "Sequences in the running set.", **r)
        self.waiting = Gauge(PREFIX + "num_requests_waiting", "Sequences waiting to be scheduled.", **r)
        self.kv_usage = Gauge(PREFIX + "kv_cache_usage_perc",
                              "KV cache usage: 1 - free blocks / all blocks (0..1, as vLLM).", **r)
        self.preemptions = Counter(PREFIX + "num_preemptions", "Preemptions by recompute.", **r)
        self.prefix_queries = Counter(PREFIX + "prefix_cache_queries",
                                      "Prompt tokens looked up in the prefix cache.", **r)
        self.prefix_hits = Counter(PREFIX + "prefix_cache_hits", "Prompt tokens found in the prefix cache.", **r)
        self.prompt_tokens = Counter(PREFIX + "prompt_tokens", "Prompt tokens of requests that started.", **r)
        self.generation_tokens = Counter(PREFIX + "generation_tokens", "Tokens generated.", **r)
        self.finished = Counter(PREFIX + "request_success", "Requests finished, by reason.",
                                ["finished_reason"], **r)
        self.ttft = Histogram(PREFIX + "time_to_first_token_seconds",
                              "From a request's arrival to its first token.", buckets=LATENCY_BUCKETS, **r)
        self.tpot = Histogram(PREFIX + "time_per_output_token_seconds",
                              "Per request: (last token - first token) / (tokens - 1).",
                              buckets=TOKEN_BUCKETS, **r)
        self.e2e = Histogram(PREFIX + "e2e_request_latency_seconds",
                             "From a request's arrival to its last token.", buckets=LATENCY_BUCKETS, **r)
        self.arrival: dict[str, float] = {}        # request id -> monotonic arrival time
        self.first_token: dict[str, float] = {}    # request id -> monotonic time of its first token
        self.seen = Figures(0, 0, 0.0, 0, 0, 0, 0)  # the totals at the last figures
        self.per_engine: dict[str, Figures] = {}    # each engine core's last figures (data parallelism)
        self.lock = threading.Lock()                # with data parallelism each core's client thread reports
        self.carried: dict[str, Figures] = {}       # a dead core's totals, which its replacement's add to
        label = dict(labelnames=["engine"], **r)
        self.engine_running = Gauge(PREFIX + "engine_num_requests_running", "Running, per engine core.", **label)
        self.engine_waiting = Gauge(PREFIX + "engine_num_requests_waiting", "Waiting, per engine core.", **label)
        self.engine_kv_usage = Gauge(PREFIX + "engine_kv_cache_usage_perc", "KV cache usage, per engine core.",
                                     **label)
        self.engine_prefix_hits = Counter(PREFIX + "engine_prefix_cache_hits", "Prefix-cache hits, per engine core.",
                                          **label)
        self.engine_generation_tokens = Counter(PREFIX + "engine_generation_tokens", "Tokens generated, per "
                                                "engine core.", **label)
        self.extension_counters: dict = {}          # an extension's counters, each made at its first figures
        self.history = FiguresHistory()             # the totals over the last minutes, for the page (dashboard.py)

    def exposition(self) -> bytes:
        return generate_latest(self.registry)

    # ---- told by the engine loop (or the engine core's client) -----------------------------------
    def arrived(self, request_id: str, arrival_time: float) -> None:
        self.arrival[request_id] = arrival_time

    def aborted(self, request_id: str) -> None:
        self.finished.labels(finished_reason="abort").inc()
        self.arrival.pop(request_id, None)
        self.first_token.pop(request_id, None)

    def engine(self, figures: Figures, engine: str = "0") -> None:
        """One engine core's figures: its own gauges (label `engine`, as vLLM's), and the totals over every
        core (the unlabelled ones: KV usage is the mean); each counter moves by what its total grew."""
        with self.lock:
            if engine in self.carried:
                figures = plus_totals(figures, self.carried[engine])
            self.engine_running.labels(engine=engine).set(figures.running)
            self.engine_waiting.labels(engine=engine).set(figures.waiting)
            self.engine_kv_usage.labels(engine=engine).set(figures.kv_usage)
            was = self.per_engine.get(engine, Figures(0, 0, 0.0, 0, 0, 0, 0))
            self.engine_prefix_hits.labels(engine=engine).inc(max(0, figures.prefix_hits - was.prefix_hits))
            self.engine_generation_tokens.labels(engine=engine).inc(
                max(0, figures.generation_tokens - was.generation_tokens))
            self.per_engine[engine] = figures
            self.total(figures if len(self.per_engine) == 1 else summed(list(self.per_engine.values())))

    def engine_stopped(self, engine: str) -> None:
        """An engine core died: it runs and holds nothing any more (its counters keep what it did)."""
        was = self.per_engine.get(engine)
        if was is not None:
            self.carried.pop(engine, None)          # `was` has them already
            stopped = Figures(0, 0, 0.0, was.preemptions, was.prefix_queries, was.prefix_hits, was.generation_tokens,
                              was.counters)
            self.engine(stopped, engine)
            self.carried[engine] = stopped

    def engine_stats(self) -> dict:
        """Each engine core's last figures and their totals, named as get_stats() names them."""
        with self.lock:
            each = dict(self.per_engine)
        def named(f: Figures) -> dict:
            return {"num_running": f.running, "num_waiting": f.waiting, "kv_cache_usage": f.kv_usage,
                    "num_preemptions": f.preemptions, "prefix_cache_queries": f.prefix_queries,
                    "prefix_cache_hits": f.prefix_hits, "num_generated_tokens": f.generation_tokens}
        return {"engines": {name: named(f) for name, f in sorted(each.items())},
                "total": named(summed(list(each.values()))) if each else None}

    def total(self, figures: Figures) -> None:
        """The gauges as they are; each counter moves by what its total grew since the last figures."""
        self.running.set(figures.running)
        self.waiting.set(figures.waiting)
        self.kv_usage.set(figures.kv_usage)
        old = self.seen
        for counter, new, was in ((self.preemptions, figures.preemptions, old.preemptions),
                                  (self.prefix_queries, figures.prefix_queries, old.prefix_queries),
                                  (self.prefix_hits, figures.prefix_hits, old.prefix_hits),
                                  (self.generation_tokens, figures.generation_tokens, old.generation_tokens)):
            if new > was:
                counter.inc(new - was)
        for name, (help_text, total) in figures.counters.items():
            self._count(name, help_text, total, old.counters.get(name, (None, None))[1])
        self.seen = figures
        self.history.add(figures)

    def _count(self, name: str, help_text: str, total, was) -> None:
        """An extension's counter (speculative decoding's are vLLM's four): moved by what its total grew; a
        list of totals is one counter with a `position` label."""
        counter = self.extension_counters.get(name)
        if counter is None:
            labels = ["position"] if isinstance(total, list) else []
            counter = self.extension_counters[name] = Counter(PREFIX + name, help_text, labels, registry=self.registry)
        if not isinstance(total, list):
            counter.inc(max(0, total - (was or 0)))
            return
        was = was or []
        for pos, new in enumerate(total):
            counter.labels(position=str(pos)).inc(max(0, new - (was[pos] if pos < len(was) else 0)))

    def outputs(self, outputs: list) -> None:
        """The latencies of this server's requests, from the outputs handed to their clients."""
        now = time.monotonic()
        for output in outputs:
            rid = output.request_id
            if rid not in self.arrival:            # not a server request
                continue
            if rid not in self.first_token:
                self.first_token[rid] = now
                self.ttft.observe(now - self.arrival[rid])
                self.prompt_tokens.inc(len(output.prompt_token_ids))
            if output.finished:
                self._finish(rid, output, now)

    def _finish(self, rid: str, output, now: float) -> None:
        arrival, first = self.arrival.pop(rid), self.first_token.pop(rid)
        self.e2e.observe(now - arrival)
        tokens = max(len(c.token_ids) for c in output.outputs)
        if tokens > 1:
            self.tpot.observe((now - first) / (tokens - 1))
        self.finished.labels(finished_reason=output.outputs[0].finish_reason).inc()


def summed(each: list[Figures]) -> Figures:
    """Every engine core's figures as one: counts and totals added, KV usage averaged (the cores' pools are
    the same size), extensions' counters added name by name."""
    counters: dict = {}
    for f in each:
        for name, (help_text, total) in f.counters.items():
            was = counters.get(name, (help_text, [0] * len(total) if isinstance(total, list) else 0))[1]
            counters[name] = [help_text, [a + b for a, b in zip(was, total)] if isinstance(total, list) else was + total]
    return Figures(sum(f.running for f in each), sum(f.waiting for f in each), sum(f.kv_usage for f in each) / len(each),
                   sum(f.preemptions for f in each), sum(f.prefix_queries for f in each),
                   sum(f.prefix_hits for f in each), sum(f.generation_tokens for f in each), counters)


def plus_totals(figures: Figures, carried: Figures) -> Figures:
    """A core's figures with a dead predecessor's totals added to its own (its gauges are its own)."""
    both = summed([figures, carried])
    return Figures(figures.running, figures.waiting, figures.kv_usage, both.preemptions, both.prefix_queries,
                   both.prefix_hits, both.generation_tokens, both.counters)
