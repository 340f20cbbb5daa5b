"""Which layers each stage holds, and the model one stage builds from the plain one.

The decoder layers split into P runs of consecutive layers (vLLM's split, get_pp_indices in
vllm/distributed/utils.py): L // P each, and the L % P left over one more each to the stages just before
the last, since the last also holds the final norm and the head. 30 layers on 4 stages: 7, 8, 8, 7.

A stage's model is the plain model (models/llama.py) built from a config of its own layers only
(`stage_config`), then cut (`keep_stage`): the first stage keeps the embedding, the last the final norm
and the head, the others neither; a middle stage's hidden states go in as `inputs_embeds`, the hook a
vision model's image rows use. A tied head (SmolLM2's) is the last stage's own copy of the embedding,
loaded from it (`stage_rename`). Between stages travels one tensor, (tokens, hidden): Llama's layers
add attention and MLP to it in place (x + attn, x + mlp), so there is no separate residual to send.
"""
from __future__ import annotations

import dataclasses
import re
from typing import Callable

import torch
from torch import nn

from nanopaged.models.config import ModelConfig
from nanopaged.models.llama import RotaryEmbedding

LAYER_INDEX = re.compile(r"^model\.layers\.(\d+)\.")     # "model.layers.7.mlp...": global layer 7


def stage_layers(num_layers: int, num_stages: int) -> list[range]:
    """The global layer indices of each stage, first to last."""
    sizes = [num_layers // num_stages] * num_stages
    for i in range(num_layers % num_stages):
        sizes[-(i + 2)] += 1                # the stages before the last take the remainder
    starts = [sum(sizes[:s]) for s in range(num_stages)]
    return [range(start, start + size) for start, size in zip(starts, sizes)]


def stage_config(m: ModelConfig, layers: range) -> ModelConfig:
    """The config of a model holding only `layers`: their count, a mixture's dense layers renumbered
    from the stage's first (DecoderLayer picks its MLP by its index in the stage)."""
    moe = m.moe
    if moe is not None:
        dense = frozenset(i - layers.start for i in moe.dense_layers if i in layers)
        moe = dataclasses.replace(moe, dense_layers=dense)
    return dataclasses.replace(m, num_hidden_layers=len(layers), moe=moe)


def keep_stage(model: nn.Module, first: bool, last: bool) -> nn.Module:
    """Cut a model built on the meta device to what a stage holds (in place): no embedding but on the first
    stage, no final norm and head but on the last (the norm passes the hidden states through unchanged)."""
    if not first:
        model.model.embed_tokens = None      # a tied head keeps the parameter the two shared
    if not last:
        model.model.norm = nn.Identity()
        model.lm_head = None
    return model


def materialize(model: nn.Module, cfg: ModelConfig, max_len: int, device: torch.device) -> nn.Module:
    """The cut model's parameters on `device`, unset until the weights load; the rotary tables, the only
    buffers (computed, not loaded), made again."""
    model.to_empty(device=device)
    with torch.device(device):
        model.model.rotary = RotaryEmbedding(cfg, max_len)
    return model


def stage_rename(layers: range, first: bool, last: bool, tied: bool) -> Callable[[str], str | None]:
    """The loader's `rename` (models/loader.py): a checkpoint name -> the stage's own, or None for a tensor
    another stage holds. Layer i becomes layer i - first layer; a tied head loads the embedding."""
    def rename(name: str) -> str | None:
        match = LAYER_INDEX.match(name)
        if match is not None:
            i = int(match.group(1))
            return f"model.layers.{i - layers.start}.{name[match.end():]}" if i in layers else None
        if name.startswith("model.embed_tokens."):
            return name if first else "lm_head." + name.removeprefix("model.embed_tokens.") if last and tied else None
        if name.startswith(("model.norm.", "lm_head.")):
            return name if last else None
        return name
    return rename
