"""The CPU fast path for linear layers: bfloat16 weights packed once for oneDNN's matrix-unit kernel.

`nn.Linear` (F.linear) is the reference. On a CPU with AMX or AVX512-BF16, oneDNN multiplies
bfloat16 faster once a weight is reordered into the blocked layout its kernel reads; reordering
for every call would cost more than it saves, so it happens once, after loading, and the
reordered weight replaces the plain one. The layers are swapped in place, as tensor
parallelism swaps its own, so models/llama.py has no branch for it.

The two ops are private to torch: `torch.ops.mkldnn._reorder_linear_weight` packs a weight and
`torch.ops.mkldnn._linear_pointwise` multiplies by it (what torch.compile's CPU backend emits
for a frozen bfloat16 linear). tests/worker/test_cpu_linear.py pins that they still exist and
still equal F.linear; where they are missing the model keeps its nn.Linear layers.
docs/05_model_runner_and_kernels.md, "bfloat16 on the matrix units", has the figures.
"""
from __future__ import annotations

import logging

import torch
from torch import nn

logger = logging.getLogger(__name__)


def packed_ops_available() -> bool:
    mkldnn = torch.ops.mkldnn
    return (torch.backends.mkldnn.is_available() and hasattr(mkldnn, "_reorder_linear_weight")
            and hasattr(mkldnn, "_linear_pointwise"))


class PackedLinear(nn.Module):
    """y = x W^T + b with W packed for oneDNN. Only for inference: the packed weight is an
    opaque oneDNN tensor, not a Parameter, and nothing can be trained or saved through it."""

    def __init__(self, linear: nn.Linear) -> None:
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.packed_weight = torch.ops.mkldnn._reorder_linear_weight(linear.weight.detach(), None)
        self.bias = None if linear.bias is None else linear.bias.detach()
        self.shard_sizes = getattr(linear, "shard_sizes", None)     # the fused projections' widths

    def forward(self, x: torch.Tensor) -> torch.Tensor:   # x: (tokens, in_features)
        return torch.ops.mkldnn._linear_pointwise(x, self.packed_weight, self.bias, "none", [], "")


def pack_linears(model: nn.Module) -> int:
    """Swap every plain nn.Linear of a bfloat16 CPU model for a PackedLinear; how many were swapped.
    Subclasses (tensor parallelism's layers) keep their own forward and are left alone."""
    if not packed_ops_available():
        logger.warning("cpu_linear='packed': this torch has no oneDNN packed linear; using F.linear")
        return 0
    targets = [(name, m) for name, m in model.named_modules() if type(m) is nn.Linear]
    for name, linear in targets:
        parent_name, _, child = name.rpartition(".")
        setattr(model.get_submodule(parent_name), child, PackedLinear(linear))
    return len(targets)
