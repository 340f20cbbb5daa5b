"""The LoRA linear: the base layer's output plus each row's adapter update, grouped by adapter.

A step's rows come from many requests, each with its own adapter or none. `LoRALinear` wraps one
of the model's linears (after quantizing and packing, so the base keeps its fast kernel) and holds,
per slot, the update of the adapter loaded there. Its forward is

    y = base(x)
    for each adapter in the step: its rows r   y[r] += B (A x[r]) * scaling

the order PEFT computes in (its `lora.Linear.forward`: the base output first, the update added
in the model's dtype), so float32 output matches Hugging Face with the adapter applied. One adapter's
rows are gathered and multiplied together: the step's work is one pair of small matmuls per adapter,
not per row, and never a per-row copy of A and B (Punica's and S-LoRA's gather would make one:
rows x rank x features each; docs/12_lora.md).

The fused projections hold several of Hugging Face's: qkv_proj is q, k and v. Their A's stack into
one A, so one shrink serves them all; in the reference their B's form one block-diagonal B (a part
the adapter leaves alone has zeros there, adding exactly 0), while the bfloat16 kernel expands each
part the adapter has into its own columns and reads no zero block.

Two kernels for the pair, chosen by the manager (lora/manager.py) from the fast path: nanopaged's
bfloat16 kernel where the linears run on it (each row computed alone: the update keeps batch
invariance), torch's F.linear elsewhere (the reference). Under the fused layer loop the same updates
run in C++ (csrc/decoder.cpp: LoraSlots::add, the same ops), so a step calls no Python per layer.
tests/lora/test_layers.py holds them to each other and to PEFT.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from nanopaged.cpu.linear import CppLinear

# nanopaged's fused projections and the Hugging Face projections they hold, in order
FUSED_PARTS = {"qkv_proj": ("q_proj", "k_proj", "v_proj"), "o_proj": ("o_proj",),
               "gate_up_proj": ("gate_proj", "up_proj"), "down_proj": ("down_proj",)}


@dataclass
class StepAdapters:
    """The step's rows of each adapter: (slot, row indices), set before each forward (lora/manager.py)."""
    groups: list[tuple[int, torch.Tensor]]


@dataclass
class SlotWeights:
    """One adapter's update of one projection, with F.linear: y[rows] += B (A x) * scaling."""
    a: torch.Tensor      # (rank x parts, in_features)
    b: torch.Tensor      # (out_features, rank x parts), block-diagonal over the parts
    scaling: float

    def add_to(self, y: torch.Tensor, x: torch.Tensor, rows: torch.Tensor) -> None:   # x: the rows' inputs
        y.index_add_(0, rows, F.linear(F.linear(x, self.a), self.b) * self.scaling)


@dataclass
class Dpbf16SlotWeights:
    """The same update on nanopaged's bfloat16 kernel (cpu/linear.py: Dpbf16Linear), packed once. Only the
    parts the adapter adapts, each expanded into its own columns: no zero block of B is read."""
    ops: object
    a: torch.Tensor                            # the parts' A, one under the other, each `rank` rows
    rank: int                                  # even: the kernel reads pairs (an odd rank padded with zeros)
    parts: list[tuple[torch.Tensor, int, int]]  # each part's packed B, and its first column and width in y
    scaling: float

    def add_to(self, y: torch.Tensor, x: torch.Tensor, rows: torch.Tensor) -> None:
        shrunk = self.ops.linear_bf16(x, self.a, NO_BIAS, self.rank * len(self.parts))
        for i, (b, start, width) in enumerate(self.parts):
            d = self.ops.linear_bf16(shrunk[:, i * self.rank:(i + 1) * self.rank], b, NO_BIAS, width)
            y[:, start:start + width].index_add_(0, rows, d * self.scaling)


NO_BIAS = torch.empty(0)


