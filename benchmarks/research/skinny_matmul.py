"""Why a decode step costs what it costs on a CPU: one pass of the model's matmuls at a few
row counts and thread counts, against how fast this machine moves the same bytes.

(In full: docs/07_benchmarks.md, "The benchmark modules in full".)
"""
from __future__ import annotations

import argparse

import torch

from benchmarks.report import print_skinny
from benchmarks.roofline import copy_bytes_per_s, matmul_flops, own_matmul_seconds, step_weights
from nanopaged.models.demo_model import demo_model_path
from nanopaged.models.config import ModelConfig


def weight_bytes(m: ModelConfig) -> int:
    """float32 bytes of one decode step's weights: the decoder layers' matmuls and the lm_head."""
    return 4 * step_weights(m)


def skinny_figures(m: ModelConfig, rows: list[int], threads: list[int]) -> list[dict]:
    nbytes, before = weight_bytes(m), torch.get_num_threads()
    out = []
    try:
        for t in threads:
            torch.set_num_threads(t)
            for r, seconds in own_matmul_seconds(m, rows, "cpu", torch.float32).items():
                flops = matmul_flops(m, r) / seconds
                out.append({"threads": t, "rows": r, "ms": seconds * 1e3,
                            "weight_bytes_per_s": nbytes / seconds, "flops_per_s": flops})
            out.append({"threads": t, "rows": 0, "copy_bytes_per_s": copy_bytes_per_s(nbytes)})
    finally:
        torch.set_num_threads(before)
    return out


def main(argv: list[str] | None = None) -> list[dict]:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", help="a Hugging Face folder (default: the demo model)")
    p.add_argument("--rows", type=int, nargs="+", default=[1, 8, 16, 24, 32, 64])
    p.add_argument("--threads", type=int, nargs="+", help="torch thread counts (default: 1 and torch's own)")
    args = p.parse_args(argv)
    m = ModelConfig.from_folder(args.model or str(demo_model_path()))
    threads = args.threads or sorted({1, torch.get_num_threads()})
    figs = skinny_figures(m, args.rows, threads)
    print_skinny(weight_bytes(m), figs)
    return figs


if __name__ == "__main__":
    main()
