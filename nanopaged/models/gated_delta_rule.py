"""The gated delta rule and its short convolution: the readable reference of Qwen3.5's linear attention.

A gated DeltaNet layer keeps, per request and head, a matrix S (key dim x value dim) instead of a growing
K/V. For each token, with q and k L2-normalised, q scaled by 1/sqrt(key dim), a decay g <= 0 and a
learning rate beta in (0, 1):

    S <- exp(g) * S                      forget a little of everything
    S <- S + k (beta (v - S^T k))^T      the delta rule: write only what S does not already predict for k
    o  = S^T q                           read

One token at a time this is `recurrent_step` (decode). A prompt is done a chunk at a time (`chunked`):
inside a chunk the updates are solved together as one triangular system (the UT transform of the DeltaNet
paper), across chunks S is carried; the same numbers in a few matrix products instead of T small steps.
Before the rule, q, k and v pass a causal depthwise convolution over the last few tokens
(`causal_conv1d`), whose state is those last inputs. Both states are float32 (docs/15_hybrid_models.md).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F


def causal_conv1d(x: torch.Tensor, weight: torch.Tensor, state: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """One request's rows x (T, channels) through the depthwise convolution weight (channels, kernel),
    continuing after `state` (channels, kernel - 1): its last inputs. Returns silu(conv) (T, channels) and
    the inputs window (channels, kernel - 1 + T), whose columns t : t + kernel - 1 are the state after t
    rows. A fresh request's state is zeros: the same as padding its prompt on the left."""
    window = torch.cat([state.to(x.dtype), x.t()], dim=1)
    y = F.conv1d(window[None], weight[:, None, :], groups=weight.shape[0])[0]
    return F.silu(y.t()), window


def causal_conv1d_step(x: torch.Tensor, weight: torch.Tensor, states: torch.Tensor):
    """One new token for each of R requests: x (R, channels), states (R, channels, kernel - 1)."""
    window = torch.cat([states.to(x.dtype), x[:, :, None]], dim=2)     # (R, channels, kernel)
    y = F.conv1d(window, weight[:, None, :], groups=weight.shape[0])[:, :, 0]
    return F.silu(y), window[:, :, 1:].to(states.dtype)


def paged_conv_step(x, weight, bias, pages: torch.Tensor, index: torch.Tensor, fresh: torch.Tensor) -> torch.Tensor:
    """`causal_conv1d_step` over state pages (bias None: Qwen3.5's convolution has none), as
    paged_recurrent_step below; the fast path's kernel keeps the signature (cpu/recurrent.py)."""
    states = pages[index].masked_fill(fresh[:, None, None], 0)
    y, pages[index] = causal_conv1d_step(x, weight, states)
    return y


def l2norm(x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    return x * torch.rsqrt((x * x).sum(-1, keepdim=True) + eps)


def prepare(q, k, v, g, beta):
    """float32, q and k unit length, q scaled: what both forms of the rule read."""
    q, k = l2norm(q.float()), l2norm(k.float())
    return q * q.shape[-1] ** -0.5, k, v.float(), g.float(), beta.float()


def recurrent_step(q, k, v, g, beta, state: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """One token of R requests: q, k (R, heads, dk), v (R, heads, dv), g, beta (R, heads), state (R, heads, dk, dv)."""
    q, k, v, g, beta = prepare(q, k, v, g, beta)
    s = state.float() * g.exp()[..., None, None]
    predicted = (s * k[..., None]).sum(-2)                             # S^T k: (R, heads, dv)
    s = s + k[..., None] * (beta[..., None] * (v - predicted))[..., None, :]
    return (s * q[..., None]).sum(-2), s


def paged_recurrent_step(q, k, v, g, beta, pages: torch.Tensor, index: torch.Tensor,
                         fresh: torch.Tensor) -> torch.Tensor:
    """`recurrent_step` over state pages: row r's state read from pages[index[r]] (zeros where fresh[r]: a
    one-token prompt) and written back. The fast path's kernel keeps this signature (cpu/recurrent.py)."""
    state = pages[index].masked_fill(fresh[:, None, None, None], 0)
    o, pages[index] = recurrent_step(q, k, v, g, beta, state)
    return o


def chunked(q, k, v, g, beta, state: torch.Tensor, keep: tuple[int, ...] = (), chunk: int = 64):
    """One request's T tokens: q, k (T, heads, dk), v (T, heads, dv), g, beta (T, heads), state (heads, dk, dv).
    Returns o (T, heads, dv) float32, the state after the last token, and {t: the state after t tokens} for
    each t in `keep` (multiples of `chunk`, or T: a chunk's end)."""
    q, k, v, g, beta = prepare(q, k, v, g, beta)
    T = q.shape[0]
    chunk = min(chunk, -(-T // 16) * 16)                               # a short prompt pads to 16s, not a chunk
    pad = -T % chunk                                                   # zeros past the end change nothing before it
    q, k, v, g, beta = (F.pad(x.transpose(0, 1), (0, 0, 0, pad) if x.dim() == 3 else (0, pad))
                        for x in (q, k, v, g, beta))                   # heads first: (heads, T + pad, ...)
    heads = q.shape[0]
    q, k, v = (x.reshape(heads, -1, chunk, x.shape[-1]) for x in (q, k, v))
    g, beta = g.reshape(heads, -1, chunk), beta.reshape(heads, -1, chunk)

    # Inside a chunk: decay[i, j] = exp(g_{j+1} + ... + g_i), what is left at token i of a write at token j.
    cum = g.cumsum(-1)
    causal = torch.ones(chunk, chunk, dtype=torch.bool, device=q.device).tril()
    decay = (cum[..., :, None] - cum[..., None, :]).masked_fill(~causal, float("-inf")).exp()
    k_beta, v_beta = k * beta[..., None], v * beta[..., None]
    # The chunk's writes depend on each other through S^T k: one unit lower-triangular system solves them all.
    system = (k_beta @ k.transpose(-1, -2)) * decay
    u = torch.linalg.solve_triangular(system, v_beta, upper=False, unitriangular=True)
    w = torch.linalg.solve_triangular(system, k_beta * cum.exp()[..., None], upper=False, unitriangular=True)
    inner = (q @ k.transpose(-1, -2)) * decay
    q_decayed = q * cum.exp()[..., None]
    k_to_end = k * (cum[..., -1:] - cum).exp()[..., None]
    s = state.float()
    out, kept = torch.empty_like(v), {}
    for c in range(q.shape[1]):                                        # across chunks: S carried
        v_new = u[:, c] - w[:, c] @ s                                  # each write's correction, given the old S
        out[:, c] = q_decayed[:, c] @ s + inner[:, c] @ v_new
        s = s * cum[:, c, -1].exp()[:, None, None] + k_to_end[:, c].transpose(-1, -2) @ v_new
        if min(T, (c + 1) * chunk) in keep:
            kept[min(T, (c + 1) * chunk)] = s
    return out.reshape(heads, -1, v.shape[-1])[:, :T].transpose(0, 1), s, kept
