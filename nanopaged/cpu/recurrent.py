"""A hybrid model's decode step in C++: one token of each request's linear layers, in place on its page.

The references (models/gated_delta_rule.py: paged_recurrent_step, models/mamba2.py: paged_ssd_step) gather
the states, run the recurrence as torch ops and scatter them back; these call csrc/recurrent.cpp, which reads
and writes each (request, head) state once, each alone (a row's result is its own at any batch). Same
signature, same inputs: the rule's q, k and v are normalised here exactly as the reference does it first.
Chosen by cpu/choose.py (FastPath.state_steps) and handed to the model when it is built.
"""
from __future__ import annotations

import torch

from nanopaged.cpu.build import cpu_ops
from nanopaged.models import gated_delta_rule as rule


def gated_delta_step(q, k, v, g, beta, pages: torch.Tensor, index: torch.Tensor, fresh: torch.Tensor) -> torch.Tensor:
    q, k, v, g, beta = (x.contiguous() for x in rule.prepare(q, k, v, g, beta))
    return cpu_ops().gated_delta_step(q, k, v, g, beta, pages, index, fresh)


def conv_step(x, weight, bias, pages: torch.Tensor, index: torch.Tensor, fresh: torch.Tensor) -> torch.Tensor:
    """Both families' short convolution and its SiLU (float32 out; Qwen3.5's reference rounds to bfloat16 first)."""
    bias = bias.float() if bias is not None else torch.empty(0)
    return cpu_ops().conv_step(x.float().contiguous(), weight.float().contiguous(), bias, pages, index, fresh)


def ssd_step(x, dt, A, B, C, D, pages: torch.Tensor, index: torch.Tensor, fresh: torch.Tensor) -> torch.Tensor:
    return cpu_ops().ssd_step(*(t.float().contiguous() for t in (x, dt, A, B, C, D)), pages, index, fresh)


# what a hybrid's layers take as `steps` (models/qwen3_5.py, models/granite_hybrid.py)
STATE_STEPS = {"conv": conv_step, "gated_delta": gated_delta_step, "ssd": ssd_step}
