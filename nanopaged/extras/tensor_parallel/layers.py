"""Megatron-style parallel layers, and the one function that puts them into a built model.

A transformer layer has two matmul pairs, and Megatron-LM splits each pair so that only one
all-reduce follows it (the paper's section 4.6; vLLM: vllm/model_executor/layers/linear.py,
vocab_parallel_embedding.py):

    qkv_proj, gate_up_proj   column-parallel: rank r keeps the output features of its heads
                             (its share of the MLP); it needs no input from the other ranks
    o_proj, down_proj        row-parallel: rank r keeps the input features that match, so its
                             product is a partial sum; an all-reduce adds the N partial sums
    embed_tokens, lm_head    vocab-parallel: rank r keeps rows [r * V/N, (r + 1) * V/N) of the
                             vocabulary; the embedding all-reduces (one rank holds each token's
                             row, the others add zeros), the head gathers logits on rank 0

Each rank's model is built from a config with 1/N of the heads, KV heads, MLP width and
vocabulary (`rank_config`), so the plain nn.Linear layers already have a rank's shapes;
`parallelize` swaps in the classes below, which add the communication and say along which
axis (`tp_dim`) the shard loader cuts the checkpoint. models/llama.py itself has no branch.
"""
from __future__ import annotations

import dataclasses

import torch
import torch.nn.functional as F
from torch import nn

from nanopaged.core.block_pool import cdiv
from nanopaged.extras.tensor_parallel.parallel_state import RankGroup
from nanopaged.models.config import ModelConfig


def rank_config(m: ModelConfig, world_size: int) -> ModelConfig:
    """The model one rank builds: 1/N of the heads, KV heads and MLP width (the config checked
    that N divides them), and ceil(V / N) rows of the vocabulary (the last rank's tail is padding)."""
    return dataclasses.replace(
        m, num_attention_heads=m.num_attention_heads // world_size,
        num_key_value_heads=m.num_key_value_heads // world_size,
        intermediate_size=m.intermediate_size // world_size,
        vocab_size=cdiv(m.vocab_size, world_size))


class ColumnParallelLinear(nn.Linear):
    """Y_r = X A_r: this rank's output features only (vLLM: ColumnParallelLinear, no gather)."""
    tp_dim = 0        # the checkpoint's weight (out, in) is cut along the output axis


class RowParallelLinear(nn.Linear):
    """Y = sum_r X_r A_r: this rank's input features, then an all-reduce (vLLM: RowParallelLinear)."""
    tp_dim = 1        # cut along the input axis

    def __init__(self, in_features: int, out_features: int, group: RankGroup) -> None:
        super().__init__(in_features, out_features, bias=False)   # a bias would be added N times
        self.group = group

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.group.all_reduce(F.linear(x, self.weight))


class VocabParallelEmbedding(nn.Embedding):
    """Rows [start, start + V/N) of the embedding; a token outside them looks up zeros."""
    tp_dim = 0

    def __init__(self, rows: int, dim: int, group: RankGroup) -> None:
        super().__init__(rows, dim)
        self.group, self.vocab_start = group, group.rank * rows

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        local = input_ids - self.vocab_start
        outside = (local < 0) | (local >= self.num_embeddings)
        x = F.embedding(local.masked_fill(outside, 0), self.weight)          # (tokens, hidden)
        return self.group.all_reduce(x.masked_fill(outside[:, None], 0))   # exact: one term is non-zero


class ParallelLMHead(nn.Linear):
    """Logits for this rank's rows of the vocabulary, gathered on rank 0 (vLLM: ParallelLMHead and
    LogitsProcessor's gather); the padding past vocab_size is cut off there. None on other ranks."""
    tp_dim = 0

    def __init__(self, dim: int, rows: int, vocab_size: int, group: RankGroup) -> None:
        super().__init__(dim, rows, bias=False)
        self.group, self.vocab_size = group, vocab_size

    def forward(self, hidden: torch.Tensor) -> torch.Tensor | None:
        logits = self.group.gather_to_driver(F.linear(hidden, self.weight))   # (rows, N * V/N) on rank 0
        return None if logits is None else logits[:, :self.vocab_size]


def parallelize(model: nn.Module, full: ModelConfig, group: RankGroup) -> None:
    """Swap the plain layers of a model built from `rank_config` for the parallel ones, in place.
    Each new layer adopts the old one's parameters (same shapes), so nothing is allocated twice;
    the weights are loaded afterwards."""
    for layer in model.model.layers:
        attn, mlp = layer.self_attn, layer.mlp
        for owner, name in ((attn, "qkv_proj"), (mlp, "gate_up_proj")):
            old = getattr(owner, name)
            new = _adopt(old, ColumnParallelLinear, old.in_features, old.out_features, old.bias is not None)
            new.shard_sizes = old.shard_sizes    # this rank's q/k/v (gate/up) widths, read by the loaders
            setattr(owner, name, new)
        for owner, name in ((attn, "o_proj"), (mlp, "down_proj")):
            old = getattr(owner, name)
            setattr(owner, name, _adopt(old, RowParallelLinear, old.in_features, old.out_features, group))
    embed, head = model.model.embed_tokens, model.lm_head
    model.model.embed_tokens = _adopt(embed, VocabParallelEmbedding, embed.num_embeddings, embed.embedding_dim, group)
    model.lm_head = _adopt(head, ParallelLMHead, head.in_features, head.out_features, full.vocab_size, group)
    if full.tie_word_embeddings:              # both hold the same rows of the same matrix
        model.lm_head.weight = model.model.embed_tokens.weight


def _adopt(old: nn.Module, cls: type[nn.Module], *args) -> nn.Module:
    """A `cls` built on the meta device (no memory) that takes over `old`'s parameters."""
    with torch.device("meta"):
        new = cls(*args)
    for name, param in old.named_parameters(recurse=False):
        setattr(new, name, param)
    return new
