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

The fused projections hold several of Hugging Face's: qkv_proj is q, k and v. Their updates stack
into one A (the parts' A's one under the other) and one block-diagonal B, so a fused projection
also costs one pair of matmuls; a part the adapter leaves alone has zeros there, adding exactly 0.

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

# nanopaged's fused projections and the Hugging Face projections they hold, in order
FUSED_PARTS = {"qkv_proj": ("q_proj", "k_proj", "v_proj"), "o_proj": ("o_proj",),
               "gate_up_proj": ("gate_proj", "up_proj"), "down_proj": ("down_proj",)}


@dataclass
class StepAdapters:
    """The step's rows of each adapter: (slot, row indices), set before each forward (lora/manager.py)."""
    groups: list[tuple[int, torch.Tensor]]


@dataclass
class SlotWeights:
    """One adapter's update of one projection: x -> B (A x) * scaling, with F.linear."""
    a: torch.Tensor      # (rank x parts, in_features)
    b: torch.Tensor      # (out_features, rank x parts), block-diagonal over the parts
    scaling: float

    def update(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(F.linear(x, self.a), self.b) * self.scaling


@dataclass
class Dpbf16SlotWeights:
    """The same update on nanopaged's bfloat16 kernel (cpu/linear.py: Dpbf16Linear), A and B packed once."""
    ops: object
    a: torch.Tensor
    b: torch.Tensor
    a_rows: int
    out_features: int
    scaling: float

    def update(self, x: torch.Tensor) -> torch.Tensor:
        shrunk = self.ops.linear_bf16(x, self.a, NO_BIAS, self.a_rows)
        return self.ops.linear_bf16(shrunk, self.b, NO_BIAS, self.out_features) * self.scaling


NO_BIAS = torch.empty(0)


class LoRALinear(nn.Module):
    """base(x) plus, for the rows of each adapter in the step, that adapter's update."""

    def __init__(self, base: nn.Module, layer: int, parts: tuple[str, ...], max_loras: int, step: StepAdapters,
                 device: torch.device, ops=None) -> None:
        super().__init__()
        self.base, self.layer, self.parts, self.step, self.device = base, layer, parts, step, device
        self.in_features, self.out_features = base.in_features, base.out_features
        self.shard_sizes = getattr(base, "shard_sizes", None)
        self.ops = ops            # the C++ kernels: the updates run on nanopaged's bfloat16 kernel
        self.slots: list[SlotWeights | Dpbf16SlotWeights | None] = [None] * max_loras
        # the same updates as the fused layer loop holds them (csrc/decoder.h: LoraSlots), when it runs
        self.cpp_slots = ops.LoraSlots(max_loras) if ops is not None else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:      # x: (tokens, in_features)
        y = self.base(x)
        for slot, rows in self.step.groups:
            weights = self.slots[slot]
            if weights is not None:           # None: this adapter leaves the projection as it is
                y.index_add_(0, rows, weights.update(x.index_select(0, rows)))
        return y

    def load(self, slot: int, adapter) -> None:
        """Put the adapter's update of this projection (if it has one) into `slot`."""
        pairs = [adapter.weights.get((self.layer, part)) for part in self.parts]
        present = [p for p in pairs if p is not None]
        self.slots[slot] = None
        if present:
            dtype, widths = present[0][0].dtype, self.shard_sizes or [self.out_features]
            a = torch.cat([p[0] if p else torch.zeros(adapter.rank, self.in_features, dtype=dtype) for p in pairs])
            b = torch.block_diag(*[p[1] if p else torch.zeros(w, adapter.rank, dtype=dtype)
                                   for p, w in zip(pairs, widths)])
            self.slots[slot] = self.slot_weights(a.to(self.device), b.to(self.device), adapter.scaling)
        if self.cpp_slots is not None:
            w = self.slots[slot]
            self.cpp_slots.set(slot, *((w.a, w.b, w.a_rows, w.scaling) if w else (NO_BIAS, NO_BIAS, 0, 0.0)))

    def slot_weights(self, a: torch.Tensor, b: torch.Tensor, scaling: float):
        """On nanopaged's bfloat16 kernel, A and B packed, the rank padded to an even depth with a zero row
        of A and a zero column of B (it reads pairs of values; a zero adds exactly nothing); else F.linear."""
        if self.ops is None:
            return SlotWeights(a, b, scaling)
        if a.shape[0] % 2:
            a, b = F.pad(a, (0, 0, 0, 1)), F.pad(b, (0, 1))
        return Dpbf16SlotWeights(self.ops, self.ops.pack_bf16_weight(a), self.ops.pack_bf16_weight(b), a.shape[0],
                                 b.shape[0], scaling)


def wrap_linears(model: nn.Module, max_loras: int, step: StepAdapters, device: torch.device,
                 ops=None) -> list[LoRALinear]:
    """Wrap every decoder layer's projections (the fused ones too) in a LoRALinear; the wrappers. `ops`: the
    C++ kernels, where the updates run on nanopaged's bfloat16 kernel (lora/manager.py decides)."""
    wrapped = []
    for i, layer in enumerate(model.model.layers):
        for owner in (layer.self_attn, layer.mlp):
            for name, parts in FUSED_PARTS.items():
                if hasattr(owner, name):
                    lora = LoRALinear(getattr(owner, name), i, parts, max_loras, step, device, ops)
                    setattr(owner, name, lora)
                    wrapped.append(lora)
    return wrapped