class LoRALinear(CppLinear):
    """base(x) plus, for the rows of each adapter in the step, that adapter's update."""

    def __init__(self, base: nn.Module, layer: int, parts: tuple[str, ...], widths: list[int], max_loras: int,
                 step: StepAdapters, device: torch.device, ops=None) -> None:
        super().__init__()
        self.base, self.layer, self.parts, self.step, self.device = base, layer, parts, step, device
        self.in_features, self.out_features = base.in_features, base.out_features
        self.columns = [(sum(widths[:i]), w) for i, w in enumerate(widths)]   # each part's first column, width
        self.ops = ops            # the C++ kernels: the updates run on nanopaged's bfloat16 kernel
        self.slots: list[SlotWeights | Dpbf16SlotWeights | None] = [None] * max_loras
        # the same updates as the fused layer loop holds them (csrc/decoder.h: LoraSlots), when it runs
        self.cpp_slots = ops.LoraSlots(max_loras) if ops is not None else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:      # x: (tokens, in_features)
        y = self.base(x)
        for slot, rows in self.step.groups:
            weights = self.slots[slot]
            if weights is not None:           # None: this adapter leaves the projection as it is
                weights.add_to(y, x.index_select(0, rows), rows)
        return y

    def describe_cpp(self, describe):
        """To the fused layer loop: the base layer, with the updates beside it where they run in C++;
        else None (called back in Python, F.linear's updates)."""
        if self.cpp_slots is None:
            return None
        lin = describe(self.base)
        lin.lora = self.cpp_slots
        return lin

    def load(self, slot: int, adapter) -> None:
        """Put the adapter's update of this projection (if it has one) into `slot`."""
        pairs = [adapter.weights.get((self.layer, part)) for part in self.parts]   # None: a part left alone
        self.slots[slot] = self.slot_weights(pairs, adapter.rank, adapter.scaling) if any(pairs) else None
        if self.cpp_slots is not None:
            w = self.slots[slot]
            self.cpp_slots.set(slot, *((w.a, w.rank, w.scaling, w.parts) if w else (NO_BIAS, 0, 0.0, [])))

    def slot_weights(self, pairs, rank: int, scaling: float):
        pairs = [p and (p[0].to(self.device), p[1].to(self.device)) for p in pairs]
        if self.ops is None:          # the reference: one A, one block-diagonal B, zeros for a part left alone
            dtype = next(p for p in pairs if p)[0].dtype
            zeros = lambda *shape: torch.zeros(*shape, dtype=dtype, device=self.device)   # noqa: E731
            a = torch.cat([p[0] if p else zeros(rank, self.in_features) for p in pairs])
            b = torch.block_diag(*[p[1] if p else zeros(width, rank) for p, (_, width) in zip(pairs, self.columns)])
            return SlotWeights(a, b, scaling)
        # nanopaged's kernel reads pairs of values: an odd rank gets a zero row of A and a zero column of B
        pad, present = rank % 2, [(p, column) for p, column in zip(pairs, self.columns) if p]
        a = self.ops.pack_bf16_weight(torch.cat([F.pad(p[0], (0, 0, 0, pad)) for p, _ in present]))
        parts = [(self.ops.pack_bf16_weight(F.pad(p[1], (0, pad))), start, width) for p, (start, width) in present]
        return Dpbf16SlotWeights(self.ops, a, rank + pad, parts, scaling)


def wrap_linears(model: nn.Module, max_loras: int, step: StepAdapters, device: torch.device,
                 ops=None) -> list[LoRALinear]:
    """Wrap every decoder layer's projections (the fused ones too) in a LoRALinear; the wrappers. `ops`: the
    C++ kernels, where the updates run on nanopaged's bfloat16 kernel (lora/manager.py decides)."""
    wrapped = []
    for i, layer in enumerate(model.model.layers):
        for owner in (layer.self_attn, layer.mlp):
            for name, parts in FUSED_PARTS.items():
                if hasattr(owner, name):
                    base = getattr(owner, name)
                    lora = LoRALinear(base, i, parts, part_widths(owner, name, base), max_loras, step, device, ops)
                    setattr(owner, name, lora)
                    wrapped.append(lora)
    return wrapped


def part_widths(owner: nn.Module, name: str, linear: nn.Module) -> list[int]:
    """The output widths of the Hugging Face projections a fused one holds, from the model's own
    layers (the attention's split of q, k and v; gate and up are equal halves)."""
    if name == "qkv_proj":
        return [owner.q_size, owner.kv_size, owner.kv_size]
    if name == "gate_up_proj":
        return [linear.out_features // 2] * 2
    return [linear.out_features]
