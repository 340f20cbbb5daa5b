"""CPU threads that follow the cores the machine has free (`LLM(..., cpu_threads="auto")`).

On CPU, torch splits each op across its threads and waits for the last one. When another
process keeps one core busy, the thread that shares that core gets a fraction of it, and
every one of the hundreds of ops in a step waits for it: beside a busy core one thread runs
faster than two, on a quiet machine two run faster than one (docs/benchmarks.md, "Noise", has the
figures), so no fixed count is right for both.

The governor is an extension that observes each step (engine/extension.py: Extension.observe). About twice a second it
reads how busy the machine's cores were, minus this process's own share (Linux: /proc/stat
and /proc/self/stat), and sets torch's thread count to the cores left free, rounded to the
nearest whole core (at least 1, at most the count it started with). A neighbour that comes
and goes is followed within a second. Where /proc is missing it does nothing. torch's
thread count is one per process: `LLM` gives the starting count back after each call (`restore`).
"""
from __future__ import annotations

import os
import time
from pathlib import Path

import torch

from nanopaged.engine.extension import Extension

CHECK_EVERY_S = 0.5
START_WINDOW_S = 0.05      # 5 clock ticks at Linux's usual 100 Hz: enough to see a busy core


def read_cpu_times() -> tuple[float, int, int] | None:
    """(monotonic seconds, busy ticks of the whole machine, busy ticks of this process), or None."""
    try:
        fields = [int(x) for x in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:9]]
        mine = Path("/proc/self/stat").read_text().rsplit(")", 1)[1].split()
    except (OSError, ValueError, IndexError):
        return None
    idle = fields[3] + fields[4]                       # idle + iowait
    return time.monotonic(), sum(fields) - idle, int(mine[11]) + int(mine[12])   # utime + stime


def threads_for(num_cores: int, other_busy_cores: float, max_threads: int) -> int:
    """The cores other processes leave free, rounded to the nearest whole one, in [1, max_threads]."""
    return max(1, min(max_threads, int(num_cores - other_busy_cores + 0.5)))


class ThreadGovernor(Extension):
    def __init__(self, read=read_cpu_times, num_cores: int | None = None,
                 set_threads=torch.set_num_threads, clock=time.monotonic) -> None:
        self.read, self.set_threads, self.clock = read, set_threads, clock   # fakes in the tests
        self.num_cores = num_cores or os.cpu_count()    # /proc/stat's first line sums every core
        self.max_threads = self.threads = self.want = torch.get_num_threads()
        self.tick = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100
        self.last = read()

    def start(self) -> None:
        """Before a call: fit the thread count at once, so its first step (often a long
        prefill) does not run on threads that wait for a busy core. The window is the time
        since the last reading (the model's loading, for a new LLM; the gap since the last
        call); if that is under START_WINDOW_S, the last decision holds. Never waits."""
        now = self.read() if self.last is not None else None
        if now is None:
            return
        if now[0] - self.last[0] >= START_WINDOW_S:
            self.check(min_interval=START_WINDOW_S)
        else:
            self._apply(self.want)

    def observe(self, _step=None) -> None:
        """After a step (an extension that observes): check at most every CHECK_EVERY_S."""
        self.check(min_interval=CHECK_EVERY_S)

    def check(self, min_interval: float) -> None:
        """Fit the thread count to the cores left free since the last reading."""
        if self.last is None or self.clock() - self.last[0] < min_interval:
            return                  # checked after every step: no /proc read until it is due
        now = self.read()
        if now is None:
            return
        wall = now[0] - self.last[0]
        other = ((now[1] - self.last[1]) - (now[2] - self.last[2])) / self.tick / wall
        self.last = now
        self.want = threads_for(self.num_cores, other, self.max_threads)
        self._apply(self.want)

    def restore(self) -> None:
        """After a call: give torch back the thread count the governor started with."""
        self._apply(self.max_threads)

    def _apply(self, threads: int) -> None:
        if threads != self.threads:
            self.set_threads(threads)
            self.threads = threads
