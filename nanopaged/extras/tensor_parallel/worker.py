"""A worker process: join the job, build its share of the model, run steps until told to stop.

The loop is the whole protocol. Between steps a worker waits in a broadcast on the control
group (parallel_state.py); a STOP header ends it. An exception (in loading, in a step) is
sent to the driver on a pipe (which also says "joining" once the process is up), and the
process exits: its closed sockets fail the driver's
pending collective at once, and the driver raises with this traceback instead of hanging.
Under torchrun there is no pipe; the traceback goes to stderr, where torchrun collects it.
"""
from __future__ import annotations

import sys
import traceback

import torch

from nanopaged.config import EngineConfig
from nanopaged.extras.tensor_parallel.parallel_state import Address, join, leave, threads_per_rank
from nanopaged.extras.tensor_parallel.rank_runner import RankRunner
from nanopaged.extras.tensor_parallel.step_message import HEADER_LEN, STOP, body_len, unpack


def worker_main(config: EngineConfig, rank: int, address: Address | None, to_driver=None,
                rank_runner_class: type[RankRunner] = RankRunner) -> None:
    """The target of a worker process (spawned by runner.py, or started by torchrun).
    `to_driver`: a pipe for ("joining", None) before the rendezvous and ("failed", traceback)."""
    world_size = config.tensor_parallel_size
    try:
        if config.device == "cpu":
            torch.set_num_threads(threads_per_rank(world_size))
        if to_driver is not None:
            to_driver.send(("joining", None))    # the driver waits for this, watching for an early death
        runner = rank_runner_class(config, join(rank, world_size, config.device, address))
        serve_steps(runner)
    except BaseException:
        message = f"tensor-parallel worker rank {rank} failed:\n{traceback.format_exc()}"
        if to_driver is not None:
            to_driver.send(("failed", message))
        else:
            print(message, file=sys.stderr, flush=True)
        raise SystemExit(1)
    leave()


def serve_steps(runner: RankRunner) -> None:
    """Receive a step, run it, repeat; return on STOP."""
    group = runner.group
    header = torch.empty(HEADER_LEN, dtype=torch.long)
    while True:
        group.broadcast_from_driver(header)
        if header[0].item() == STOP:
            return
        body = group.broadcast_from_driver(torch.empty(body_len(header), dtype=torch.long))
        runner.run(unpack(header, body, runner.block_size, runner.device))
