"""Mixture of experts: a layer's MLP replaced by many small ones, each token sent to a few.

A router (one linear, hidden -> experts) scores every expert for every token; each token runs
the top-k experts' MLPs and sums their outputs weighted by the router's softmax. A model of 30B
parameters with 3B active reads, per token, only the experts it chose. Three families, as
Hugging Face transformers computes them:

    Qwen3MoeForCausalLM   top-k of softmax(router), renormalised if norm_topk_prob; some layers
                          dense (mlp_only_layers, decoder_sparse_step); q/k RMSNorm per head
    MixtralForCausalLM    top-2 of softmax(router), always renormalised, the weights kept in float32
    OlmoeForCausalLM      top-8 of 64, renormalised if norm_topk_prob (off as shipped); q/k RMSNorm
                          over the whole projection

`SparseMoeBlock.forward` is the readable reference: route, then for each expert that any token
chose, its MLP on those tokens, weighted, added back in expert order (transformers' order, so
float32 output matches token for token). A config asking for what this code does not compute
(shared experts, grouped top-k, a router bias, clipped q/k/v) is a ValueError naming the field.
docs/13_moe.md.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

# config.json fields that change the routing or add experts this code does not compute: refused by name
UNSUPPORTED_FIELDS = {
    "shared_expert_intermediate_size": "shared experts", "n_shared_experts": "shared experts",
    "n_group": "grouped top-k routing", "topk_group": "grouped top-k routing",
    "router_bias": "a router with a bias", "moe_router_bias": "a router with a bias",
    "topk_method": "another top-k method", "scoring_func": "another router scoring function",
    "clip_qkv": "clipped q/k/v (OLMoE's clip_qkv)",
}


@dataclass(frozen=True)
class MoEConfig:
    num_experts: int
    top_k: int                      # num_experts_per_tok
    intermediate_size: int          # each expert's
    norm_topk_prob: bool            # renormalise the chosen experts' weights to sum to 1
    weights_in_float32: bool        # Mixtral keeps the routing weights in float32; the others cast them
    dense_layers: frozenset[int]    # layers whose MLP is a plain dense one (Qwen3-MoE's mlp_only_layers)


def moe_config(cfg: dict, arch: str) -> MoEConfig:
    """The MoE fields of a config.json, checked; a ValueError naming any field not computed here."""
    for name, what in UNSUPPORTED_FIELDS.items():
        if cfg.get(name) not in (None, 0, False, [], "greedy", "softmax"):
            raise ValueError(f"{name}={cfg[name]!r} asks for {what}, which nanopaged does not compute")
    experts = cfg.get("num_experts") or cfg.get("num_local_experts")
    top_k = cfg.get("num_experts_per_tok")
    size = cfg.get("moe_intermediate_size") or cfg.get("intermediate_size")
    for name, value in (("num_experts", experts), ("num_experts_per_tok", top_k), ("moe_intermediate_size", size)):
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise ValueError(f"field {name!r} must be a positive integer, got {value!r}")
    if top_k > experts:
        raise ValueError(f"num_experts_per_tok={top_k} is more than the {experts} experts")
    layers, step = cfg["num_hidden_layers"], cfg.get("decoder_sparse_step") or 1
    dense = set(cfg.get("mlp_only_layers") or []) | {i for i in range(layers) if (i + 1) % step}
    return MoEConfig(experts, top_k, size, arch == "MixtralForCausalLM" or bool(cfg.get("norm_topk_prob")),
                     arch == "MixtralForCausalLM", frozenset(dense))


class Expert(nn.Module):
    """One expert: a SwiGLU MLP, gate and up fused as the dense MLP's (the loader fills both shards)."""

    def __init__(self, hidden: int, intermediate: int) -> None:
        super().__init__()
        self.gate_up_proj = nn.Linear(hidden, 2 * intermediate, bias=False)
        self.gate_up_proj.shard_sizes = [intermediate, intermediate]
        self.down_proj = nn.Linear(intermediate, hidden, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up_proj(x).chunk(2, dim=-1)
        return self.down_proj(nn.functional.silu(gate) * up)


class SparseMoeBlock(nn.Module):
    def __init__(self, hidden: int, moe: MoEConfig) -> None:
        super().__init__()
        self.moe = moe
        self.gate = nn.Linear(hidden, moe.num_experts, bias=False)      # the router
        self.experts = nn.ModuleList(Expert(hidden, moe.intermediate_size) for _ in range(moe.num_experts))
        self.tokens_per_expert, self.last_step, self.steps = [0] * moe.num_experts, [0] * moe.num_experts, 0

    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Each token's top-k experts (tokens, k) and their weights: softmax in float32, top-k, renormalised
        where the model says so."""
        probs = torch.softmax(self.gate(x), dim=-1, dtype=torch.float32)
        weights, chosen = torch.topk(probs, self.moe.top_k, dim=-1)
        if self.moe.norm_topk_prob:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        return (weights if self.moe.weights_in_float32 else weights.to(x.dtype)), chosen

    def count(self, chosen: torch.Tensor) -> None:
        """The load each expert took, this step and since the last reset (expert_load)."""
        self.last_step = torch.bincount(chosen.flatten(), minlength=self.moe.num_experts).tolist()
        self.tokens_per_expert = [a + b for a, b in zip(self.tokens_per_expert, self.last_step)]
        self.steps += 1

    def forward(self, x: torch.Tensor) -> torch.Tensor:              # x: (tokens, hidden)
        weights, chosen = self.route(x)
        self.count(chosen)
        out = torch.zeros_like(x)
        for expert in chosen.unique().tolist():                      # ascending, as transformers adds them
            token, k = torch.where(chosen == expert)                 # the tokens that chose it, and at which rank
            y = self.experts[expert](x[token]) * weights[token, k, None]
            out.index_add_(0, token, y.to(x.dtype))
        return out


def expert_load(model: nn.Module, reset: bool = False) -> dict:
    """get_stats()["moe"]: the tokens each expert of each MoE layer took since the last reset and in the last
    step, the steps since the reset, and how uneven the load was (the busiest expert's tokens over the mean,
    over every layer: 1.0 is perfectly even)."""
    blocks = [m for m in model.modules() if isinstance(m, SparseMoeBlock)]
    out = {"tokens_per_expert": [list(b.tokens_per_expert) for b in blocks],
           "last_step": [list(b.last_step) for b in blocks], "steps": blocks[0].steps if blocks else 0}
    if reset:
        for b in blocks:
            b.tokens_per_expert, b.last_step, b.steps = [0] * b.moe.num_experts, [0] * b.moe.num_experts, 0
    busiest = [max(load) * len(load) / sum(load) for load in out["tokens_per_expert"] if sum(load)]
    return {**out, "max_over_mean": max(busiest) if busiest else 0.0}
