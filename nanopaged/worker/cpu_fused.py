"""The CPU fast path for a decoder layer: the same weights, its small ops fused into C++ kernels.

`models/llama.py: DecoderLayer` is the reference a reader studies; run eagerly on a CPU it
launches about 50 torch ops a layer for a few rows of work (a norm alone is float, pow, mean,
add, rsqrt, mul, to, mul), and a decode step of a small model spends more time launching them
than in its matmuls. `FusedDecoderLayer` runs the same layer in ten calls:

    rms_norm -> qkv_proj -> rotary_and_store -> attend -> o_proj
             -> add_rms_norm -> gate_up_proj -> silu_and_mul -> down_proj -> add

  rms_norm          one pass per row (nanopaged/kernels/cpu_ops.cpp)
  rotary_and_store  rotates q and k in place inside the projection's output (Qwen3: each head
                    normed first) and writes k and v to their slots: vLLM's rotary_embedding and
                    reshape_and_cache in one pass
  attend            the attention backend's second half (the `cpu` backend: C++ decode rows)
  add_rms_norm      the residual add and the next norm in one pass (vLLM's fused_add_rms_norm)
  silu_and_mul      vLLM's name for SiLU(gate) * up in one pass

The residual adds round to the model's dtype as the reference's do. oneDNN could add the
residual inside the matmul (its "add" post-op) and save a pass, but its sum stays in float32
until the end: one rounding fewer per add, which moved the demo model's greedy answer to
"What is the capital of France?" at a near tie in bfloat16 (docs/05).

Each kernel rounds as the torch ops it replaces round (cpu_ops.cpp, "Rounding"), so the layer
gives the reference's values up to the order of float32 sums; tests/kernels/test_cpu_ops.py holds
each kernel to its torch ops, tests/worker/test_cpu_fused.py the whole model to the reference. The swap happens after loading, as
packing the linears does, so models/llama.py has no branch for it
(docs/05_model_runner_and_kernels.md, "Fused CPU kernels").
"""
from __future__ import annotations

import torch
from torch import nn

from nanopaged.kernels.cpu_ops import cpu_ops
from nanopaged.models.llama import DecoderLayer, RMSNorm

NO_WEIGHT = torch.empty(0)      # rotary_and_store without per-head norms (all but Qwen3)


class FusedRMSNorm(nn.Module):
    def __init__(self, norm: RMSNorm) -> None:
        super().__init__()
        self.weight, self.eps = norm.weight, norm.eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:     # x: (tokens, hidden)
        return cpu_ops().rms_norm(x, self.weight, self.eps)


class FusedDecoderLayer(nn.Module):
    """DecoderLayer's forward in ten calls; it holds the reference layer's own modules."""

    def __init__(self, layer: DecoderLayer) -> None:
        super().__init__()
        self.input_layernorm = FusedRMSNorm(layer.input_layernorm)
        self.self_attn = layer.self_attn
        self.post_attention_layernorm = FusedRMSNorm(layer.post_attention_layernorm)
        self.mlp = layer.mlp
        attn = self.self_attn
        self.qk_norm_weights = ((attn.q_norm.weight, attn.k_norm.weight, attn.q_norm.eps) if attn.qk_norm
                                else (NO_WEIGHT, NO_WEIGHT, 0.0))

    def forward(self, x, rope, kv_cache, meta):
        ops, attn, n = cpu_ops(), self.self_attn, x.shape[0]
        heads, kv_heads, head_dim = attn.num_heads, attn.num_kv_heads, attn.head_dim
        qkv = attn.qkv_proj(self.input_layernorm(x))                    # (n, (heads + 2 kv_heads) head_dim)
        cos, sin = rope
        ops.rotary_and_store(qkv, cos, sin, *self.qk_norm_weights, heads, kv_heads,
                             kv_cache[0], kv_cache[1], meta.slot_mapping)
        q, k, v = qkv.split([heads * head_dim, kv_heads * head_dim, kv_heads * head_dim], dim=-1)
        o = attn.backend.attend(q.view(n, heads, head_dim), k.view(n, kv_heads, head_dim),
                                v.view(n, kv_heads, head_dim), kv_cache[0], kv_cache[1], meta, attn.scale)
        h = ops.add_rms_norm(x, attn.o_proj(o.reshape(n, -1)), self.post_attention_layernorm.weight,
                             self.post_attention_layernorm.eps)                 # x += o, in place; h = norm(x)
        return x.add_(self.mlp.down_proj(ops.silu_and_mul(self.mlp.gate_up_proj(h))))


def fuse_layers(model: nn.Module) -> int:
    """Swap every DecoderLayer of a loaded model, and its final norm, for the fused ones; how many layers."""
    layers = model.model.layers
    for i, layer in enumerate(layers):
        layers[i] = FusedDecoderLayer(layer)
    model.model.norm = FusedRMSNorm(model.model.norm)
    return len(layers)
