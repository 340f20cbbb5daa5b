"""Batches in flight: the next micro-batch scheduled and started while earlier ones still compute
(vLLM V1's batch queue, `max_concurrent_batches`; its virtual engines in V0).

A runner whose ranks form a pipeline (each holding some of the layers) computes a batch stage after stage, so
with one batch at a time each stage waits while the others compute. Here the engine keeps up to
`runner.max_concurrent_batches` batches in flight, each of other requests:

    step 1   schedule A, submit A | schedule B, submit B | collect A: sample, update, outputs
    step 2   schedule C (A's requests again), submit C   | collect B: sample, update, outputs ...

Such a runner has `max_concurrent_batches` above 1, `submit(out, inputs)`, which starts a batch and returns
a handle, and `collect(handle)`, which waits for its logits (batches collected in the order submitted). The
rules that keep every token what one batch at a time gives:
- a request whose sampled token has not come back is not scheduled again (Scheduler.schedule_unsampled);
  a request in the middle of its prompt may send its next chunk in the next batch, since every stage runs
  the batches in the order they were submitted: the chunk before it has written its K/V first;
- each batch takes at most ceil(unfinished sequences / max_concurrent_batches) of them, so the requests
  spread over the batches in flight instead of the first batch taking them all;
- the same order makes preemption and prefix hits safe: a block freed while a batch in flight still
  writes it (its request preempted or aborted) is written next by a later batch, and a block named in the
  prefix cache while a later batch in flight computes it is read only by a batch after that one.
The parallelism chapter (docs/, chapter 9) explains it under "Micro-batches".
"""
from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass, field

from nanopaged.core.block_pool import cdiv
from nanopaged.core.scheduler import SchedulerOutput
from nanopaged.engine.extension import StepRecord
from nanopaged.engine.overlap import live_rows
from nanopaged.outputs import RequestOutput


@dataclass
class Batch:
    """A batch submitted to the runner, its tokens not sampled yet."""
    scheduler_output: SchedulerOutput
    handle: object                                            # the runner's, for collect
    start: float                                              # perf_counter when it was scheduled
    phases: dict[str, float] = field(default_factory=dict)


class BatchQueue:
    """The engine's step with batches in flight: `step` returns the outputs of the oldest batch."""

    def __init__(self, engine) -> None:
        self.engine = engine
        self.in_flight: deque[Batch] = deque()
        self.max_in_flight = 0               # the most batches in flight at once, since the start
        self.num_discarded_rows = 0          # rows computed for requests that stopped or were aborted meanwhile
        engine.scheduler.schedule_unsampled = False

    def step(self, select_tokens=None) -> list[RequestOutput]:
        """Fill the queue, then finish its oldest batch. A token-selection rule (a search choosing its own
        tokens) needs each batch's tokens before the next: one batch at a time then."""
        e = self.engine
        aborted, e.output_processor.aborted = e.output_processor.aborted, []
        depth = 1 if select_tokens is not None else e.runner.max_concurrent_batches
        try:
            while len(self.in_flight) < depth and self._submit_next(depth):
                pass
        except BaseException:
            self._abort_all()
            raise
        if not self.in_flight:
            e.check_not_stalled(aborted)
            return aborted
        return aborted + self._finish_oldest(select_tokens)

    def _submit_next(self, depth: int) -> bool:
        """Schedule a batch of the requests not in flight and start it; False if none could be scheduled."""
        e, s = self.engine, self.engine.scheduler
        t0 = time.perf_counter()
        out = s.schedule(max_seqs=cdiv(len(s.running) + len(s.waiting), depth))
        if not out.scheduled:
            return False
        t1 = time.perf_counter()
        inputs = e.runner.prepare_inputs(out)
        t2 = time.perf_counter()
        handle = e.runner.submit(out, inputs)
        s.advance(out)           # its counters move on now: the next batch schedules past it
        self.in_flight.append(Batch(out, handle, t0, {"schedule": t1 - t0, "prepare": t2 - t1,
                                                      "forward": time.perf_counter() - t2}))
        self.max_in_flight = max(self.max_in_flight, len(self.in_flight))
        return True

    def _finish_oldest(self, select_tokens) -> list[RequestOutput]:
        """Collect the oldest batch's logits, sample, update and make its outputs, as the engine's step does."""
        e = self.engine
        batch = self.in_flight.popleft()
        try:
            t0 = time.perf_counter()
            output = e.runner.collect(batch.handle)
            t1 = time.perf_counter()
            kept = live_rows(output)
            self.num_discarded_rows += len(output.requests) - len(kept.requests)
            sampled = (select_tokens or e.token_selection)(kept)
            t2 = time.perf_counter()
            e.scheduler.append(batch.scheduler_output, sampled)
            t3 = time.perf_counter()
            outputs, stopped = e.output_processor.process(sampled, kept.prompt_logits)
            phases = {**batch.phases, "forward": batch.phases["forward"] + t1 - t0, "sample": t2 - t1,
                      "update": t3 - t2, "output": time.perf_counter() - t3}
            e.finish_step(StepRecord(batch.scheduler_output, sampled, outputs, stopped, e.scheduler.running,
                                     (batch.start, t0, t2, t3), phases))
        except BaseException:
            self.in_flight.appendleft(batch)
            self._abort_all()
            raise
        return outputs

    def _abort_all(self) -> None:
        """A batch failed (the runner stopped its ranks): every batch in flight ends with "abort"."""
        while self.in_flight:
            self.engine.abort_step(self.in_flight.popleft().scheduler_output)
