"""The ranks and their two process groups: who is who, and how they talk.

Every rank (the driver is rank 0) joins one torch.distributed job of N processes:

    compute group   the all-reduces and the logits gather inside a step: gloo on CPU, NCCL on
                    CUDA; a rank that hangs mid-step fails it after COMPUTE_TIMEOUT
    control group   gloo, CPU tensors: the driver's step message. A worker waits here between
                    steps for as long as the user leaves the LLM idle, hence the long timeout

The two groups mirror vLLM's `GroupCoordinator` (vllm/distributed/parallel_state.py), which
keeps a gloo `cpu_group` for metadata beside the device group. A rank that dies closes its
sockets, and gloo fails the peers' pending call at once ("Connection closed by peer"): that,
not the timeout, is how an error in one rank reaches the others within seconds.

Rendezvous: under torchrun the standard variables (RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT)
say everything (`env://`). Otherwise the driver hosts a TCPStore on MASTER_ADDR:MASTER_PORT
if they are set, else on a free loopback port the OS picks, and the workers it spawns connect
to it. docs/09_tensor_parallel.md.
"""
from __future__ import annotations

import os
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist

COMPUTE_TIMEOUT = timedelta(minutes=5)   # no step's collective waits this long for a healthy peer
CONTROL_TIMEOUT = timedelta(days=7)      # how long a worker waits, idle, for the next step
STORE_TIMEOUT = timedelta(seconds=60)    # spawning a worker and importing torch fit well within it


@dataclass
class Address:
    """Where the ranks meet: a TCPStore's host and port."""
    host: str
    port: int


def launched_by_torchrun() -> bool:
    """torchrun (torch.distributed.run) starts every rank itself and sets these for each."""
    return "RANK" in os.environ and "WORLD_SIZE" in os.environ


def host_store(world_size: int) -> tuple[dist.TCPStore, Address]:
    """The driver's rendezvous server: MASTER_ADDR/MASTER_PORT if set, else port 0, which the
    OS turns into a free loopback port (no guessing, no race with another program)."""
    host = os.environ.get("MASTER_ADDR", "127.0.0.1")
    port = int(os.environ.get("MASTER_PORT", 0))
    store = dist.TCPStore(host, port, world_size, is_master=True, timeout=STORE_TIMEOUT,
                          wait_for_workers=False)
    return store, Address(host, store.port)


class RankGroup:
    """This process's rank, its device, and the collectives the layers and the step use.

    The ranks of one tensor-parallel group: the whole job, or under pipeline parallelism one stage's
    (`compute` and `control` are then that stage's groups, `rank` its rank among them, and the job's
    own figures go over `job_control`; extras/pipeline_parallel/)."""

    def __init__(self, rank: int, world_size: int, device: torch.device, control, compute=None,
                 job_control=None) -> None:
        self.rank, self.world_size, self.device = rank, world_size, device
        self.control = control                  # the gloo group of the step message
        self.compute = compute                  # the all-reduces' group; None: the whole job's default group
        self.job_control = job_control or control

    @property
    def is_driver(self) -> bool:
        return self.rank == 0

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """Sum of every rank's x, in place (row-parallel outputs, vocab-parallel embeddings)."""
        dist.all_reduce(x, group=self.compute)
        return x

    def gather_to_driver(self, x: torch.Tensor) -> torch.Tensor | None:
        """Every rank's x, concatenated along the last axis, on rank 0; None elsewhere."""
        parts = [torch.empty_like(x) for _ in range(self.world_size)] if self.is_driver else None
        dist.gather(x.contiguous(), parts, group=self.compute, group_dst=0)
        return torch.cat(parts, dim=-1) if self.is_driver else None

    def broadcast_from_driver(self, x: torch.Tensor) -> torch.Tensor:
        """Rank 0's x (a CPU int64 tensor) on every rank, over the control group."""
        dist.broadcast(x, group=self.control, group_src=0)
        return x

    def agree_on_min(self, value: int) -> int:
        """The smallest value any rank proposes (the KV block count every rank can hold)."""
        t = torch.tensor([value], dtype=torch.long, device=self.device)
        dist.all_reduce(t, op=dist.ReduceOp.MIN)
        return int(t.item())

    def gather_ints(self, values: list[int]) -> list[list[int]] | None:
        """Every rank's few integers on the job's rank 0, by global rank (startup figures: weight and KV bytes)."""
        t = torch.tensor(values, dtype=torch.long)
        first = dist.get_rank() == 0
        parts = [torch.empty_like(t) for _ in range(dist.get_world_size())] if first else None
        dist.gather(t, parts, dst=0, group=self.job_control)
        return [p.tolist() for p in parts] if first else None


def join(rank: int, world_size: int, device_type: str, address: Address | None,
         store: dist.TCPStore | None = None) -> RankGroup:
    """Join the job as `rank`: the compute group (the default group) and the control group.

    address None means torchrun's `env://`; the driver passes the store it hosts."""
    control, device = join_job(rank, world_size, device_type, address, store)
    return RankGroup(rank, world_size, device, control)


def join_job(rank: int, world_size: int, device_type: str, address: Address | None,
             store: dist.TCPStore | None = None) -> tuple[object, torch.device]:
    """Join the job's default group as `rank`: (the job's gloo control group, this rank's device)."""
    backend = compute_backend(device_type)
    if address is None:
        dist.init_process_group(backend, init_method="env://", timeout=COMPUTE_TIMEOUT)
    else:
        if store is None:
            store = dist.TCPStore(address.host, address.port, world_size, is_master=False,
                                  timeout=STORE_TIMEOUT)
        dist.init_process_group(backend, store=store, rank=rank, world_size=world_size,
                                timeout=COMPUTE_TIMEOUT)
    control = dist.new_group(backend="gloo", timeout=CONTROL_TIMEOUT)
    device = torch.device("cpu")
    if device_type == "cuda":
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", rank)))
        torch.cuda.set_device(device)
    return control, device


def compute_backend(device_type: str) -> str:
    return "nccl" if device_type == "cuda" else "gloo"


def leave() -> None:
    """Close this process's groups (their sockets and listening ports)."""
    if dist.is_initialized():
        dist.destroy_process_group()


def threads_per_rank(world_size: int) -> int:
    """CPU threads for one rank: the cores shared out among the ranks on this machine, so two
    ranks on two cores do not fight over them (torchrun says how many share it)."""
    local = int(os.environ.get("LOCAL_WORLD_SIZE", world_size))
    return max(1, (os.cpu_count() or 1) // local)
