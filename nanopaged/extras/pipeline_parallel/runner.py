"""The driver's runner: stage 0's layers, the other stages behind it, several batches in flight.

    LLM(model, pipeline_parallel_size=P, tensor_parallel_size=T)
      driver process = global rank 0: engine, scheduler, block pool, sampler, and stage 0: the embedding,
                       its layers and the head (1/T of them, with T > 1)
      P x T - 1 workers = the other ranks (stage_runner.py: StageRunner.serve), spawned here or by torchrun

A batch (`submit`): prepare the inputs as ModelRunner does, broadcast them to stage 0's other ranks,
run stage 0, and hand the step message and the hidden states to stage 1 without waiting (stage_group.py);
`collect` waits for the last stage's normed hidden states of that batch's sampling rows and computes
their logits with stage 0's head (with T > 1, stage 0's other ranks take part: a HEAD message). The
engine keeps P batches in flight (`max_concurrent_batches`, engine/batch_queue.py), so while stage 1 runs
batch A the driver schedules and runs batch B: each stage works while the others do. Start, failure and
shutdown are tensor parallelism's (tensor_parallel/runner.py): a failure in any rank stops every rank and
raises. The STOP message goes down the pipeline: stage 0's ranks pass it to stage 1's, and so on.
docs/09_tensor_parallel.md, "Pipeline parallelism".
"""
from __future__ import annotations

import time
from datetime import timedelta

import torch.distributed as dist

from nanopaged.config import EngineConfig
from nanopaged.core.scheduler import SchedulerOutput
from nanopaged.extras.pipeline_parallel.stage_group import PipelineGroup
from nanopaged.extras.pipeline_parallel.stage_runner import StageRunner
from nanopaged.extras.tensor_parallel.runner import JOIN_TIMEOUT_S, TensorParallelRunner
from nanopaged.extras.tensor_parallel.step_message import StepInputs, message_bytes, pack, stop_header
from nanopaged.worker.model_runner import ModelInput, ModelRunnerOutput


class PipelineParallelRunner(TensorParallelRunner, StageRunner):
    """Stage 0 (its tensor-parallel rank 0), plus the driver's job: start the ranks, submit and collect batches."""

    def __init__(self, config: EngineConfig, rank_runner_class: type[StageRunner] = StageRunner) -> None:
        self.batches_in_flight, self.wall_s, self._busy_since = 0, 0.0, 0.0
        self.busy_per_stage = [0.0] * config.pipeline_parallel_size   # seconds each stage computed, since the start
        self.bytes_between_stages = 0    # step messages and hidden states forward, sampling rows back
        super().__init__(config, rank_runner_class)
        self.max_concurrent_batches = config.pipeline_parallel_size    # one batch per stage (vLLM's batch queue)

    def _start(self, config: EngineConfig, n: int, rank_runner_class) -> PipelineGroup:
        group = super()._start(config, n, rank_runner_class)
        self.workers.send_stop = lambda: send_stop(group)
        return group

    # ---- one batch -------------------------------------------------------------------------------------
    def submit(self, out: SchedulerOutput, inputs: ModelInput):
        """Run stage 0 on the batch and hand it on; the handle `collect` takes."""
        self.check_running()
        g = self.group
        logit_rows = inputs.sample_rows + [row for _, _, rows in inputs.prompt_rows for row in rows]
        header, body = pack(inputs.input_ids, inputs.positions, inputs.meta, logit_rows, out.blocks_to_copy)
        if self.batches_in_flight == 0:
            self._busy_since = time.perf_counter()
        try:
            if g.world_size > 1:           # stage 0's other tensor-parallel ranks
                g.broadcast_from_driver(header)
                g.broadcast_from_driver(body)
            hidden = self.run_stage(StepInputs(inputs.input_ids, inputs.positions, inputs.meta, logit_rows,
                                               out.blocks_to_copy), None)
            busy = g.busy_seconds()
            busy[0] = self.busy_s
            g.send_forward(header, body, busy, hidden)
        except BaseException as e:
            self._fail(e)
            raise
        self.batches_in_flight += 1
        self.steps_sent += 1
        # every boundary carries the same message and hidden states, once per tensor-parallel rank
        per_boundary = message_bytes(header, body) + busy.nbytes + hidden.nbytes
        self.bytes_between_stages += per_boundary * g.world_size * (g.num_stages - 1)
        return inputs, len(logit_rows)

    def collect(self, handle) -> ModelRunnerOutput:
        """The logits of the oldest batch in flight: its sampling rows from the last stage, through stage 0's head."""
        inputs, num_rows = handle
        g = self.group
        try:
            busy, rows = g.receive_back(num_rows, self.config.model_config.hidden_size, self.dtype)
            logits = None
            if rows is not None:
                if g.world_size > 1:       # stage 0's other tensor-parallel ranks hold the rest of the vocabulary
                    g.send_head(rows)
                logits = self.run_head(rows)
        except BaseException as e:
            self._fail(e)
            raise
        self.batches_in_flight -= 1
        if self.batches_in_flight == 0:
            self.wall_s += time.perf_counter() - self._busy_since
        self.busy_per_stage = [self.busy_s] + busy.tolist()[1:]
        self.bytes_between_stages += busy.nbytes + (0 if rows is None else rows.nbytes)
        return self._split(inputs, logits)

    def forward(self, out: SchedulerOutput, inputs: ModelInput) -> ModelRunnerOutput:
        """One batch start to end (the engine submits and collects through engine/batch_queue.py)."""
        return self.collect(self.submit(out, inputs))

    def figures(self) -> dict:
        """Since the start: each stage's layers, every rank's weight and K/V bytes (by global rank), the
        seconds each stage computed, the wall time batches were in flight, the bytes between stages."""
        return {"stages": [[r.start, r.stop] for r in self.layers_per_stage], "memory": self.memory,
                "busy_s": list(self.busy_per_stage), "wall_s": self.wall_s, "batches": self.steps_sent,
                "bytes_between_stages": self.bytes_between_stages}


def send_stop(group: PipelineGroup) -> None:
    """STOP to stage 0's other ranks and to stage 1 (which passes it on), waiting a bounded time for it."""
    if group.world_size > 1:
        dist.broadcast(stop_header(), group=group.control, group_src=0)
    if group.num_stages > 1:
        work = dist.isend(stop_header(), group.peer(1), group=group.job_control)
        work.wait(timeout=timedelta(seconds=JOIN_TIMEOUT_S))
