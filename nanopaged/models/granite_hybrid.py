"""Granite 4.0-H: Mamba-2 layers beside a few attention layers (transformers' `granitemoehybrid`).

Why this Mamba-2 hybrid: IBM ships it as a product line (the dense H-Micro, H-1B and H-350M; the mixtures
Tiny and Small), vLLM serves it, and its Mamba-2 layer is the one Bamba and Falcon-H1 use too. It reads as
models/llama.py with three changes:

- a Mamba-2 mixer (models/mamba2.py) in place of attention in most layers, its conv and SSM state in a
  page of the pool (models/hybrid.py);
- the attention layers use no positional encoding when the config says so (Granite 4.0-H's choice: the
  Mamba layers carry order), and scale scores by `attention_multiplier` instead of 1/sqrt(head_dim);
- Granite's muP scalings: the embeddings times `embedding_multiplier`, every residual branch times
  `residual_multiplier`, the logits divided by `logits_scaling`; the MLP is a "shared" SwiGLU MLP.

Greedy float32 tokens equal transformers' (tests/models/test_hybrid_models.py). docs/15_hybrid_models.md.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from nanopaged.attention.metadata import AttentionMetadata
from nanopaged.models.config import ModelConfig
from nanopaged.models.llama import Attention, LlamaForCausalLM, RMSNorm, RotaryEmbedding, apply_rotary
from nanopaged.models.mamba2 import Mamba2Mixer


class GraniteAttention(Attention):
    """Llama's attention with Granite's score scale, and RoPE only where the config asks for it."""

    def __init__(self, cfg: ModelConfig, backend) -> None:
        super().__init__(cfg, backend)
        self.scale = cfg.hybrid.family["attention_multiplier"]
        self.rope = cfg.hybrid.family["rope"]

    def forward(self, x, rope, kv_cache, meta: AttentionMetadata) -> torch.Tensor:
        n, d = x.shape[0], self.head_dim
        q, k, v = self.qkv_proj(x).split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q, k, v = q.view(n, self.num_heads, d), k.view(n, self.num_kv_heads, d), v.view(n, self.num_kv_heads, d)
        if self.rope:
            q, k = apply_rotary(q, rope), apply_rotary(k, rope)
        o = self.backend.forward(q, k, v, kv_cache[0], kv_cache[1], meta, self.scale)
        return self.o_proj(o.reshape(n, -1))


class SharedMLP(nn.Module):
    """Granite's SwiGLU MLP, named as its checkpoints name it (gate and up in one input_linear)."""

    def __init__(self, hidden: int, intermediate: int) -> None:
        super().__init__()
        self.input_linear = nn.Linear(hidden, 2 * intermediate, bias=False)
        self.output_linear = nn.Linear(intermediate, hidden, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.input_linear(x).chunk(2, dim=-1)
        return self.output_linear(F.silu(gate) * up)


class MambaLayer(Mamba2Mixer):
    """The mixer over its group's page of each request (the pages, the fresh ones and the snapshots from meta)."""

    def __init__(self, cfg: ModelConfig, group: int, steps: dict | None = None) -> None:
        super().__init__(cfg.hybrid.family["mamba"], steps)
        self.group = group

    def step(self, x: torch.Tensor, state, meta: AttentionMetadata) -> torch.Tensor:
        g = self.group
        snapshots = [{rows: pages[g] for rows, pages in kept} for kept in meta.snapshots] if meta.snapshots else None
        return self(x, *state, meta.query_lens_list, [pages[g] for pages in meta.state_pages], meta.has_state,
                    snapshots)


class GraniteHybridDecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, backend, index: int, steps: dict | None = None) -> None:
        super().__init__()
        family = cfg.hybrid.family
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.is_mamba = cfg.hybrid.layer_types[index] == "linear"
        if self.is_mamba:
            self.mamba = MambaLayer(cfg, cfg.hybrid.place(index)[1], steps)
        else:
            self.self_attn = GraniteAttention(cfg, backend)
        self.shared_mlp = SharedMLP(cfg.hidden_size, family["shared_intermediate_size"])
        self.residual_multiplier = family["residual_multiplier"]

    def forward(self, x, rope, cache, meta):
        h = self.input_layernorm(x)
        h = self.mamba.step(h, cache, meta) if self.is_mamba else self.self_attn(h, rope, cache, meta)
        x = x + h * self.residual_multiplier
        return x + self.shared_mlp(self.post_attention_layernorm(x)) * self.residual_multiplier


class GraniteHybridModel(nn.Module):
    def __init__(self, cfg: ModelConfig, backend, max_len: int, steps: dict | None = None) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.rotary = RotaryEmbedding(cfg, max_len)
        self.layers = nn.ModuleList(GraniteHybridDecoderLayer(cfg, backend, i, steps)
                                    for i in range(cfg.num_hidden_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.embedding_multiplier = cfg.hybrid.family["embedding_multiplier"]

    def forward(self, input_ids, positions, caches, meta):
        x = self.embed_tokens(input_ids) * self.embedding_multiplier
        rope = self.rotary(positions, x.dtype)
        for layer, cache in zip(self.layers, caches):
            x = layer(x, rope, cache, meta)
        return self.norm(x)


class GraniteHybridForCausalLM(LlamaForCausalLM):
    """Llama's head and build over Granite's layers; the logits divided by `logits_scaling`. `steps`: a decode
    token's kernels ("conv", "ssd"), the fast path's (cpu/recurrent.py); None: the reference."""
    model_class = GraniteHybridModel

    def __init__(self, cfg: ModelConfig, backend, max_len: int, steps: dict | None = None) -> None:
        super().__init__(cfg, backend, max_len, steps=steps)
        self.logits_scaling = cfg.hybrid.family["logits_scaling"]

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head(hidden) / self.logits_scaling
