"""W8A8's rotation of the hidden states: a row's few large features spread over all of them before
the row is quantized to 8 bits.

W8A8 (quantized_linear.py: W8A8Linear) quantizes each row of activations with one scale, its largest
|x| mapped to 127. A language model's hidden states have a few features far larger than the rest, so
the scale follows those and the rest round to a handful of codes. Multiplying the row by an orthogonal
Q spreads them: every feature of x Q is a mix of all of x's. Nothing the model computes changes if every
weight that reads the residual stream reads h Q, and every weight that writes it writes through Q^T
(QuaRot, Ashkboos et al. 2024): RMSNorm(h Q) = RMSNorm(h) Q, since |h Q| = |h|, once each norm's gain is
folded into the weights that read its output. So the rotation is done to the weights, once, at load:

    embeddings    E      -> E Q                  (the residual stream carries h Q from the start)
    read it       W      -> (W diag(g)) Q        (q/k/v and gate/up, after their norm's gain g; the lm_head)
    write it      W      -> Q^T W                (o_proj and down_proj)
    norms' gains  g      -> 1

Q is a Hadamard matrix (entries +-1/sqrt(n): each output feature an equal mix of every input) for the
largest power of two dividing the width, times a seeded random orthogonal matrix for the rest
(576 = 64 x 9). In bfloat16 the rotated weights round differently; the cost is on the results page.
"""
from __future__ import annotations

import torch
from torch import nn


def check_w8a8(config) -> None:
    """A ValueError, before any weight loads, where W8A8 cannot take a mixture's experts, or where the
    rotated model would not be the model asked for: hidden states handed out (runner="pooling"), adapters
    trained on the unrotated weights. A checkpoint that ships its int8 codes (models/shipped_int8.py) is not
    rotated. (The widths its kernels take: config.py, check_quantization.)"""
    m = config.model_config
    if m.moe is not None:
        raise ValueError("quantization='w8a8' does not quantize a mixture of experts' experts (nor rotate its router)")
    if m.shipped_int8:
        return                              # the checkpoint's codes run as they ship: nothing is rotated
    why = ("runner='pooling' hands out hidden states, which the rotation changes" if config.runner == "pooling" else
           "LoRA adapters were trained on the unrotated weights" if config.enable_lora else None)
    if why:
        raise ValueError(f"quantization='w8a8' rotates the model's hidden states (nanopaged/cpu/rotation.py): {why}")


def orthogonal(n: int, seed: int = 0) -> torch.Tensor:
    """An n x n orthogonal matrix, float64: Sylvester's Hadamard matrix of the largest power of two dividing n,
    scaled to orthonormal, Kronecker times a random orthogonal matrix (QR of a seeded Gaussian) for the rest."""
    power = n & -n
    hadamard = torch.ones(1, 1, dtype=torch.float64)
    while hadamard.shape[0] < power:
        hadamard = torch.cat([torch.cat([hadamard, hadamard], 1), torch.cat([hadamard, -hadamard], 1)])
    q, r = torch.linalg.qr(torch.randn(n // power, n // power, dtype=torch.float64,
                                       generator=torch.Generator().manual_seed(seed)))
    rest = q * torch.sign(torch.diagonal(r))           # a sign per column: Q's distribution, not QR's convention
    return torch.kron(hadamard / power ** 0.5, rest.contiguous())


def rotate_hidden_states(model: nn.Module, seed: int = 0) -> None:
    """Rotate the residual stream of a dense Llama-family model in place (the table above); its answers are
    those of the model it was, up to rounding. A tied lm_head gets a weight of its own (it reads the last
    norm's gain, which the embeddings do not)."""
    q = orthogonal(model.config.hidden_size, seed).float()
    inner = model.model
    # the lm_head first: a tied one is the embeddings' own Parameter, rotated in place next
    model.lm_head.weight = nn.Parameter(_apply(model.lm_head.weight, gain=inner.norm.weight, right=q),
                                        requires_grad=False)
    inner.embed_tokens.weight.data = _apply(inner.embed_tokens.weight, right=q)
    inner.norm.weight.data.fill_(1)
    for layer in inner.layers:
        attn, mlp = layer.self_attn, layer.mlp
        attn.qkv_proj.weight.data = _apply(attn.qkv_proj.weight, gain=layer.input_layernorm.weight, right=q)
        mlp.gate_up_proj.weight.data = _apply(mlp.gate_up_proj.weight, gain=layer.post_attention_layernorm.weight,
                                              right=q)
        attn.o_proj.weight.data = _apply(attn.o_proj.weight, left=q.t())
        mlp.down_proj.weight.data = _apply(mlp.down_proj.weight, left=q.t())
        layer.input_layernorm.weight.data.fill_(1)
        layer.post_attention_layernorm.weight.data.fill_(1)


def _apply(weight: torch.Tensor, gain=None, right=None, left=None) -> torch.Tensor:
    """left @ (weight diag(gain)) @ right in float32 (far finer than bfloat16), back in the weight's dtype."""
    w = weight.detach().float()
    if gain is not None:
        w = w * gain.detach().float()[None, :]
    if right is not None:
        w = w @ right
    if left is not None:
        w = left @ w
    return w.to(weight.dtype)
