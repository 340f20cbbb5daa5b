"""`/metrics`: the engine's live figures in Prometheus' text format, with vLLM's names.

The seed article's advice for production: watch the KV cache usage and the number of
preemptions. A usage that sits near 1 with preemptions climbing means the pool is too
small for the load (recompute is wasted work); a usage far below 1 means memory to spare.
The names are vLLM's (vllm/v1/metrics/loggers.py) under a `nanopaged:` prefix, so a vLLM
dashboard maps across by renaming the prefix.

Everything is written on the engine thread: the counters by a step observer (the
engine's `observers` hook; the prefix-cache and preemption counts come from
engine/stats.py, their one owner), the gauges after every round of the engine loop
(engine_loop.py), request latencies from the arrival time the loop reports. The scraper
only reads (prometheus-client is thread-safe). docs/08_server.md, "Metrics".
"""
from __future__ import annotations

import time

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from nanopaged import spec_decode
from nanopaged.engine.llm_engine import LLMEngine, StepRecord
from nanopaged.engine.stats import EngineStats

PREFIX = "nanopaged:"
# Seconds; wide enough for a 2-core CPU and a GPU alike.
LATENCY_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0,
                   7.5, 10.0, 20.0, 40.0, 80.0, 160.0)
TOKEN_BUCKETS = (0.001, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0,
                 2.5, 5.0, 10.0)


class ServerMetrics:
    def __init__(self, engine: LLMEngine, stats: EngineStats) -> None:
        """Adds itself to `engine.observers`; must come after `stats` (it reads stats' counts)."""
        self.stats = stats
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
        self.seen = (0, 0, 0)                      # stats' (preemptions, queries, hits) at the last step
        self.spec = spec_decode.of(engine)         # speculative_config: vLLM's four counters
        if self.spec is not None:
            name = PREFIX + "spec_decode_num_"
            self.spec_counters = (
                Counter(name + "drafts", "Verify steps of a request with drafts.", **r),
                Counter(name + "draft_tokens", "Draft tokens verified.", **r),
                Counter(name + "accepted_tokens", "Draft tokens accepted.", **r))
            self.spec_per_pos = Counter(name + "accepted_tokens_per_pos", "Draft tokens accepted, by position.",
                                        ["position"], **r)
            self.spec_seen = self.spec.stats.copy()
        engine.observers.append(self)

    def exposition(self) -> bytes:
        return generate_latest(self.registry)

    # ---- told by the engine loop ---------------------------------------------------------------
    def arrived(self, request_id: str, arrival_time: float) -> None:
        self.arrival[request_id] = arrival_time

    def aborted(self, request_id: str) -> None:
        self.finished.labels(finished_reason="abort").inc()
        self.arrival.pop(request_id, None)
        self.first_token.pop(request_id, None)

    def sample(self, engine: LLMEngine) -> None:
        """The gauges, after every round of the loop (an abort changes them without a step)."""
        scheduler = engine.scheduler
        self.running.set(len(scheduler.running))
        self.waiting.set(len(scheduler.waiting))
        self.kv_usage.set(scheduler.block_pool.usage())

    def _count_spec(self) -> None:
        new = self.spec.stats.since(self.spec_seen)
        for counter, n in zip(self.spec_counters, (new.num_drafts, new.num_draft_tokens, new.num_accepted_tokens)):
            counter.inc(n)
        for pos, n in enumerate(new.accepted_per_pos):
            self.spec_per_pos.labels(position=str(pos)).inc(n)
        self.spec_seen = self.spec.stats.copy()

    # ---- a step observer -----------------------------------------------------------------------
    def __call__(self, step: StepRecord) -> None:
        now = time.monotonic()
        s = self.stats
        counts = (s.num_preemptions, s.prefix_cache_queries, s.prefix_cache_hits)
        for counter, new, old in zip((self.preemptions, self.prefix_queries, self.prefix_hits), counts, self.seen):
            if new > old:
                counter.inc(new - old)
        self.seen = counts
        self.generation_tokens.inc(step.num_tokens)
        if self.spec is not None:
            self._count_spec()
        for output in step.outputs:
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
