"""Which layers each stage holds, and the model one stage builds from the plain one.

The first stage holds the embedding and the head (tied: the one tensor they share, as in the plain
model), the last the final norm: the last stage sends back the normed hidden states of the rows that
sample and the first computes their logits, so a tied head is never held twice. The decoder layers
split into P runs of consecutive layers balanced by weight, not by count (`stage_layers`): the split
whose largest stage (its layers, plus the embedding and head on the first, the norm on the last) is the
smallest, found exactly; on the demo model's shape the first stage takes fewer layers.

A stage's model is the plain model (models/llama.py) built from a config of its own layers only
(`stage_config`), then cut (`keep_stage`); a later stage's hidden states go in as `inputs_embeds`, the
hook a vision model's image rows use. Between stages travels one tensor, (tokens, hidden): Llama's
layers add attention and MLP to it in place (x + attn, x + mlp), so there is no separate residual to
send. docs/09_tensor_parallel.md, "Pipeline parallelism".
"""
from __future__ import annotations

import dataclasses
import re
from functools import cache
from itertools import accumulate
from typing import Callable

import torch
from torch import nn

from nanopaged.models.config import ModelConfig
from nanopaged.models.llama import LlamaForCausalLM, RotaryEmbedding

LAYER_INDEX = re.compile(r"^model\.layers\.(\d+)\.")     # "model.layers.7.mlp...": global layer 7


def stage_layers(layer_weights: list[int], first_extra: int, last_extra: int, num_stages: int) -> list[range]:
    """The global layer indices of each stage, first to last: contiguous runs of at least one layer whose
    largest stage weight is the smallest possible (`first_extra`: the embedding and head, on the first
    stage; `last_extra`: the final norm, on the last). An exact search over the cut points, O(P L^2); among
    splits of the same largest stage, the most even (the stage weights, largest first, compared in turn),
    then the earliest cuts."""
    num_layers = len(layer_weights)
    prefix = [0, *accumulate(layer_weights)]

    def weight(stage: int, start: int, stop: int) -> int:
        extra = (first_extra if stage == 0 else 0) + (last_extra if stage == num_stages - 1 else 0)
        return prefix[stop] - prefix[start] + extra

    @cache
    def best(stage: int, start: int) -> tuple[tuple[int, ...], tuple[int, ...]]:
        """(the stage weights largest first, each stage's stop) for layers [start, L) on stages stage..P-1."""
        if stage == num_stages - 1:
            return (weight(stage, start, num_layers),), (num_layers,)
        options = []
        for stop in range(start + 1, num_layers - (num_stages - 2 - stage)):   # the stages after: a layer each
            rest, stops = best(stage + 1, stop)
            options.append((tuple(sorted((weight(stage, start, stop), *rest), reverse=True)), (stop, *stops)))
        return min(options)

    stops = best(0, 0)[1]
    return [range(start, stop) for start, stop in zip((0, *stops), stops)]


def part_weights(cfg: ModelConfig) -> tuple[list[int], int, int]:
    """(each decoder layer's weights, the embedding's and head's, the final norm's), counted on the plain
    model built on the meta device (no memory); every weight has the model's dtype, so counts split as bytes."""
    model = LlamaForCausalLM.build(cfg, None, 1, torch.device("meta"), torch.float32)
    count = lambda module: sum(p.numel() for p in module.parameters())   # noqa: E731  (a tied head: once)
    layers = [count(layer) for layer in model.model.layers]
    norm = count(model.model.norm)
    return layers, count(model) - sum(layers) - norm, norm


def split_model(cfg: ModelConfig, num_stages: int) -> list[range]:
    """Every stage's layers for the model `cfg` describes (the same on every rank)."""
    return stage_layers(*part_weights(cfg), num_stages)


def stage_config(m: ModelConfig, layers: range) -> ModelConfig:
    """The config of a model holding only `layers`: their count, a mixture's dense layers renumbered
    from the stage's first (DecoderLayer picks its MLP by its index in the stage)."""
    moe = m.moe
    if moe is not None:
        dense = frozenset(i - layers.start for i in moe.dense_layers if i in layers)
        moe = dataclasses.replace(moe, dense_layers=dense)
    return dataclasses.replace(m, num_hidden_layers=len(layers), moe=moe)


def keep_stage(model: nn.Module, first: bool, last: bool) -> nn.Module:
    """Cut a model built on the meta device to what a stage holds (in place): no embedding and head but on
    the first stage, no final norm but on the last (the norm passes the hidden states through unchanged)."""
    if not first:
        model.model.embed_tokens = None
        model.lm_head = None
    if not last:
        model.model.norm = nn.Identity()
    return model


def materialize(model: nn.Module, cfg: ModelConfig, max_len: int, device: torch.device) -> nn.Module:
    """The cut model's parameters on `device`, unset until the weights load; the rotary tables, the only
    buffers (computed, not loaded), made again; a tied head tied again (to_empty gives each module its own)."""
    model.to_empty(device=device)
    if cfg.tie_word_embeddings and model.lm_head is not None:
        model.lm_head.weight = model.model.embed_tokens.weight
    with torch.device(device):
        model.model.rotary = RotaryEmbedding(cfg, max_len)
    return model


def stage_rename(layers: range, first: bool, last: bool) -> Callable[[str], str | None]:
    """The loader's `rename` (models/loader.py): a checkpoint name -> the stage's own, or None for a tensor
    another stage holds. Layer i becomes layer i - first layer; the embedding and the head are the first
    stage's (a tied head is the embedding's tensor, loaded once), the final norm the last's."""
    def rename(name: str) -> str | None:
        match = LAYER_INDEX.match(name)
        if match is not None:
            i = int(match.group(1))
            return f"model.layers.{i - layers.start}.{name[match.end():]}" if i in layers else None
        if name.startswith(("model.embed_tokens.", "lm_head.")):
            return name if first else None
        if name.startswith("model.norm."):
            return name if last else None
        return name
    return rename
