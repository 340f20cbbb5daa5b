"""Each rank reads only its own slices of the safetensors files.

safetensors maps a file into memory and `safe_open(...).get_slice(name)[a:b]` copies out only
rows a..b (or columns, `[:, a:b]`), so a rank never holds a whole weight, let alone the whole
model (vLLM's weight loaders narrow each tensor the same way: `weight_loader` in
vllm/model_executor/layers/linear.py). Where a tensor goes is the plain loader's rule
(models/loader.py: q/k/v and gate/up into their slice of the fused weight); which slice to
read is the layer's `tp_dim` (layers.py):

    tp_dim 0   rows  [r * n, (r + 1) * n)   column-parallel weights and biases, vocab rows,
                                            OLMoE's q/k norms
    tp_dim 1   cols  [r * n, (r + 1) * n)   row-parallel weights
    none       the whole tensor             norms, a MoE router: every rank holds a copy;
                                            an expert under expert parallelism: one rank holds it

An expert's gate_proj, up_proj and down_proj are cut as a dense MLP's are (experts stored one
by one, as they ship; Mixtral's w1/w3/w2 are renamed first, as the plain loader does). Under
expert parallelism (ExpertParallelMoeBlock) a rank reads only its own experts, whole, and renames
expert e to its local index e - r E/N (`own_experts`); it never opens another rank's.
"""
from __future__ import annotations

import re
from pathlib import Path

import torch
from torch import nn

from nanopaged.extras.tensor_parallel.layers import ExpertParallelMoeBlock
from nanopaged.models.loader import PACKED, RENAMED, STACKED_EXPERTS, load_weights

EXPERT_INDEX = re.compile(r"\.experts\.(\d+)\.")    # "...mlp.experts.5.up_proj.weight": expert 5


def load_shard(model: nn.Module, folder: str | Path, rank: int, rename_first=None) -> None:
    """Fill a `parallelize`d model with rank `rank`'s slices; every parameter exactly once
    (the plain loader's loop and checks, reading slices instead of whole tensors). `rename_first`: a
    pipeline stage's renaming of the checkpoint's names (its own layers only), applied first."""
    experts = own_experts(model)
    rename = experts if rename_first is None else lambda name: (n := rename_first(name)) and experts(n)

    def read(f, name: str) -> torch.Tensor:
        return read_shard(f.get_slice(name), *shard_of(model, rename(name)), rank)
    load_weights(model, folder, read, rename)


def own_experts(model: nn.Module):
    """The loader's `rename`: checkpoint expert e -> this rank's expert e - first, None for another rank's
    expert; every other name as it is (and every name, without expert parallelism)."""
    block = next((m for m in model.modules() if isinstance(m, ExpertParallelMoeBlock)), None)
    if block is None:
        return lambda name: name
    first, count = block.first_expert, len(block.experts)      # the same in every MoE layer

    def rename(name: str) -> str | None:
        match = EXPERT_INDEX.search(name)
        if match is None:
            return name
        local = int(match.group(1)) - first
        return name[:match.start(1)] + str(local) + name[match.end(1):] if 0 <= local < count else None
    return rename


def shard_of(model: nn.Module, name: str) -> tuple[int | None, int]:
    """(axis to cut, rows or columns per rank) for a checkpoint tensor; (None, 0): read it whole."""
    parts = [RENAMED.get(part, part) for part in name.split(".")]   # the model's names for Mixtral's
    if parts[-2:-1] == ["experts"] and parts[-1] in STACKED_EXPERTS:
        raise ValueError(f"{name}: tensor parallelism reads a mixture's experts stored one by one; this checkpoint "
                         "stacks them in one tensor (load it with tensor_parallel_size=1)")
    try:
        for i, part in enumerate(parts):
            if part in PACKED:   # q_proj -> its width inside this rank's qkv_proj
                fused, shard = PACKED[part]
                module = model.get_submodule(".".join(parts[:i] + [fused]))
                if getattr(module, "tp_dim", None) is None:
                    return None, 0   # held whole: an expert under expert parallelism
                return 0, module.shard_sizes[shard]
        module = model.get_submodule(".".join(parts[:-1]))
    except AttributeError:
        return None, 0           # not in the model: the plain loader names the tensor in its error
    dim = getattr(module, "tp_dim", None)
    if dim is None or (parts[-1] != "weight" and dim != 0):
        return None, 0
    return dim, getattr(module, parts[-1]).shape[dim]


def read_shard(tensor_slice, dim: int | None, length: int, rank: int) -> torch.Tensor:
    """Rank `rank`'s `length` rows (dim 0) or columns (dim 1), zero-padded past the end
    (the vocabulary's last rows when N does not divide it)."""
    if dim is None:
        return tensor_slice[:]
    full = tensor_slice.get_shape()[dim]
    start = min(rank * length, full)
    end = min(start + length, full)
    part = tensor_slice[start:end] if dim == 0 else tensor_slice[:, start:end]
    if end - start < length:
        shape = list(part.shape)
        shape[dim] = length - (end - start)
        part = torch.cat([part, part.new_zeros(shape)], dim=dim)
    return part
