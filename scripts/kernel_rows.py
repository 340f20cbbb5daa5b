"""One decoder layer's four matmuls of the demo model, by rows, on every linear kernel this CPU runs.

    python scripts/kernel_rows.py [--rows 1,8,32,64,256] [--threads 2]

The weights (q/k/v 960 x 576, o 576 x 576, gate/up 3072 x 576, down 576 x 1536) are one layer's, run
again and again, so they sit in the CPU's cache: this is each kernel's arithmetic, not the memory's
(a decode step streams 30 such layers from memory; docs/01, "What a weight costs"). Prints ms per pass
of the four and GFLOP/s, with the CPU's flags, for the tables in docs/01 and docs/05.
"""
from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))    # the checkout's nanopaged, installed or not
from nanopaged.cpu.build import available, cpu_ops  # noqa: E402
from nanopaged.cpu.features import cpu_flags  # noqa: E402
from nanopaged.cpu.linear import KERNELS  # noqa: E402
from nanopaged.cpu.quantized_linear import int8_codes, nanopaged_kernels, quantized_linear  # noqa: E402

SHAPES = [(576, 960), (576, 576), (576, 3072), (1536, 576)]       # (in_features, out_features)


def kernels() -> dict:
    """name -> a function from nn.Linear to the layer that runs it, for each kernel that runs here."""
    ops = cpu_ops() if available() is None else None
    out = {"packed (oneDNN)": KERNELS["packed"]}
    if ops is not None and ops.has_avx512_bf16:
        out["dpbf16"] = KERNELS["dpbf16"]
    if ops is not None and ops.has_amx_bf16:
        out["amx"] = KERNELS["amx"]
    if nanopaged_kernels() is not None:
        out["int8, blocks of 32 (VNNI)"] = lambda d: quantized_linear("int8", d, 32, None)
        out["w8a8 (VNNI)"] = lambda d: OneBlockPerRow(d, ops)
    if ops is not None and ops.has_amx_int8:
        out["w8a8 (AMX-INT8)"] = lambda d: quantized_linear("w8a8", d, 32, None)
    return out


class OneBlockPerRow(nn.Module):
    """W8A8's sums on the VNNI kernel (linear_quantized, one block the row's length): what W8A8Linear runs
    where the CPU has no AMX-INT8, timed here beside it on a CPU that has."""

    def __init__(self, dense: nn.Linear, ops) -> None:
        super().__init__()
        self.ops, self.in_features, self.out_features = ops, dense.in_features, dense.out_features
        codes, scale = int8_codes(dense.weight.detach(), dense.in_features)
        self.packed = ops.pack_quantized(codes, scale, torch.empty(0), dense.in_features, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.ops.linear_quantized(x, self.packed, self.out_features, self.in_features, 8)


def seconds(layers: list, rows: int, tries: int = 5, repeat: int = 20) -> float:
    xs = [torch.randn(rows, layer.in_features, dtype=torch.bfloat16) for layer in layers]
    best = float("inf")
    with torch.inference_mode():
        for _ in range(tries):
            start = time.perf_counter()
            for _ in range(repeat):
                for layer, x in zip(layers, xs):
                    layer(x)
            best = min(best, (time.perf_counter() - start) / repeat)
    return best


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--rows", default="1,8,32,64,128,256")
    p.add_argument("--threads", type=int, default=torch.get_num_threads())
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    dense = [nn.Linear(k, n, bias=False, dtype=torch.bfloat16) for k, n in SHAPES]
    rows = [int(r) for r in args.rows.split(",")]
    flags = " ".join(sorted(f for f in cpu_flags() if f.startswith(("amx", "avx512_bf16", "avx512_vnni"))))
    print(f"{args.threads} threads, flags: {flags or 'none of amx/avx512_bf16/avx512_vnni'}")
    print("| kernel | " + " | ".join(f"{r} rows" for r in rows) + " |")
    print("|---" * (len(rows) + 1) + "|")
    for name, make in kernels().items():
        layers = [make(d) for d in dense]
        cells = []
        for r in rows:
            s = seconds(layers, r)
            cells.append(f"{s * 1e3:.3f} ms, {2 * r * sum(k * n for k, n in SHAPES) / s / 1e9:.0f} GF/s")
        print(f"| {name} | " + " | ".join(cells) + " |", flush=True)


if __name__ == "__main__":
    main()
