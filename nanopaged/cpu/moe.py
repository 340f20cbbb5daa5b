"""The CPU fast path for a mixture of experts: the step's tokens grouped by expert, each expert run once.

`models/moe.py: SparseMoeBlock.forward` is the reference: route, then for each expert, find the
tokens that chose it, gather them, run its MLP, add the weighted result back. `GroupedMoeBlock`
routes the same way (the block's own `route`: the router on the linear kernel the CPU annex chose,
softmax and top-k in torch) and hands the rest to C++ in one call (csrc/moe.cpp: Experts): the
step's (token, expert) pairs sorted by expert once, each chosen expert's gate/up with SiLU(gate) *
up and its down projection run once over all its rows on nanopaged's bfloat16 or 4-/8-bit kernels,
the weighted sum back into each token in one pass, rounded as the reference rounds it.

In a decode step of 32 requests, OLMoE's 32 x 8 choices land on at most 64 experts: a few rows
each. Grouping turns 256 one-row products into at most 64 products of a few rows each, and every
expert's weights are read once per step however many tokens chose it. A token's result depends on
its own row alone (the kernels compute each row alone; its k outputs are summed in its own expert
order), so the fast path keeps batch invariance. tests/cpu/test_moe_experts.py holds it to the
reference; docs/13_moe.md.
"""
from __future__ import annotations

from typing import Callable

import torch
from torch import nn

from nanopaged.cpu.build import cpu_ops
from nanopaged.models.moe import SparseMoeBlock


class GroupedMoeBlock(nn.Module):
    """A SparseMoeBlock's forward with the experts grouped in C++; it holds the block (its router,
    its experts' layers, its load counts) unchanged."""

    def __init__(self, block: SparseMoeBlock, describe: Callable) -> None:
        super().__init__()
        self.block = block                              # describe: a linear as C++ runs it (fused.py)
        self.experts = cpu_ops().Experts()
        self.experts.gate_up = [describe(e.gate_up_proj) for e in block.experts]
        self.experts.down = [describe(e.down_proj) for e in block.experts]

    def forward(self, x: torch.Tensor) -> torch.Tensor:    # x: (tokens, hidden)
        weights, chosen = self.block.route(x)
        self.block.count(chosen)
        return self.experts(x, chosen.contiguous(), weights.contiguous())


def group_experts(model: nn.Module, describe: Callable) -> int:
    """Swap every SparseMoeBlock of a loaded model for its grouped form (after quantizing and
    packing the linears, which `describe` hands to C++); how many. Subclasses (tensor parallelism's
    block, which sums over the ranks) keep their own forward."""
    targets = [(name, m) for name, m in model.named_modules() if type(m) is SparseMoeBlock]
    for name, block in targets:
        parent, _, child = name.rpartition(".")
        setattr(model.get_submodule(parent), child, GroupedMoeBlock(block, describe))
    return len(targets)
