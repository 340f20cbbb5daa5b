"""Qwen3.5: three gated DeltaNet layers to one gated full-attention layer (transformers' `qwen3_5`).

It reads as models/llama.py with two new layers:

- `GatedDeltaNet`, the linear attention: q, k, v through a short causal convolution, then the gated
  delta rule (models/gated_delta_rule.py) over a state per request that never grows; its output is
  normalised and gated by silu(z). Its state lives in a page of the pool (models/hybrid.py), which it
  reads at the start of the step and writes back at the end, so a prompt computed in chunks, a preempted
  request recomputed, or a prefix-cache hit restored from a snapshot all continue from the right state.
- `GatedAttention`, full attention through the paged K/V as Llama's, with three changes: q_proj also
  yields a gate (the output is multiplied by its sigmoid), RoPE turns only the first quarter of each
  head's dims, and the norms are zero-centred (x * (1 + weight)).

Greedy float32 tokens equal transformers' (tests/models/test_hybrid_models.py). docs/15_hybrid_models.md.
"""
from __future__ import annotations

from dataclasses import replace

import torch
import torch.nn.functional as F
from torch import nn

from nanopaged.attention.metadata import AttentionMetadata
from nanopaged.models import gated_delta_rule as rule
from nanopaged.models.config import ModelConfig
from nanopaged.models.llama import MLP, LlamaForCausalLM, RotaryEmbedding, apply_rotary


class ZeroCenteredRMSNorm(nn.Module):
    """RMSNorm whose weight is stored as (gain - 1): x * (1 + weight), in float32, then cast back."""

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = x.float()
        y = y * torch.rsqrt(y.pow(2).mean(-1, keepdim=True) + self.eps)
        return (y * (1.0 + self.weight.float())).to(x.dtype)


class GatedRMSNorm(nn.Module):
    """The DeltaNet output's norm, per value head: weight * rmsnorm(x) * silu(z)."""

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor, z: torch.Tensor) -> torch.Tensor:
        y = x.float()
        y = self.weight * (y * torch.rsqrt(y.pow(2).mean(-1, keepdim=True) + self.eps)).to(x.dtype)
        return (y * F.silu(z.float())).to(x.dtype)


