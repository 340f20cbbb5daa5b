"""The CPU fast path for the decoder: the same weights, every layer's small ops fused into C++ kernels
and the layer loop itself in C++.

`models/llama.py: DecoderLayer` is the reference a reader studies; run eagerly on a CPU it
launches about 50 torch ops a layer for a few rows of work (a norm alone is float, pow, mean,
add, rsqrt, mul, to, mul), and a decode step of a small model spends more time launching them
than in its matmuls. The fused path runs each layer in nine calls (eight behind nanopaged's
bfloat16 linear, see silu_and_mul), all in C++ (nanopaged/cpu/csrc/decoder.cpp: decoder_forward),
once per step for the whole stack:

    (add_)rms_norm -> qkv_proj -> rotary_and_store -> paged_attention -> o_proj
                   -> add_rms_norm -> gate_up_proj -> silu_and_mul -> down_proj

  rms_norm          one pass per row; from the second layer on, add_rms_norm, which first adds
                    the layer before's MLP output to the residual (the last one's after the loop)
  rotary_and_store  rotates q and k in place inside the projection's output (Qwen3: each head
                    normed first) and writes k and v to their slots: vLLM's rotary_embedding and
                    reshape_and_cache in one pass
  paged_attention   every row of the step through its block table (the `cpu` attention backend's)
  add_rms_norm      the residual add and the next norm in one pass (vLLM's fused_add_rms_norm)
  silu_and_mul      vLLM's name for SiLU(gate) * up in one pass; behind nanopaged's bfloat16
                    linear it is the projection's epilogue instead, one call for both
                    (linear_bf16_silu_mul: the (rows, 2 x intermediate) projection never goes to
                    memory and back)

The linears are the model's own layers, described to C++ (`describe`): nanopaged's bfloat16 and
quantized kernels run there directly; any other layer (oneDNN's packed linear, nn.Linear,
torch's int4 kernel) is called back in Python. The residual adds round to the model's dtype as
the reference's do (oneDNN can add a residual inside its matmul, in float32: one rounding fewer
per add, which moved the demo model's greedy answer at a near tie in bfloat16; docs/05).

Each kernel rounds as the torch ops it replaces round (csrc/vec16.h, "Rounding"), so the layer
gives the reference's values up to the order of float32 sums; tests/cpu/test_cpu_ops.py holds
each kernel to its torch ops, tests/cpu/test_fused.py the whole model to the reference.
The swap happens after loading, as packing the linears does, so models/llama.py has no branch
for it (docs/05_model_runner_and_kernels.md, "Fused CPU kernels").
"""
from __future__ import annotations

import torch
from torch import nn

from nanopaged.cpu.build import cpu_ops
from nanopaged.cpu.linear import CppLinear
from nanopaged.cpu.moe import group_experts
from nanopaged.models.llama import LlamaModel, RMSNorm

NO_WEIGHT = torch.empty(0)      # an absent norm or bias


class FusedRMSNorm(nn.Module):
    def __init__(self, norm: RMSNorm) -> None:
        super().__init__()
        self.weight, self.eps = norm.weight, norm.eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:     # x: (tokens, hidden)
        return cpu_ops().rms_norm(x, self.weight, self.eps)


def describe(layer: nn.Module):
    """A linear layer as the C++ loop takes it (csrc/decoder.h: struct Linear, its `kind` a
    LinearKind). A layer that declares how C++ runs it (linear.py: CppLinear: nanopaged's bfloat16 and
    quantized kernels, an adapter's updates beside them) describes itself; any other is called back
    in Python (CALLBACK)."""
    own = layer.describe_cpp(describe) if isinstance(layer, CppLinear) else None
    if own is not None:
        return own
    ops = cpu_ops()
    lin = ops.Linear()
    lin.out_features, lin.kind, lin.fn = layer.out_features, ops.LinearKind.CALLBACK, layer
    return lin


class FusedLlamaModel(nn.Module):
    """LlamaModel's forward with the layer loop in C++; it holds the reference model's own modules."""

    def __init__(self, model: LlamaModel) -> None:
        super().__init__()
        self.embed_tokens, self.rotary, self.layers = model.embed_tokens, model.rotary, model.layers
        self.norm = FusedRMSNorm(model.norm)
        attn = model.layers[0].self_attn
        decoder = cpu_ops().Decoder()
        decoder.heads, decoder.kv_heads, decoder.head_dim = attn.num_heads, attn.num_kv_heads, attn.head_dim
        decoder.eps, decoder.scale = model.layers[0].input_layernorm.eps, attn.scale
        decoder.qk_eps = attn.q_norm.eps if attn.qk_norm else 0.0
        decoder.layers = [self._layer(layer) for layer in model.layers]
        self.decoder = decoder

    @staticmethod
    def _layer(layer):
        attn, described = layer.self_attn, cpu_ops().Layer()
        described.input_norm, described.post_norm = layer.input_layernorm.weight, layer.post_attention_layernorm.weight
        described.q_norm = attn.q_norm.weight if attn.qk_norm else NO_WEIGHT
        described.k_norm = attn.k_norm.weight if attn.qk_norm else NO_WEIGHT
        described.qkv, described.o = describe(attn.qkv_proj), describe(attn.o_proj)
        if not hasattr(layer.mlp, "gate_up_proj"):     # a mixture of experts (cpu/moe.py): routed in Python
            described.moe = layer.mlp
        else:
            described.gate_up, described.down = describe(layer.mlp.gate_up_proj), describe(layer.mlp.down_proj)
        return described

    def forward(self, input_ids, positions, kv_caches, meta, inputs_embeds: torch.Tensor | None = None):
        x = self.embed_tokens(input_ids) if inputs_embeds is None else inputs_embeds
        cos, sin = self.rotary(positions, x.dtype)             # each (tokens, 1, head_dim)
        x = cpu_ops().decoder_forward(self.decoder, x, cos, sin, kv_caches, meta.slot_mapping, meta.block_tables,
                                      meta.seq_lens, meta.query_start_loc, meta.share_prefixes)
        return self.norm(x)


def argmax_rows(logits: torch.Tensor) -> torch.Tensor:
    """The sampler's argmax (greedy rows, and the exponential race of the others) in one C++ pass
    (csrc/argmax.cpp): torch.argmax(dim=-1)'s answer, NaN and ties included, at the time it takes
    to read the logits (torch's takes longer: docs/05, "The sampler's argmax")."""
    if logits.dtype != torch.float32 or logits.dim() != 2 or logits.shape[-1] == 0:
        return logits.argmax(dim=-1)
    return cpu_ops().argmax_rows(logits)


def fuse_layers(model: nn.Module) -> int:
    """Swap a loaded model's LlamaModel for the fused one, a mixture's experts grouped first (cpu/moe.py),
    after quantizing and packing its linears, whose layers it describes; how many layers."""
    if model.config.moe is not None:
        group_experts(model, describe)
    model.model = FusedLlamaModel(model.model)
    return len(model.model.layers)
