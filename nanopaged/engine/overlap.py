"""Async scheduling: the next step scheduled while this one computes, and this one's outputs made while
the next computes (the seed article's two overlaps; vLLM's engine argument `async_scheduling`).

The synchronous step (llm_engine.py: `LLMEngine.step`) does everything in one line on one thread, so
the model waits while Python schedules, prepares inputs, samples and makes outputs. Here the forward
pass runs on a thread of its own (`ModelThread`) and the engine's thread does the rest beside it:

    engine thread   schedule + prepare N+1 | wait | sample N, launch N+1 | update + outputs N | schedule N+2 ...
    model thread    ...... forward N ...............| forward N+1 ...................................

Step N+1 is scheduled before N's tokens are known: each request that N samples for counts one
placeholder token (Request.num_output_placeholders), whose id in N+1's inputs is PLACEHOLDER until N's
sample fills it in, just before N+1 is launched. A request that N stopped (EOS, a stop token or string)
has had one more row computed in N+1: that row is dropped unsampled, and its blocks went back when it
stopped. One that N brings to max_tokens is not scheduled again: its end is known in advance.

The model thread reads only what `prepare_inputs` made: every request's state belongs to the engine's
thread, as in the synchronous step, so nothing else needs a lock. The kernels let go of Python's GIL
while they run (cpu/csrc/bindings.cpp; torch's own ops do the same), so the two threads really run at
once. On a CPU they share its cores: what the engine's thread does costs the kernels some of their
time, and the overlap pays where that is less than what it hides (docs/04_scheduler.md, "Async scheduling").
"""
from __future__ import annotations

import time
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field

import torch

from nanopaged.core.request import Request, SampledToken
from nanopaged.core.scheduler import SchedulerOutput
from nanopaged.engine.extension import StepRecord
from nanopaged.outputs import RequestOutput
from nanopaged.worker.model_runner import ModelInput, ModelRunner, ModelRunnerOutput


def resolve_async_scheduling(config) -> bool:
    """None (unset): on where it pays. On a GPU the engine's thread has the CPU to itself while the model
    computes; on a CPU the two threads share its cores, and what the engine's thread does slows the
    kernels by about what it hides (docs/benchmarks.md, "Async scheduling"): off there."""
    return config.async_scheduling if config.async_scheduling is not None else config.device == "cuda"


def without_async_scheduling(config, what: str, why: str) -> None:
    """For an extension whose steps cannot be pipelined: async scheduling off, or a ValueError if asked for."""
    if config.async_scheduling:
        raise ValueError(f"async_scheduling=True cannot run with {what}: {why}; leave async_scheduling unset")
    config.async_scheduling = False


class ModelThread:
    """One thread that runs the forward passes it is given, one after the other, in order."""

    def __init__(self, runner: ModelRunner) -> None:
        self.runner = runner
        self.pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="nanopaged-model")

    def launch(self, out: SchedulerOutput, inputs: ModelInput) -> Future:
        # torch's thread count is kept per thread: the model's follows the engine thread's (cpu_threads)
        return self.pool.submit(self._forward, out, inputs, torch.get_num_threads())

    def _forward(self, out: SchedulerOutput, inputs: ModelInput, threads: int):
        if torch.get_num_threads() != threads:
            torch.set_num_threads(threads)
        start = time.perf_counter()
        result = self.runner.forward(out, inputs)
        return result, start, time.perf_counter()


@dataclass
class InFlight:
    """A step launched on the model thread, its tokens not sampled yet."""
    scheduler_output: SchedulerOutput
    result: Future
    phases: dict[str, float] = field(default_factory=dict)   # the engine thread's seconds spent on it so far