# ---- the linear attention -------------------------------------------------------------
class GatedDeltaNet(nn.Module):
    def __init__(self, cfg: ModelConfig, group: int, steps: dict | None = None) -> None:
        super().__init__()
        steps = steps or {}     # a decode token's kernels, the fast path's (cpu/recurrent.py), else the reference
        self.conv_step = steps.get("conv", rule.paged_conv_step)
        self.decode_step = steps.get("gated_delta", rule.paged_recurrent_step)
        lin = cfg.hybrid.family
        self.k_heads, self.v_heads = lin["linear_num_key_heads"], lin["linear_num_value_heads"]
        self.dk, self.dv = lin["linear_key_head_dim"], lin["linear_value_head_dim"]
        key_dim, value_dim = self.k_heads * self.dk, self.v_heads * self.dv
        self.conv_dim = 2 * key_dim + value_dim
        self.group = group                  # which of the request's state pages is this layer's
        self.in_proj_qkv = nn.Linear(cfg.hidden_size, self.conv_dim, bias=False)
        self.in_proj_z = nn.Linear(cfg.hidden_size, value_dim, bias=False)
        self.in_proj_b = nn.Linear(cfg.hidden_size, self.v_heads, bias=False)
        self.in_proj_a = nn.Linear(cfg.hidden_size, self.v_heads, bias=False)
        kernel = lin["linear_conv_kernel_dim"]
        self.conv1d = nn.Conv1d(self.conv_dim, self.conv_dim, kernel, groups=self.conv_dim, bias=False)
        self.dt_bias = nn.Parameter(torch.ones(self.v_heads))
        self.A_log = nn.Parameter(torch.zeros(self.v_heads))
        self.norm = GatedRMSNorm(self.dv, cfg.rms_norm_eps)
        self.out_proj = nn.Linear(value_dim, cfg.hidden_size, bias=False)

    def forward(self, x: torch.Tensor, state, meta: AttentionMetadata) -> torch.Tensor:
        """x (tokens, hidden); state: (conv, recurrent) page tensors of this layer, read and written in place."""
        qkv, z = self.in_proj_qkv(x), self.in_proj_z(x)
        beta = self.in_proj_b(x).sigmoid()
        # the decay, in log space: -exp(A_log) * softplus(a + dt_bias) <= 0 (float32: exp(A_log) is large)
        g = -self.A_log.float().exp() * F.softplus(self.in_proj_a(x).float() + self.dt_bias)
        out = torch.empty(x.shape[0], self.v_heads, self.dv, dtype=x.dtype, device=x.device)
        starts = meta.query_start_loc.tolist()
        decodes = [i for i, n in enumerate(meta.query_lens_list) if n == 1]
        for i in (i for i, n in enumerate(meta.query_lens_list) if n > 1):   # a prompt (or a chunk): alone
            rows = slice(starts[i], starts[i] + meta.query_lens_list[i])
            out[rows] = self.prefill(qkv[rows], g[rows], beta[rows], state, meta.state_pages[i][self.group],
                                     meta.has_state[i], self.snapshots(meta, i))
        if decodes:                                                           # one token each: together
            rows = torch.tensor([starts[i] for i in decodes], device=x.device)
            pages = [meta.state_pages[i][self.group] for i in decodes]
            out[rows] = self.decode(qkv[rows], g[rows], beta[rows], state, pages,
                                    [meta.has_state[i] for i in decodes], [self.snapshots(meta, i) for i in decodes])
        o = self.norm(out.reshape(-1, self.dv), z.reshape(-1, self.dv))
        return self.out_proj(o.reshape(x.shape[0], -1))

    def split(self, mixed: torch.Tensor):
        """The convolution's output as q, k (each key head repeated for its value heads) and v."""
        n = mixed.shape[0]
        q, k, v = mixed.split([self.k_heads * self.dk, self.k_heads * self.dk, self.v_heads * self.dv], dim=-1)
        repeat = self.v_heads // self.k_heads
        q = q.reshape(n, self.k_heads, self.dk).repeat_interleave(repeat, dim=1)
        k = k.reshape(n, self.k_heads, self.dk).repeat_interleave(repeat, dim=1)
        return q, k, v.reshape(n, self.v_heads, self.dv)

    def snapshots(self, meta: AttentionMetadata, i: int) -> dict[int, int]:
        """{rows: page}: after that many of request i's rows, keep this layer's state in that page too."""
        return {rows: pages[self.group] for rows, pages in meta.snapshots[i]} if meta.snapshots else {}

    def prefill(self, qkv, g, beta, state, page: int, has_state: bool, snapshots: dict[int, int]) -> torch.Tensor:
        conv_pages, rec_pages = state
        conv_state = conv_pages[page] if has_state else torch.zeros_like(conv_pages[page])
        rec_state = rec_pages[page] if has_state else torch.zeros_like(rec_pages[page])
        mixed, window = rule.causal_conv1d(qkv, self.conv1d.weight[:, 0], conv_state)
        o, final, kept = rule.chunked(*self.split(mixed), g, beta, rec_state, tuple(snapshots))
        width = conv_state.shape[1]
        for rows, snapshot in snapshots.items():
            conv_pages[snapshot], rec_pages[snapshot] = window[:, rows:rows + width], kept[rows]
        conv_pages[page], rec_pages[page] = window[:, window.shape[1] - width:], final
        return o.to(qkv.dtype)

    def decode(self, qkv, g, beta, state, pages: list[int], has_state: list[bool],
               snapshots: list[dict[int, int]]) -> torch.Tensor:
        conv_pages, rec_pages = state
        index = torch.tensor(pages, device=qkv.device)
        fresh = torch.tensor([not h for h in has_state], device=qkv.device)
        mixed = self.conv_step(qkv, self.conv1d.weight[:, 0], None, conv_pages, index, fresh)
        o = self.decode_step(*self.split(mixed), g, beta, rec_pages, index, fresh)
        for r, kept in enumerate(snapshots):          # a prompt's last token on a block boundary
            for snapshot in kept.values():
                conv_pages[snapshot], rec_pages[snapshot] = conv_pages[pages[r]], rec_pages[pages[r]]
        return o.to(qkv.dtype)


