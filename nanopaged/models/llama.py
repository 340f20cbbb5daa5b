"""One Llama-family transformer: Llama / SmolLM2 / Mistral, Qwen2 (qkv bias), Qwen3 (q/k norm).

It reads like any decoder-only model with two differences that make it a *paged* model:
the batch is one flat list of tokens from many requests (no padding, no batch axis), and
each attention layer gets its slice of the KV pool plus an `AttentionMetadata` that says
where every token's K/V lives. The math matches Hugging Face transformers operation for
operation, so greedy float32 output is token-identical (tests/models/test_hf_equality.py).

q/k/v and gate/up projections are fused into one matmul each, as vLLM does; the loader
(loader.py) copies the Hugging Face weights into their shards. docs/05_model_runner_and_kernels.md.
"""
from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from nanopaged.attention.metadata import AttentionMetadata
from nanopaged.models.config import ModelConfig
from nanopaged.models.moe import SparseMoeBlock


# ---- building blocks ----------------------------------------------------------------
class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # In float32 whatever the model dtype, then cast back before the weight (as HF does).
        dtype = x.dtype
        x = x.float()
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x.to(dtype)


def rope_inv_freq(cfg: ModelConfig) -> torch.Tensor:
    """The rotary frequencies theta^(-2i/d), adjusted by the config's rope scaling."""
    d = cfg.head_dim
    inv_freq = 1.0 / (cfg.rope_theta ** (torch.arange(0, d, 2, dtype=torch.int64).float() / d))
    s = cfg.rope_scaling
    if s is None:
        return inv_freq
    if s["rope_type"] == "linear":
        return inv_freq / s["factor"]
    # llama3: long wavelengths slowed by `factor`, short ones kept, a smooth ramp between.
    factor, low, high = s["factor"], s["low_freq_factor"], s["high_freq_factor"]
    old_len = s["original_max_position_embeddings"]
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > old_len / low, inv_freq / factor, inv_freq)
    smooth = (old_len / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    medium = (wavelen >= old_len / high) & (wavelen <= old_len / low)
    return torch.where(medium, smoothed, scaled)


class RotaryEmbedding(nn.Module):
    """cos/sin for every position up to max_len, computed once; looked up once per step
    (all layers share the step's positions) and applied by `apply_rotary` in every layer."""

    def __init__(self, cfg: ModelConfig, max_len: int) -> None:
        super().__init__()
        freqs = torch.arange(max_len).float()[:, None] * rope_inv_freq(cfg)[None, :]
        emb = torch.cat((freqs, freqs), dim=-1)
        self.register_buffer("cos", emb.cos(), persistent=False)
        self.register_buffer("sin", emb.sin(), persistent=False)

    def forward(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """The step's (cos, sin), each (tokens, 1, head_dim): broadcast over the heads."""
        return self.cos[positions].unsqueeze(1).to(dtype), self.sin[positions].unsqueeze(1).to(dtype)


def apply_rotary(x: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    """x * cos + rotate_half(x) * sin, x: (tokens, heads, head_dim) (Hugging Face's rotate_half
    convention: the first half of each head pairs with the second)."""
    cos, sin = rope
    x1, x2 = x.chunk(2, dim=-1)
    return x * cos + torch.cat((-x2, x1), dim=-1) * sin


# ---- the layers -----------------------------------------------------------------------
class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig, backend) -> None:
        super().__init__()
        self.num_heads, self.num_kv_heads, self.head_dim = (
            cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim)
        q_size, kv_size = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        self.q_size, self.kv_size = q_size, kv_size       # the split of qkv_proj's output, whatever runs it
        self.qkv_proj = nn.Linear(cfg.hidden_size, q_size + 2 * kv_size, bias=cfg.qkv_bias)
        self.qkv_proj.shard_sizes = [q_size, kv_size, kv_size]      # read by the loader
        self.o_proj = nn.Linear(q_size, cfg.hidden_size, bias=False)
        if cfg.qk_norm:   # Qwen3: RMSNorm over each head's q and k before RoPE; OLMoE: over the whole q and k
            whole = cfg.qk_norm == "projection"
            self.q_norm = RMSNorm(q_size if whole else self.head_dim, cfg.rms_norm_eps)
            self.k_norm = RMSNorm(kv_size if whole else self.head_dim, cfg.rms_norm_eps)
        self.qk_norm = cfg.qk_norm
        self.backend = backend
        self.scale = self.head_dim ** -0.5

    def forward(self, x, rope, kv_cache, meta: AttentionMetadata) -> torch.Tensor:
        n, heads, kv_heads = x.shape[0], self.num_heads, self.num_kv_heads
        q_size, kv_size = self.q_size, self.kv_size
        qk, v = self.qkv_proj(x).split([q_size + kv_size, kv_size], dim=-1)
        if self.qk_norm == "projection":
            qk = torch.cat((self.q_norm(qk[:, :q_size]), self.k_norm(qk[:, q_size:])), dim=1)
        qk = qk.view(n, heads + kv_heads, self.head_dim)      # q's heads, then k's
        v = v.view(n, kv_heads, self.head_dim)
        if self.qk_norm == "head":
            qk = torch.cat((self.q_norm(qk[:, :heads]), self.k_norm(qk[:, heads:])), dim=1)
        # One rotation for q's and k's heads together: the same cos/sin per position, half the ops.
        q, k = apply_rotary(qk, rope).split([heads, kv_heads], dim=1)
        o = self.backend.forward(q, k, v, kv_cache[0], kv_cache[1], meta, self.scale)
        return self.o_proj(o.reshape(n, -1))


class MLP(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.gate_up_proj = nn.Linear(cfg.hidden_size, 2 * cfg.intermediate_size, bias=False)
        self.gate_up_proj.shard_sizes = [cfg.intermediate_size, cfg.intermediate_size]
        self.down_proj = nn.Linear(cfg.intermediate_size, cfg.hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up_proj(x).chunk(2, dim=-1)
        return self.down_proj(F.silu(gate) * up)


class DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, backend, index: int = 0) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = Attention(cfg, backend)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        if cfg.moe is not None and index not in cfg.moe.dense_layers:   # a mixture of experts (models/moe.py)
            self.mlp = SparseMoeBlock(cfg.hidden_size, cfg.moe)
        else:
            self.mlp = MLP(cfg)

    def forward(self, x, rope, kv_cache, meta):
        x = x + self.self_attn(self.input_layernorm(x), rope, kv_cache, meta)
        return x + self.mlp(self.post_attention_layernorm(x))


# ---- the model ----------------------------------------------------------------------
class LlamaModel(nn.Module):
    def __init__(self, cfg: ModelConfig, backend, max_len: int) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.rotary = RotaryEmbedding(cfg, max_len)
        self.layers = nn.ModuleList(DecoderLayer(cfg, backend, i) for i in range(cfg.num_hidden_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)

    def forward(self, input_ids, positions, kv_caches, meta, inputs_embeds: torch.Tensor | None = None):
        x = self.embed_tokens(input_ids) if inputs_embeds is None else inputs_embeds
        rope = self.rotary(positions, x.dtype)     # once per step, not once per layer
        for layer, kv_cache in zip(self.layers, kv_caches):
            x = layer(x, rope, kv_cache, meta)
        return self.norm(x)


class LlamaForCausalLM(nn.Module):
    model_class = LlamaModel        # the layers under the head; a subclass names its own (models/qwen3_5.py)

    def __init__(self, cfg: ModelConfig, backend, max_len: int, **layers) -> None:
        super().__init__()
        self.config = cfg
        self.model = self.model_class(cfg, backend, max_len, **layers)
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        if cfg.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight

    @classmethod
    def build(cls, cfg: ModelConfig, backend, max_len: int, device, dtype: torch.dtype, **layers) -> "LlamaForCausalLM":
        """The layers on `device`, weights not loaded yet, made in `dtype`: built in float32 and then cast,
        a 7B mixture of experts would first take twice its bfloat16 size. `layers`: a subclass's own arguments."""
        default = torch.get_default_dtype()
        torch.set_default_dtype(dtype)
        try:
            with torch.device(device):
                return cls(cfg, backend, max_len, **layers)
        finally:
            torch.set_default_dtype(default)

    def forward(self, input_ids, positions, kv_caches, meta) -> torch.Tensor:
        """Hidden states for every new token, (num_tokens, hidden)."""
        return self.model(input_ids, positions, kv_caches, meta)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Logits only for the rows that sample: the lm_head is the largest matmul of a small model.
        In the model's dtype; the sampler takes them to float32, as Hugging Face's generate does."""
        return self.lm_head(hidden)
