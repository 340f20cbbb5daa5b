"""The driver's runner: ModelRunner's interface for the engine, N ranks behind it.

    LLM(model, tensor_parallel_size=N)
      driver process = rank 0: engine, scheduler, block pool, sampler, and 1/N of the model
      N - 1 workers  = ranks 1..N-1 (worker.py), spawned here, or started by torchrun

One step (`execute`): prepare the inputs as ModelRunner does, broadcast them to every rank
(step_message.py), run rank 0's share (the all-reduces inside the model keep the ranks in
lockstep), and sample on the gathered logits as a single-process engine would. The engine
cannot tell the difference (the `make_runner` hook of engine/llm_engine.py).

Failure and shutdown: if a step fails in any rank, the ranks are out of step for good, so
the runner stops every worker and raises (with the worker's traceback when a worker failed);
later calls raise too: make a new LLM. The workers also stop when the runner is shut down,
garbage-collected, or the program exits (weakref.finalize): a STOP message, a join with a
timeout, then terminate; the process groups are destroyed, so no process and no port is
left behind. One tensor-parallel LLM at a time per process: torch.distributed has one
default group. docs/09_tensor_parallel.md.
"""
from __future__ import annotations

import gc
import os
import time
import weakref
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from nanopaged.config import EngineConfig, check_memory_fits
from nanopaged.models.loader import weight_bytes
from nanopaged.worker.model_runner import ModelInput, ModelRunnerOutput, per_request
from nanopaged.core.scheduler import SchedulerOutput
from nanopaged.extras.tensor_parallel import parallel_state as ps
from nanopaged.extras.tensor_parallel.rank_runner import RankRunner
from nanopaged.extras.tensor_parallel.step_message import StepInputs, message_bytes, pack, stop_header
from nanopaged.extras.tensor_parallel.worker import worker_main

JOIN_TIMEOUT_S = 5.0      # a worker told to stop exits within this, or is terminated
REPORT_TIMEOUT_S = 0.2    # a failed worker sends its traceback before its sockets close


class TensorParallelError(RuntimeError):
    """A worker failed, or the workers stopped after a failed step."""


@dataclass
class Workers:
    """The driver's handles on its workers: plain data, so that `stop` needs no runner."""
    processes: list = field(default_factory=list)
    pipes: list = field(default_factory=list)        # receiving ends of the workers' pipes (worker.py)
    store: object = None                             # the TCPStore this process hosts
    control: object = None                           # the control group, for the STOP message
    send_stop: object = None                         # how STOP reaches every worker, if not the control broadcast
    threads_before: int = 0
    stopped_because: str | None = None

    def reports(self) -> list[str]:
        """The tracebacks failed workers sent."""
        out = []
        for conn in self.pipes:
            while not conn.closed and conn.poll(REPORT_TIMEOUT_S):
                try:
                    kind, text = conn.recv()
                except EOFError:        # the worker is gone; it said all it had to say
                    break
                if kind == "failed":
                    out.append(text)
        return out

    def wait_until_joining(self, worker_kind: str) -> None:
        """Wait for every worker's "joining" before the rendezvous, so that a worker that dies while
        starting (an import error, a script without a main guard) is an error now, not a long timeout."""
        deadline = time.monotonic() + ps.STORE_TIMEOUT.total_seconds()
        for rank, (p, conn) in enumerate(zip(self.processes, self.pipes), start=1):
            while not conn.poll(0.1):
                if not p.is_alive() or time.monotonic() > deadline:
                    raise TensorParallelError(_not_started(worker_kind, rank, p))
            try:
                kind, text = conn.recv()
            except EOFError:
                raise TensorParallelError(_not_started(worker_kind, rank, p)) from None
            if kind == "failed":
                raise TensorParallelError(text)


def _not_started(worker_kind: str, rank: int, process) -> str:
    process.join(1.0)             # its exit code, if it is on its way out
    return (f"{worker_kind} worker rank {rank} did not start (exit code {process.exitcode}). Its own traceback is on "
            f"stderr. A script that creates a {worker_kind} LLM must do it under `if __name__ == "
            "'__main__':`, since spawned workers import the script's main module (docs/09_tensor_parallel.md)")


def stop(workers: Workers, reason: str = "shut down") -> None:
    """Stop every worker and leave the process groups; safe to call twice, and after a failure."""
    if workers.stopped_because is not None:
        return
    workers.stopped_because = reason
    if dist.is_initialized() and all(p.is_alive() for p in workers.processes):
        try:
            workers.send_stop() if workers.send_stop else dist.broadcast(stop_header(), src=0, group=workers.control)
        except Exception:      # a worker died meanwhile: terminated below
            pass
    wait_s = JOIN_TIMEOUT_S if reason == "shut down" else 1.0   # after a failure a worker may be stuck mid-step
    for p in workers.processes:
        p.join(wait_s)
        if p.is_alive():
            p.terminate()
            p.join(JOIN_TIMEOUT_S)
        if p.is_alive():
            p.kill()
            p.join()
    ps.leave()
    for conn in workers.pipes:
        conn.close()
    workers.store = workers.control = None    # the store's listening socket closes with it
    if workers.threads_before:
        torch.set_num_threads(workers.threads_before)


