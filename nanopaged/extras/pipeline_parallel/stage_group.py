"""A stage's ranks and how a batch travels between stages: point-to-point sends.

World = P stages x T tensor-parallel ranks; global rank g = stage * T + t (tensor-parallel ranks
adjacent, as vLLM lays them out). Every rank joins the job (tensor_parallel/parallel_state.py: the
default group, gloo on CPU and NCCL on CUDA, and a gloo control group over all ranks), then its stage's
two groups for the all-reduces and the step broadcast inside a stage. Rank t of stage s talks to rank t
of stages s - 1 and s + 1 only:

    forward    the step message (int64, on the control group), then over the default group (the
               device's backend) every stage's busy seconds so far and the hidden states (tokens, hidden)
    back       the last stage's rank 0 sends rank 0 of the job every stage's busy seconds and the
               normed hidden states of the rows that sample, (rows, hidden) (default group)
    head       the first stage holds the head: its rank 0 (the driver) broadcasts a HEAD header and
               those rows to the stage's other ranks, and their vocabulary shares gather on it

Sends are non-blocking (isend): a stage hands the batch on and starts the next while the transfer runs;
every rank receives in the order batches were sent, which is the order the driver submitted them.
A rank waiting for the next step waits on the control group, whose timeout is the idle one (days); what
follows a step message, and the rows the driver waits for, travel on the default group, whose timeout
(minutes) ends the wait for a rank that hangs mid-step.
"""
from __future__ import annotations

import torch
import torch.distributed as dist

from nanopaged.config import EngineConfig
from nanopaged.extras.tensor_parallel import parallel_state as ps
from nanopaged.extras.tensor_parallel.step_message import HEAD, HEADER_LEN, STOP, body_len, stop_header

DRIVER = 0


class PipelineGroup(ps.RankGroup):
    """A rank's tensor-parallel group within its stage (`rank`, `world_size`: among the stage's T ranks),
    plus where the stage sits in the pipeline and the sends to its neighbours."""

    def __init__(self, t: int, tp: int, device, control, compute, job_control, stage: int, num_stages: int) -> None:
        super().__init__(t, tp, device, control, compute, job_control)
        self.stage, self.num_stages = stage, num_stages
        self.pending: list = []          # sends not known to be complete: their tensors must stay alive

    @property
    def is_first(self) -> bool:
        return self.stage == 0

    @property
    def is_last(self) -> bool:
        return self.stage == self.num_stages - 1

    def peer(self, stage: int) -> int:
        """The global rank of this rank's counterpart (same t) in `stage`."""
        return stage * self.world_size + self.rank

    # ---- forward along the pipeline ------------------------------------------------------------------
    def send_forward(self, header: torch.Tensor, body: torch.Tensor, busy: torch.Tensor,
                     hidden: torch.Tensor) -> None:
        to = self.peer(self.stage + 1)
        self._keep([dist.isend(header, to, group=self.job_control), dist.isend(body, to, group=self.job_control),
                    dist.isend(busy, to), dist.isend(hidden.contiguous(), to)])

    def send_stop_forward(self) -> None:
        """STOP to the next stage (which passes it on), sent before this rank leaves."""
        if not self.is_last:
            dist.isend(stop_header(), self.peer(self.stage + 1), group=self.job_control).wait()
        self.wait_sent()

    def receive_forward(self, hidden_size: int, dtype: torch.dtype):
        """(header, body, busy, hidden) of the next batch from the stage before, or None on STOP."""
        source = self.peer(self.stage - 1)
        header = torch.empty(HEADER_LEN, dtype=torch.long)
        dist.recv(header, source, group=self.job_control)
        if header[0].item() == STOP:
            return None
        body = torch.empty(body_len(header), dtype=torch.long)
        busy = self.busy_seconds()
        dist.recv(body, source, group=self.job_control)
        dist.recv(busy, source)
        hidden = torch.empty((header[1].item(), hidden_size), dtype=dtype, device=self.device)
        dist.recv(hidden, source)
        return header, body, busy, hidden

    # ---- back to the driver ----------------------------------------------------------------------------
    def send_back(self, busy: torch.Tensor, rows: torch.Tensor | None) -> None:
        """The last stage's rank 0: every stage's busy seconds, then the normed hidden states of the rows
        that sample (none if no row samples)."""
        works = [dist.isend(busy, DRIVER)]
        if rows is not None:
            works.append(dist.isend(rows.contiguous(), DRIVER))
        self._keep(works)

    def receive_back(self, num_rows: int, hidden_size: int, dtype: torch.dtype):
        """The driver: (busy seconds per stage, the rows' hidden states or None) of the oldest batch in flight."""
        last = (self.num_stages - 1) * self.world_size
        busy = self.busy_seconds()
        dist.recv(busy, last)
        if num_rows == 0:
            return busy, None
        rows = torch.empty((num_rows, hidden_size), dtype=dtype, device=self.device)
        dist.recv(rows, last)
        return busy, rows

    # ---- the head, on the first stage --------------------------------------------------------------------
    def send_head(self, rows: torch.Tensor) -> None:
        """The driver, to the first stage's other ranks: a HEAD header, then the rows (their logits next)."""
        header = torch.zeros(HEADER_LEN, dtype=torch.long)
        header[0], header[1] = HEAD, rows.shape[0]
        self.broadcast_from_driver(header)
        self.broadcast_rows(rows)

    def broadcast_rows(self, rows: torch.Tensor) -> torch.Tensor:
        """The driver's hidden rows on every rank of the stage (its device group: NCCL sends device tensors)."""
        dist.broadcast(rows, group=self.compute, group_src=0)
        return rows

    def busy_seconds(self) -> torch.Tensor:
        """Every stage's busy seconds, as one batch carries them (on the device: NCCL sends device tensors)."""
        return torch.zeros(self.num_stages, dtype=torch.float64, device=self.device)

    # ---- sends in flight --------------------------------------------------------------------------------
    def _keep(self, works: list) -> None:
        self.pending = [w for w in self.pending if not w.is_completed()] + works

    def wait_sent(self) -> None:
        for work in self.pending:
            work.wait()
        self.pending = []


def join_pipeline(config: EngineConfig, rank: int, address: ps.Address | None, store=None) -> PipelineGroup:
    """Join the job as global `rank`, then every stage's groups (each rank makes every group, in the same
    order, as torch.distributed asks), keeping its own stage's."""
    tp, pp = config.tensor_parallel_size, config.pipeline_parallel_size
    job_control, device = ps.join_job(rank, tp * pp, config.device, address, store)
    stage, t = divmod(rank, tp)
    mine = None
    for s in range(pp):
        ranks = list(range(s * tp, (s + 1) * tp))
        groups = (dist.new_group(ranks, backend=ps.compute_backend(config.device), timeout=ps.COMPUTE_TIMEOUT),
                  dist.new_group(ranks, backend="gloo", timeout=ps.CONTROL_TIMEOUT))
        if s == stage:
            mine = groups
    compute, control = mine
    return PipelineGroup(t, tp, device, control, compute, job_control, stage, pp)
