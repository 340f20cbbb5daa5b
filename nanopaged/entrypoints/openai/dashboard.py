"""The page's dashboard feed: the engine's figures over the last minutes, kept in a bounded ring.

/metrics says how things stand now, for a scraper that keeps the history itself; a person who opens
the page (frontend.py) has no Prometheus, so the server keeps the last WINDOW_S seconds: one sample
per INTERVAL_S, fed by ServerMetrics.total in either process layout. A sample holds the interval's
latest figures and its gauges' highest (a burst shorter than the interval still shows on the chart).
`points` turns the samples into what the charts draw; `latest` is the figures as they are now.
docs/08_server.md, "The page".
"""
from __future__ import annotations

import threading
import time
from collections import deque
from dataclasses import dataclass

from nanopaged.entrypoints.core_messages import Figures

INTERVAL_S = 1.0          # one sample a second: the charts' resolution
WINDOW_S = 300.0          # five minutes: long enough to see a burst come and go


@dataclass
class Sample:
    t: float                 # when the interval's latest figures came (monotonic seconds)
    figures: Figures         # the interval's latest figures: counters are totals, so the latest say all
    most_running: int        # the gauges' highest within the interval
    most_waiting: int
    most_kv_usage: float

    @classmethod
    def of(cls, t: float, figures: Figures) -> Sample:
        return cls(t, figures, figures.running, figures.waiting, figures.kv_usage)

    def update(self, t: float, figures: Figures) -> None:
        self.t, self.figures = t, figures
        self.most_running = max(self.most_running, figures.running)
        self.most_waiting = max(self.most_waiting, figures.waiting)
        self.most_kv_usage = max(self.most_kv_usage, figures.kv_usage)


class FiguresHistory:
    """The last `window_s` seconds of engine figures, one sample per `interval_s`."""

    def __init__(self, interval_s: float = INTERVAL_S, window_s: float = WINDOW_S, clock=time.monotonic) -> None:
        if not 0 < interval_s <= window_s:
            raise ValueError(f"interval_s must be in (0, window_s={window_s}], got {interval_s}")
        self.interval_s, self.window_s, self.clock = interval_s, window_s, clock
        # Two samples at most per interval: an idle gap's carried figures, then the new ones.
        self.samples: deque[Sample] = deque(maxlen=2 * int(window_s / interval_s) + 2)
        self.lock = threading.Lock()           # written by a client thread, read by the event loop

    def add(self, figures: Figures) -> None:
        """The latest figures: a new sample when a new interval has begun, else folded into the last."""
        now = self.clock()
        with self.lock:
            last = self.samples[-1] if self.samples else None
            if last is not None and self._interval(last.t) == self._interval(now):
                last.update(now, figures)
                return
            if last is not None and self._interval(now) - self._interval(last.t) > 1:
                # Idle in between (no figures come while nothing changes): the last figures held until now.
                self.samples.append(Sample.of(now - self.interval_s, last.figures))
            self.samples.append(Sample.of(now, figures))

    def _interval(self, t: float) -> int:
        return int(t // self.interval_s)

    def points(self) -> list[dict]:
        """The window's samples, oldest first, each with its age in seconds and, from the second on, the
        rates over the interval before it; the last figures again at age 0 if they are older than that."""
        now = self.clock()
        with self.lock:
            samples = [Sample(**vars(s)) for s in self.samples if now - s.t <= self.window_s]
        if samples and now - samples[-1].t >= self.interval_s:
            samples.append(Sample.of(now, samples[-1].figures))     # nothing changed since: the state now
        points, before = [], None
        for sample in samples:
            points.append(point(now, sample, before))
            before = sample
        return points

    def latest(self) -> dict | None:
        """The latest figures as they are (the card's big number), or None before the engine's first."""
        with self.lock:
            figures = self.samples[-1].figures if self.samples else None
        return None if figures is None else {
            "num_running": figures.running, "num_waiting": figures.waiting, "kv_cache_usage": figures.kv_usage,
            "num_preemptions": figures.preemptions, "prefix_cache_queries": figures.prefix_queries,
            "prefix_cache_hits": figures.prefix_hits, "num_generated_tokens": figures.generation_tokens}


def point(now: float, sample: Sample, before: Sample | None) -> dict:
    """One chart point: the gauges' highest in the interval, the totals, and the rates since `before`
    (None for the first point)."""
    f = sample.figures
    out = {"age_s": round(now - sample.t, 3), "num_running": sample.most_running,
           "num_waiting": sample.most_waiting, "kv_cache_usage": sample.most_kv_usage,
           "num_preemptions": f.preemptions, "prefix_cache_queries": f.prefix_queries,
           "prefix_cache_hits": f.prefix_hits, "num_generated_tokens": f.generation_tokens,
           "generation_tokens_per_s": None, "prefix_cache_hit_rate": None, "preemptions": None}
    if before is not None:
        f0, seconds = before.figures, max(sample.t - before.t, 1e-9)
        queries = f.prefix_queries - f0.prefix_queries
        out["generation_tokens_per_s"] = max(0, f.generation_tokens - f0.generation_tokens) / seconds
        out["prefix_cache_hit_rate"] = (f.prefix_hits - f0.prefix_hits) / queries if queries > 0 else None
        out["preemptions"] = max(0, f.preemptions - f0.preemptions)
    return out