class OverlappedSteps:
    """The engine's step, pipelined: `step` returns the outputs of one step as the synchronous one does."""

    def __init__(self, engine) -> None:
        self.engine = engine
        self.model = ModelThread(engine.runner)
        self.in_flight: InFlight | None = None
        self.num_discarded_rows = 0          # rows computed for requests that had stopped (the extra step)
        self.num_overlapped_steps = 0        # steps launched before the one before had its outputs

    def step(self, ahead: bool = True) -> list[RequestOutput]:
        """One step's outputs; `ahead`: schedule and launch the next before making them (False: finish the
        step in flight and stop overlapping, while an extension guesses drafts from each step's tokens)."""
        e = self.engine
        start = time.perf_counter()
        aborted, e.output_processor.aborted = e.output_processor.aborted, []
        if self.in_flight is None:
            self.in_flight = self._schedule_and_launch()
            if self.in_flight is None:
                e.check_not_stalled(aborted)
                return aborted
        current, self.in_flight = self.in_flight, None
        try:
            t0 = time.perf_counter()
            following = e.scheduler.schedule() if ahead else SchedulerOutput()   # N+1, with placeholders
            t1 = time.perf_counter()
            inputs = e.runner.prepare_inputs(following) if following.scheduled else None
            unknown = placeholder_rows(following)
            t2 = time.perf_counter()
            runner_output, forward_start, forward_end = current.result.result()  # wait for N
            t3 = time.perf_counter()
            sampled = e.token_selection(self._live_rows(runner_output))           # sample N
            if inputs is not None:
                fill_placeholders(inputs.input_ids, unknown, sampled)
                self.in_flight = InFlight(following, self.model.launch(following, inputs),
                                          {"schedule": t1 - t0, "prepare": t2 - t1})
            t4 = time.perf_counter()
            e.scheduler.append(current.scheduler_output, sampled)                # update N
            t5 = time.perf_counter()
            outputs, stopped = e.output_processor.process(sampled, runner_output.prompt_logits)   # outputs N
            t6 = time.perf_counter()
            phases = {**current.phases, "forward": forward_end - forward_start, "wait": t3 - t2,
                      "sample": t4 - t3, "update": t5 - t4, "output": t6 - t5}
            e.finish_step(StepRecord(current.scheduler_output, sampled, outputs, stopped, e.scheduler.running,
                                     (start, forward_start, t4, t5), phases))
            if self.in_flight is not None:
                e.scheduler.advance(following)      # after N's observers: they count N's tokens as computed
                self.num_overlapped_steps += 1
        except BaseException:
            self._abort(current)
            raise
        if self.in_flight is not None and not e.scheduler.has_unfinished_requests():
            self.drain()              # only stopped requests' rows are left in it: nothing waits for them
        return aborted + outputs

    def _schedule_and_launch(self) -> InFlight | None:
        """The first step of a run: nothing computing yet to overlap its scheduling with."""
        e = self.engine
        t0 = time.perf_counter()
        out = e.scheduler.schedule()
        if not out.scheduled:
            return None
        t1 = time.perf_counter()
        inputs = e.runner.prepare_inputs(out)
        launched = InFlight(out, self.model.launch(out, inputs),
                            {"schedule": t1 - t0, "prepare": time.perf_counter() - t1})
        e.scheduler.advance(out)
        return launched

    def _live_rows(self, output: ModelRunnerOutput) -> ModelRunnerOutput:
        kept = live_rows(output)
        self.num_discarded_rows += len(output.requests) - len(kept.requests)
        return kept

    def drain(self) -> None:
        """Wait for the step in flight and drop it: every request in it has finished."""
        if self.in_flight is not None:
            current, self.in_flight = self.in_flight, None
            output, _, _ = current.result.result()
            assert all(r.is_finished for r in output.requests), "drain() drops live requests' tokens"
            self.num_discarded_rows += len(output.requests)

    def _abort(self, current: InFlight) -> None:
        """A step failed: both the one computing and the one scheduled after it end with "abort"."""
        following, self.in_flight = self.in_flight, None
        if following is not None:
            following.result.exception()        # wait: its forward pass may still be writing K/V
            self.engine.abort_step(following.scheduler_output)
        self.engine.abort_step(current.scheduler_output)


def live_rows(output: ModelRunnerOutput) -> ModelRunnerOutput:
    """The rows of requests still running; a request that stopped or was aborted after its step
    was scheduled had its row computed for nothing (a preempted one's row is good: it is kept)."""
    keep = [i for i, r in enumerate(output.requests) if not r.is_finished]
    if len(keep) == len(output.requests):
        return output
    return ModelRunnerOutput([output.requests[i] for i in keep], output.logits[keep],
                             [p for p in output.prompt_logits if not p[0].is_finished])


def placeholder_rows(out: SchedulerOutput) -> list[tuple[int, Request]]:
    """The rows of a step's batch that hold a placeholder, each with its request (the runner lays out each
    request's positions num_computed_tokens .. + num_new in turn). Before `advance` moves the counters on."""
    rows, first = [], 0
    for request, num_new in out.scheduled:
        start, known = request.num_computed_tokens, request.num_tokens
        rows += [(first + p - start, request)
                 for p in range(max(start, known), min(start + num_new, known + request.num_output_placeholders))]
        first += num_new
    return rows


def fill_placeholders(input_ids: torch.Tensor, rows: list[tuple[int, Request]],
                      sampled: dict[Request, list[SampledToken]]) -> None:
    """Put each placeholder's token, now sampled, into the next step's inputs (a request whose step had
    no sample, because it had stopped, gets any valid id: its row is dropped)."""
    if rows:
        ids = [sampled[r][-1].token_id if r in sampled else 0 for _, r in rows]
        input_ids[[row for row, _ in rows]] = torch.tensor(ids, dtype=input_ids.dtype, device=input_ids.device)
