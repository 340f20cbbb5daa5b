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
    experts                  each expert split like a dense MLP, its down_proj not reduced; the
                             router replicated, and one all-reduce of the block's sum (vLLM's FusedMoE);
                             or, with enable_expert_parallel, E/N whole experts a rank, the same one
                             all-reduce (ExpertParallelMoeBlock)

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
from nanopaged.models.llama import RMSNorm
from nanopaged.models.moe import MoEConfig, SparseMoeBlock


def rank_config(m: ModelConfig, world_size: int, expert_parallel: bool = False) -> ModelConfig:
    """The model one rank builds: 1/N of the heads, KV heads, MLP width and every expert's width
    (the config checked that N divides them), and ceil(V / N) rows of the vocabulary (the last
    rank's tail is padding). Every rank keeps every expert, only their widths split; with expert
    parallelism a rank builds its E/N experts at full width instead, never all E (parallelize gives
    it the router over all E)."""
    moe = m.moe
    if moe is not None and expert_parallel:
        moe = dataclasses.replace(moe, num_experts=moe.num_experts // world_size)
    elif moe is not None:
        moe = dataclasses.replace(moe, intermediate_size=moe.intermediate_size // world_size)
    return dataclasses.replace(
        m, num_attention_heads=m.num_attention_heads // world_size,
        num_key_value_heads=m.num_key_value_heads // world_size,
        intermediate_size=m.intermediate_size // world_size,
        vocab_size=cdiv(m.vocab_size, world_size), moe=moe)


class ColumnParallelLinear(nn.Linear):
    """Y_r = X A_r: this rank's output features only (vLLM: ColumnParallelLinear, no gather)."""
    tp_dim = 0        # the checkpoint's weight (out, in) is cut along the output axis


class RowParallelLinear(nn.Linear):
    """Y = sum_r X_r A_r: this rank's input features, then an all-reduce (vLLM: RowParallelLinear).
    An expert's down_proj skips it (reduce_results=False): its block all-reduces the sum of its experts."""
    tp_dim = 1        # cut along the input axis

    def __init__(self, in_features: int, out_features: int, group: RankGroup, reduce_results: bool = True) -> None:
        super().__init__(in_features, out_features, bias=False)   # a bias would be added N times
        self.group, self.reduce_results = group, reduce_results

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = F.linear(x, self.weight)
        return self.group.all_reduce(y) if self.reduce_results else y


class ParallelSparseMoeBlock(SparseMoeBlock):
    """A mixture of experts whose every expert holds 1/N of its width: each rank's weighted sum over
    the chosen experts is a partial sum, and one all-reduce adds them, not one per expert (vLLM:
    FusedMoE's reduce_results). The router and its input are the same on every rank, so every rank
    runs the same experts and no collective depends on the routing."""

    def __init__(self, hidden: int, moe: MoEConfig, group: RankGroup) -> None:
        super().__init__(hidden, moe)
        self.group = group

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.group.all_reduce(super().forward(x))


class ExpertParallelMoeBlock(SparseMoeBlock):
    """Expert parallelism (vLLM's enable_expert_parallel): rank r holds experts [r E/N, (r + 1) E/N)
    whole. The router is replicated and, under tensor parallelism, so is every token's hidden state,
    so every rank routes every token alike (global expert ids, counted on every rank); each rank runs
    only its own experts on the tokens that chose them, and the block's one all-reduce sums the ranks
    (every rank calls it, chosen or not: no collective depends on the routing). That is the "all-gather
    + reduce" form of expert parallelism: the all-gather is already done (every rank holds every token),
    so no all-to-all dispatches tokens (gloo has none that would help)."""

    def __init__(self, hidden: int, moe: MoEConfig, group: RankGroup) -> None:
        super().__init__(hidden, moe)       # built on the meta device; the rank's experts are adopted
        self.group = group
        self.first_expert = group.rank * (moe.num_experts // group.world_size)

    def forward(self, x: torch.Tensor) -> torch.Tensor:              # x: (tokens, hidden), every token
        weights, chosen = self.route(x)
        self.count(chosen)
        out = torch.zeros_like(x)
        mine = range(self.first_expert, self.first_expert + len(self.experts))
        for expert in chosen.unique().tolist():                      # ascending, as SparseMoeBlock adds them
            if expert not in mine:
                continue                                             # another rank adds it
            token, k = torch.where(chosen == expert)
            y = self.experts[expert - self.first_expert](x[token]) * weights[token, k, None]
            out.index_add_(0, token, y.to(x.dtype))
        return self.group.all_reduce(out)


class ParallelProjectionRMSNorm(RMSNorm):
    """OLMoE's q/k RMSNorm over the whole projection, when each rank holds only its heads' part:
    the mean square is over every rank's part, so the ranks all-reduce their sums of squares
    (vLLM all-gathers q and k instead; this keeps the weight sharded and sends one value a token)."""
    tp_dim = 0

    def __init__(self, dim: int, eps: float, full_dim: int, group: RankGroup) -> None:
        super().__init__(dim, eps)
        self.full_dim, self.group = full_dim, group

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        x = x.float()
        mean_square = self.group.all_reduce(x.pow(2).sum(-1, keepdim=True)) / self.full_dim
        return self.weight * (x * torch.rsqrt(mean_square + self.eps)).to(dtype)


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


def parallelize(model: nn.Module, full: ModelConfig, group: RankGroup, expert_parallel: bool = False) -> None:
    """Swap the plain layers of a model built from `rank_config` for the parallel ones, in place.
    Each new layer adopts the old one's parameters (same shapes), so nothing is allocated twice
    (but a router over all experts, under expert parallelism); the weights are loaded afterwards."""
    for layer in model.model.layers:
        _split_pair(layer.self_attn, "qkv_proj", "o_proj", group)
        if layer.self_attn.qk_norm == "projection":
            _split_projection_norms(layer.self_attn, group)
        if isinstance(layer.mlp, SparseMoeBlock) and expert_parallel:
            layer.mlp = _place_experts(layer.mlp, full.moe, group)
        elif isinstance(layer.mlp, SparseMoeBlock):
            layer.mlp = _split_experts(layer.mlp, group)
        else:                                 # a dense model, or a MoE model's dense layer
            _split_pair(layer.mlp, "gate_up_proj", "down_proj", group)
    embed, head = model.model.embed_tokens, model.lm_head     # None on a pipeline stage that lacks one
    if embed is not None:
        model.model.embed_tokens = _adopt(embed, VocabParallelEmbedding, embed.num_embeddings, embed.embedding_dim,
                                          group)
    if head is not None:
        model.lm_head = _adopt(head, ParallelLMHead, head.in_features, head.out_features, full.vocab_size, group)
    if full.tie_word_embeddings and embed is not None and head is not None:   # the same rows of the same matrix
        model.lm_head.weight = model.model.embed_tokens.weight


def _split_pair(owner: nn.Module, column: str, row: str, group: RankGroup, reduce_results: bool = True) -> None:
    """Megatron's pair: `column` (qkv_proj, gate_up_proj) column-parallel, `row` (o_proj,
    down_proj) row-parallel, in place on `owner`."""
    old = getattr(owner, column)
    new = _adopt(old, ColumnParallelLinear, old.in_features, old.out_features, old.bias is not None)
    new.shard_sizes = old.shard_sizes        # this rank's q/k/v (gate/up) widths, read by the loaders
    setattr(owner, column, new)
    old = getattr(owner, row)
    setattr(owner, row, _adopt(old, RowParallelLinear, old.in_features, old.out_features, group, reduce_results))


def _split_experts(block: SparseMoeBlock, group: RankGroup) -> ParallelSparseMoeBlock:
    """Every expert split as a dense MLP, without its own all-reduce; the router (`gate`) stays whole."""
    for expert in block.experts:
        _split_pair(expert, "gate_up_proj", "down_proj", group, reduce_results=False)
    return _adopt(block, ParallelSparseMoeBlock, block.gate.in_features, block.moe, group)


def _place_experts(block: SparseMoeBlock, moe: MoEConfig, group: RankGroup) -> ExpertParallelMoeBlock:
    """The rank's E/N whole experts, as built, and a new router over all E experts (`moe`: the whole model's)."""
    new = _adopt(block, ExpertParallelMoeBlock, block.gate.in_features, moe, group)
    w = block.gate.weight
    new.gate = nn.Linear(w.shape[1], moe.num_experts, bias=False, device=w.device, dtype=w.dtype)
    return new


def _split_projection_norms(attn: nn.Module, group: RankGroup) -> None:
    """q_norm and k_norm over the whole projection: each rank keeps its heads' weights."""
    for name in ("q_norm", "k_norm"):
        old = getattr(attn, name)
        dim = old.weight.shape[0]
        setattr(attn, name, _adopt(old, ParallelProjectionRMSNorm, dim, old.eps, dim * group.world_size, group))


def _adopt(old: nn.Module, cls: type[nn.Module], *args) -> nn.Module:
    """A `cls` built on the meta device (no memory) that takes over `old`'s parameters and
    submodules (a MoE block's router and experts)."""
    with torch.device("meta"):
        new = cls(*args)
    for name, param in old.named_parameters(recurse=False):
        setattr(new, name, param)
    for name, child in old.named_children():
        setattr(new, name, child)
    return new