# ---- the full attention ---------------------------------------------------------------
class GatedAttention(nn.Module):
    def __init__(self, cfg: ModelConfig, backend) -> None:
        super().__init__()
        self.num_heads, self.num_kv_heads, self.head_dim = (
            cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim)
        q_size, kv_size = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        self.q_size, self.kv_size = q_size, kv_size
        self.qkv_proj = nn.Linear(cfg.hidden_size, 2 * q_size + 2 * kv_size, bias=cfg.qkv_bias)
        self.qkv_proj.shard_sizes = [2 * q_size, kv_size, kv_size]     # q_proj holds each head's query and gate
        self.o_proj = nn.Linear(q_size, cfg.hidden_size, bias=False)
        self.q_norm = ZeroCenteredRMSNorm(self.head_dim, cfg.rms_norm_eps)
        self.k_norm = ZeroCenteredRMSNorm(self.head_dim, cfg.rms_norm_eps)
        self.rotary_dim = int(self.head_dim * cfg.partial_rotary_factor)
        self.backend = backend
        self.scale = self.head_dim ** -0.5

    def forward(self, x, rope, kv_cache, meta: AttentionMetadata) -> torch.Tensor:
        n, heads, kv_heads, d = x.shape[0], self.num_heads, self.num_kv_heads, self.head_dim
        qg, k, v = self.qkv_proj(x).split([2 * self.q_size, self.kv_size, self.kv_size], dim=-1)
        q, gate = qg.view(n, heads, 2 * d).chunk(2, dim=-1)
        q, k = self.q_norm(q), self.k_norm(k.view(n, kv_heads, d))
        q, k = self.rotate(q, rope), self.rotate(k, rope)
        o = self.backend.forward(q, k, v.view(n, kv_heads, d), kv_cache[0], kv_cache[1], meta, self.scale)
        return self.o_proj(o.reshape(n, -1) * torch.sigmoid(gate.reshape(n, -1)))

    def rotate(self, x: torch.Tensor, rope) -> torch.Tensor:
        """RoPE on the first rotary_dim dims of each head; the rest pass unchanged."""
        r = self.rotary_dim
        return torch.cat((apply_rotary(x[..., :r], rope), x[..., r:]), dim=-1)


# ---- the model ------------------------------------------------------------------------
class HybridDecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, backend, index: int, steps: dict | None = None) -> None:
        super().__init__()
        self.input_layernorm = ZeroCenteredRMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_attention_layernorm = ZeroCenteredRMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.is_linear = cfg.hybrid.layer_types[index] == "linear"
        if self.is_linear:
            self.linear_attn = GatedDeltaNet(cfg, cfg.hybrid.place(index)[1], steps)
        else:
            self.self_attn = GatedAttention(cfg, backend)
        self.mlp = MLP(cfg)

    def forward(self, x, rope, cache, meta):
        h = self.input_layernorm(x)
        h = self.linear_attn(h, cache, meta) if self.is_linear else self.self_attn(h, rope, cache, meta)
        x = x + h
        return x + self.mlp(self.post_attention_layernorm(x))


class Qwen3_5Model(nn.Module):
    def __init__(self, cfg: ModelConfig, backend, max_len: int, steps: dict | None = None) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        rotary_dim = int(cfg.head_dim * cfg.partial_rotary_factor)
        self.rotary = RotaryEmbedding(replace(cfg, head_dim=rotary_dim), max_len)
        self.layers = nn.ModuleList(HybridDecoderLayer(cfg, backend, i, steps) for i in range(cfg.num_hidden_layers))
        self.norm = ZeroCenteredRMSNorm(cfg.hidden_size, cfg.rms_norm_eps)

    def forward(self, input_ids, positions, caches, meta):
        """caches: one per layer, an attention layer's (K, V) pages or a linear layer's (conv, recurrent)."""
        x = self.embed_tokens(input_ids)
        rope = self.rotary(positions, x.dtype)
        for layer, cache in zip(self.layers, caches):
            x = layer(x, rope, cache, meta)
        return self.norm(x)


class Qwen3_5ForCausalLM(LlamaForCausalLM):
    """Llama's head and build over Qwen3.5's layers, built with `steps`: a decode token's kernels ("conv",
    "gated_delta"), the fast path's (cpu/recurrent.py); None: the reference."""
    model_class = Qwen3_5Model
