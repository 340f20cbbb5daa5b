"""A worker process: join the job, build its share of the model, run steps until told to stop.

The loop is the whole protocol (rank_runner.py: RankRunner.serve). Between steps a worker waits in a
broadcast on the control group (parallel_state.py); a STOP header ends it. An exception (in loading, in a step) is
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
from nanopaged.extras.tensor_parallel.parallel_state import Address, leave, threads_per_rank
from nanopaged.extras.tensor_parallel.rank_runner import RankRunner


def worker_main(config: EngineConfig, rank: int, address: Address | None, to_driver=None,
                rank_runner_class: type[RankRunner] = RankRunner) -> None:
    """The target of a worker process (spawned by runner.py, or started by torchrun).
    `to_driver`: a pipe for ("joining", None) before the rendezvous and ("failed", traceback).
    The rank runner class says how a rank joins and which loop it serves (a pipeline stage's differs)."""
    try:
        if config.device == "cpu":
            torch.set_num_threads(threads_per_rank(rank_runner_class.num_ranks(config)))
        if to_driver is not None:
            to_driver.send(("joining", None))    # the driver waits for this, watching for an early death
        runner = rank_runner_class(config, rank_runner_class.join_group(config, rank, address))
        runner.serve()
    except BaseException:
        message = f"{rank_runner_class.kind} worker rank {rank} failed:\n{traceback.format_exc()}"
        if to_driver is not None:
            to_driver.send(("failed", message))
        else:
            print(message, file=sys.stderr, flush=True)
        raise SystemExit(1)
    leave()