class TensorParallelRunner(RankRunner):
    """Rank 0's share of the model, plus the driver's job: start the workers, send each step."""

    def __init__(self, config: EngineConfig, rank_runner_class: type[RankRunner] = RankRunner) -> None:
        if dist.is_initialized():
            gc.collect()              # an unreachable earlier LLM (e.g. a re-run notebook cell) stops now
        if dist.is_initialized():
            raise RuntimeError("a tensor-parallel LLM (or another torch.distributed job) is already running "
                               "in this process; delete it first (one default process group per process)")
        n = self.num_ranks(config)
        if config.device == "cpu":      # every rank in this machine's memory: their shares add up to the whole model
            check_memory_fits(weight_bytes(config.model, getattr(torch, config.dtype)), "cpu",
                              f"the model's weights, over its {n} ranks", "load a smaller model or dtype")
        self.workers = Workers(threads_before=torch.get_num_threads() if config.device == "cpu" else 0)
        self._finalizer = weakref.finalize(self, stop, self.workers)
        self.bytes_sent, self.steps_sent = 0, 0
        try:
            group = self._start(config, n, rank_runner_class)
            self.workers.control = group.control
            super().__init__(config, group)
        except BaseException as e:
            self._fail(e)
            raise

    def _start(self, config: EngineConfig, n: int, rank_runner_class) -> ps.RankGroup:
        """Join the job as rank 0, starting the workers first unless torchrun started them."""
        if config.device == "cpu":
            torch.set_num_threads(ps.threads_per_rank(n))
        if ps.launched_by_torchrun():
            return self._join_torchrun(config, n, rank_runner_class)
        self.workers.store, address = ps.host_store(n)
        ctx = mp.get_context("spawn")
        for rank in range(1, n):
            receive, send = ctx.Pipe(duplex=False)
            p = ctx.Process(target=worker_main, args=(config, rank, address, send, rank_runner_class),
                            name=f"nanopaged-tp-rank{rank}", daemon=True)
            p.start()
            send.close()              # the worker holds the sending end now: its death is an EOF here
            self.workers.processes.append(p)
            self.workers.pipes.append(receive)
        self.workers.wait_until_joining(rank_runner_class.kind)
        return self.join_group(config, 0, address, self.workers.store)

    def _join_torchrun(self, config: EngineConfig, n: int, rank_runner_class) -> ps.RankGroup:
        """torchrun started every rank running the same script: rank 0 drives, the others serve
        steps inside this constructor and exit the program when the driver stops."""
        rank, world_size = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
        if world_size != n:
            raise ValueError(f"{self.kind} runs {n} ranks (tensor_parallel_size x pipeline_parallel_size) but "
                             f"torchrun started WORLD_SIZE={world_size}")
        if rank != 0:
            worker_main(config, rank, None, None, rank_runner_class)
            raise SystemExit(0)
        return self.join_group(config, 0, None)

    # ---- one step --------------------------------------------------------------------
    @torch.inference_mode()
    def forward(self, out: SchedulerOutput, inputs: ModelInput) -> ModelRunnerOutput:
        self.check_running()
        logit_rows = inputs.sample_rows + [row for _, _, rows in inputs.prompt_rows for row in rows]
        header, body = pack(inputs.input_ids, inputs.positions, inputs.meta, logit_rows, out.blocks_to_copy)
        try:
            self.group.broadcast_from_driver(header)
            self.group.broadcast_from_driver(body)
            # The workers unpack the message into these same inputs; rank 0 already has them.
            logits = self.run(StepInputs(inputs.input_ids, inputs.positions, inputs.meta, logit_rows,
                                         out.blocks_to_copy))
        except BaseException as e:
            self._fail(e)
            raise
        self.bytes_sent += message_bytes(header, body)
        self.steps_sent += 1
        return self._split(inputs, logits)

    def _split(self, inputs, logits: torch.Tensor | None) -> ModelRunnerOutput:
        """The gathered logits back into sampling rows and each request's prompt rows."""
        if logits is None:
            logits = torch.empty((0, self.config.model_config.vocab_size), dtype=self.dtype, device=self.device)
        n = len(inputs.sample_rows)
        return ModelRunnerOutput(inputs.sample_requests, logits[:n], per_request(logits[n:], inputs.prompt_rows))

    # ---- failure and shutdown --------------------------------------------------------
    def check_running(self) -> None:
        if self.workers.stopped_because is not None:
            raise TensorParallelError(f"the {self.kind} workers have stopped ({self.workers.stopped_because}); "
                                      "create a new LLM")

    def _fail(self, error: BaseException) -> None:
        """A step (or the start) failed: stop everything; raise a worker's traceback if one came."""
        reports = self.workers.reports()
        stop(self.workers, reason=f"after {type(error).__name__}: {error}"[:300])
        if reports:
            raise TensorParallelError("\n".join(reports)) from error

    def shutdown(self) -> None:
        """Stop the workers now (also happens when the runner is collected or the program exits)."""
        self._finalizer()
