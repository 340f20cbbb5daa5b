"""The cpu attention kernel alone, with shared prefixes read once and row by row (issue 37).

(In full: docs/07_benchmarks.md, "The benchmark modules in full".)
"""
from __future__ import annotations

import argparse
import time

import torch

from benchmarks.report import print_shared_prefix_kernel
from nanopaged.cpu.build import cpu_ops

BLOCK, OWN_BLOCKS, ROUNDS = 16, 4, 12


def step(rows: int, prefix_blocks: int, own: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, int]:
    """Block tables, seq_lens and query starts of a decode step; and the pool's size in blocks."""
    tables, nxt = [], 1
    shared = list(range(nxt, nxt + prefix_blocks))
    nxt += prefix_blocks
    for _ in range(rows):
        if own:
            shared = list(range(nxt, nxt + prefix_blocks))
            nxt += prefix_blocks
        tables.append(shared + list(range(nxt, nxt + OWN_BLOCKS)))
        nxt += OWN_BLOCKS
    seq_lens = torch.tensor([prefix_blocks * BLOCK + 40 + r % 20 for r in range(rows)])
    return torch.tensor(tables), seq_lens, torch.arange(rows + 1), nxt


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rows", type=int, default=32)
    p.add_argument("--prefix-blocks", type=int, default=64)
    p.add_argument("--own", action="store_true", help="each row its own copy of the prefix")
    p.add_argument("--shape", default="30,9,3,64", help="layers, heads, KV heads, head_dim")
    args = p.parse_args()
    layers, heads, kv_heads, dim = (int(x) for x in args.shape.split(","))
    ops = cpu_ops()
    torch.manual_seed(0)
    tables, seq_lens, starts, blocks = step(args.rows, args.prefix_blocks, args.own)
    caches = [torch.randn(2, blocks, BLOCK, kv_heads, dim).bfloat16() for _ in range(layers)]
    q = torch.randn(args.rows, heads, dim).bfloat16()

    def attend(share: bool) -> float:
        start = time.perf_counter()
        for k, v in caches:
            ops.paged_attention(q, k, v, tables, seq_lens, starts, dim ** -0.5, share)
        return time.perf_counter() - start

    times = {True: [], False: []}
    for _ in range(ROUNDS):
        for share in (False, True):
            times[share].append(attend(share))
    print_shared_prefix_kernel(args, torch.get_num_threads(), {"row by row": times[False], "read once": times[True]})


if __name__ == "__main__":
    main()
