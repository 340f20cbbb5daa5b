"""A busy neighbour: one process that keeps one core busy while the timed runs repeat
(issue 12, target 3). CPU users run beside other work (laptops, CI runners, shared servers);
an engine whose every op waits for all its threads stalls whenever one is descheduled."""
from __future__ import annotations

import os
import subprocess
import sys
import time
from contextlib import contextmanager

from benchmarks.nanopaged_run import run_nanopaged
from benchmarks.peers import run_hf_sweep


@contextmanager
def busy_neighbour():
    """Run the body beside a pure-Python busy loop, pinned to the last core where the OS
    allows (Linux); yields the process and the core it is pinned to (or None)."""
    core = os.cpu_count() - 1 if hasattr(os, "sched_setaffinity") else None
    pin = f"import os; os.sched_setaffinity(0, {{{core}}})\n" if core is not None else ""
    proc = subprocess.Popen([sys.executable, "-c", pin + "while True:\n    pass\n"])
    try:
        time.sleep(0.5)                          # let it start and take its core
        if proc.poll() is not None:
            raise RuntimeError(f"the busy neighbour exited at once (code {proc.returncode})")
        yield proc, core
    finally:
        proc.kill()
        proc.wait()


def kept(quiet: dict, noisy: dict) -> dict:
    """Output tokens/s quiet and beside the neighbour, and the share kept."""
    q, n = quiet["output_tokens_per_s"], noisy["output_tokens_per_s"]
    return {"quiet_output_tokens_per_s": q, "noisy_output_tokens_per_s": n, "kept": n / q}


def noise_figures(model_dir: str, trace, settings: dict, config, engine: dict, hf: dict | None) -> dict:
    """nanopaged and the hf peer (at its fastest batch size) once more, beside a busy neighbour;
    `engine` and `hf` are their quiet figures."""
    with busy_neighbour() as (_, core):
        figures = {"neighbour_core": core,
                   "nanopaged": kept(engine, run_nanopaged(model_dir, trace, settings)[0].figures())}
        if hf is not None and "skipped" not in hf:
            figures["hf"] = kept(hf, run_hf_sweep(model_dir, trace, config, [hf["batch_size"]]))
    return figures
