"""The CPU fast paths for linear layers: bfloat16 weights packed once for a matrix-unit kernel.

`nn.Linear` (F.linear) is the reference. A kernel on the CPU's bfloat16 units reads a weight
fastest in a layout of its own; laying it out for every call would cost more than it saves, so
it happens once, after loading, and the packed weight replaces the plain one. The layers are
swapped in place, as tensor parallelism swaps its own, so models/llama.py has no branch for it.
Three kernels, chosen by the CPU's flags as measured (docs/05, "bfloat16 on the matrix units"):

    packed   oneDNN's kernel (AMX tiles where the CPU has them): `torch.ops.mkldnn.
             _reorder_linear_weight` packs a weight and `_linear_pointwise` multiplies by it (what
             torch.compile's CPU backend emits for a frozen bfloat16 linear). Private to torch:
             tests/cpu/test_linear.py pins that they exist and still equal F.linear.
    dpbf16   nanopaged's own (nanopaged/cpu/csrc/linear_bf16.cpp: linear_bf16), on AVX512-BF16's
             dot-product instruction: on a CPU with it and without AMX (AMD Zen 4) it ran a decode
             step's matmuls faster than oneDNN's at every row count measured.
    amx      nanopaged's own (nanopaged/cpu/csrc/linear_amx.cpp: linear_amx), on AMX's bfloat16 tiles:
             as fast as oneDNN's where measured, and each row's sums in an order of its own, which
             oneDNN's blocking does not promise (its lm_head's rows changed with the step's size).
"""
from __future__ import annotations

import logging

import torch
from torch import nn

from nanopaged.cpu.build import cpu_ops

logger = logging.getLogger(__name__)


def packed_ops_available() -> bool:
    mkldnn = torch.ops.mkldnn
    return (torch.backends.mkldnn.is_available() and hasattr(mkldnn, "_reorder_linear_weight")
            and hasattr(mkldnn, "_linear_pointwise"))


class CppLinear(nn.Module):
    """A linear layer that the fused layer loop (fused.py) can run in C++: it describes itself
    (csrc/decoder.h: struct Linear), or returns None to be called back in Python."""

    def describe_cpp(self, describe):
        """`describe`: fused.py's, for a layer this one wraps."""
        raise NotImplementedError


class PackedLinear(nn.Module):
    """y = x W^T + b with W packed for oneDNN. Only for inference: the packed weight is an
    opaque oneDNN tensor, not a Parameter, and nothing can be trained or saved through it."""

    def __init__(self, linear: nn.Linear) -> None:
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.packed_weight = torch.ops.mkldnn._reorder_linear_weight(linear.weight.detach(), None)
        self.bias = None if linear.bias is None else linear.bias.detach()

    def forward(self, x: torch.Tensor) -> torch.Tensor:   # x: (tokens, in_features)
        return torch.ops.mkldnn._linear_pointwise(x, self.packed_weight, self.bias, "none", [], "")


class Dpbf16Linear(CppLinear):
    """y = x W^T + b on AVX512-BF16's dot-product instruction, W packed once for it (inference only)."""

    def __init__(self, linear: nn.Linear) -> None:
        super().__init__()
        self.ops = cpu_ops()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.packed_weight = self.ops.pack_bf16_weight(linear.weight.detach())
        self.bias = torch.empty(0) if linear.bias is None else linear.bias.detach()

    def forward(self, x: torch.Tensor) -> torch.Tensor:   # x: (tokens, in_features)
        return self.ops.linear_bf16(x, self.packed_weight, self.bias, self.out_features)

    def describe_cpp(self, describe):
        lin = self.ops.Linear()
        lin.out_features, lin.kind = self.out_features, self.ops.LinearKind.DPBF16
        lin.packed, lin.bias = self.packed_weight, self.bias
        return lin


class AmxLinear(CppLinear):
    """y = x W^T + b on AMX's bfloat16 tiles, W packed once for them, each row's sums in an order of
    its own (nanopaged/cpu/csrc/linear_amx.cpp; inference only)."""

    def __init__(self, linear: nn.Linear) -> None:
        super().__init__()
        self.ops = cpu_ops()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.packed_weight = self.ops.pack_amx_weight(linear.weight.detach())
        self.bias = torch.empty(0) if linear.bias is None else linear.bias.detach()

    def forward(self, x: torch.Tensor) -> torch.Tensor:   # x: (tokens, in_features)
        return self.ops.linear_amx(x, self.packed_weight, self.bias, self.out_features)

    def describe_cpp(self, describe):
        lin = self.ops.Linear()
        lin.out_features, lin.kind = self.out_features, self.ops.LinearKind.AMX
        lin.packed, lin.bias = self.packed_weight, self.bias
        return lin


KERNELS = {"packed": PackedLinear, "dpbf16": Dpbf16Linear, "amx": AmxLinear}


def pack_linears(model: nn.Module, kernel: str = "packed") -> int:
    """Swap every plain nn.Linear of a bfloat16 CPU model for the `kernel`'s layer (KERNELS); how
    many were swapped. Subclasses (tensor parallelism's layers) keep their own forward."""
    if kernel == "packed" and not packed_ops_available():
        logger.warning("cpu_linear='packed': this torch has no oneDNN packed linear; using F.linear")
        return 0
    # names, not modules: each plain weight is freed as soon as its packed copy replaces it (a 7B mixture of
    # experts holding both would need twice its size)
    targets = [name for name, m in model.named_modules() if type(m) is nn.Linear]
    for name in targets:
        parent_name, _, child = name.rpartition(".")
        parent = model.get_submodule(parent_name)
        setattr(parent, child, layer_for(kernel, getattr(parent, child)))
    return len(targets)


def layer_for(kernel: str, linear: nn.Linear) -> nn.Module:
    """`kernel`'s layer for `linear`. amx reads whole steps of 32 inputs: a weight of another width
    runs on dpbf16 (every AMX-BF16 CPU has AVX512-BF16; it computes each row alone too)."""
    if kernel == "amx" and linear.in_features % 32:
        kernel = "dpbf16"
    return KERNELS[kernel](linear)
