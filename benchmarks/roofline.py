"""The roofline: the matmul FLOP/s this machine reaches, the FLOPs the trace needs, and the
share of the tokens/s that ceiling allows which nanopaged reaches."""
from __future__ import annotations

import time

import torch

from benchmarks.trace import Run, Trace
from nanopaged.models.config import ModelConfig


def roofline_figures(m: ModelConfig, trace: Trace, run: Run, device: str, dtype: torch.dtype) -> dict:
    peak = measure_matmul_flops(device, dtype)
    flops = trace_flops(m, trace)
    tokens = trace.num_prompt_tokens + trace.num_output_tokens
    per_token = flops["total"] / tokens
    return {"matmul_flops_per_s": peak, "flops_per_token": per_token,
            "flops_share": {k: v / flops["total"] for k, v in flops.items() if k != "total"},
            "roofline_tokens_per_s": peak / per_token,
            "fraction": (tokens / run.wall_s) / (peak / per_token)}


def measure_matmul_flops(device: str, dtype: torch.dtype) -> float:
    """Best FLOP/s of square matmuls on this machine: the ceiling the model's matmuls work under."""
    best = 0.0
    for n in (1024, 2048):
        a = torch.randn(n, n, device=device, dtype=dtype)
        b = torch.randn(n, n, device=device, dtype=dtype)
        for _ in range(4):
            _sync(device)
            t = time.perf_counter()
            a @ b
            _sync(device)
            best = max(best, 2 * n ** 3 / (time.perf_counter() - t))
    return best


def _sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def trace_flops(m: ModelConfig, trace: Trace) -> dict:
    """Model FLOPs the trace needs, counting what nanopaged computes.

    Every token: 2 x (weights of the decoder layers). Logits (2 x vocab x hidden) only for
    the tokens that are sampled, one per output token. Attention, causal: 4 x layers x heads
    x head_dim x (context length) per token (QK^T and PV). Embedding lookups and norms: none.
    """
    q, kv = m.num_attention_heads * m.head_dim, m.num_key_value_heads * m.head_dim
    layer = m.hidden_size * (2 * q + 2 * kv) + 3 * m.hidden_size * m.intermediate_size
    linear = 2 * m.num_hidden_layers * layer * (trace.num_prompt_tokens + trace.num_output_tokens)
    logits = 2 * m.vocab_size * m.hidden_size * trace.num_output_tokens
    ctx = sum(n * (n + 1) // 2 for n in (len(p) + o for p, o in zip(trace.prompts, trace.output_lens)))
    attention = 4 * m.num_hidden_layers * q * ctx
    return {"linear": linear, "logits": logits, "attention": attention,
            "total": linear + logits + attention}
