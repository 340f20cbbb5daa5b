"""The SigLIP vision transformer as Idefics3 / SmolVLM use it: an image's tiles in, one row per patch out.

A tile (3, H, W) is cut into p x p patches by a convolution of stride p; each patch becomes a row, plus the
position embedding of its place in the grid the encoder was trained on; then pre-norm encoder layers
(LayerNorm, bidirectional attention, LayerNorm, a gelu-tanh MLP) and a final LayerNorm. A tile whose
lower or right part is padding (its patch mask False there) spreads its real patches over the whole grid
of positions (NaViT's fractional coordinates, as transformers' Idefics3VisionEmbeddings does); padding
patches take position 0 and are never attended to. Nothing is cached: an image is encoded once.

The rows of every linear are (tiles x patches, features), as in the text model, so the CPU's packed
linears (cpu/linear.py), which take 2-D inputs, can replace these too. q/k/v are one matmul (`qkv_proj`),
as in models/llama.py; the loader copies the checkpoint's q_proj, k_proj and v_proj into its shards.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


def bucketed_position_ids(patch_mask: torch.Tensor, side: int) -> torch.Tensor:
    """(tiles, rows, cols) bool -> (tiles, rows x cols) ids into the side x side grid of position embeddings.
    A tile of r real patch rows places row i at fraction i / r of the grid, bucketed into the grid's side rows
    (columns alike); a full tile (r = side) gets the plain ids 0 .. side^2 - 1."""
    tiles, rows, cols = patch_mask.shape
    boundaries = torch.arange(1 / side, 1.0, 1 / side, device=patch_mask.device)

    def buckets(num_real: torch.Tensor, n: int) -> torch.Tensor:      # (tiles,) -> (tiles, n)
        fractions = torch.arange(n, device=patch_mask.device, dtype=torch.float32)[None, :] * (1.0 / num_real)[:, None]
        return torch.bucketize(fractions.clamp(max=1.0 - 1e-6), boundaries, right=True)

    h = buckets(patch_mask[:, :, 0].sum(dim=1), rows)
    w = buckets(patch_mask[:, 0, :].sum(dim=1), cols)
    ids = (h[:, :, None] * side + w[:, None, :]).reshape(tiles, -1)
    return torch.where(patch_mask.reshape(tiles, -1), ids, 0)


class SiglipVisionEmbeddings(nn.Module):
    def __init__(self, v: dict) -> None:
        super().__init__()
        self.side = v["image_size"] // v["patch_size"]       # patches along a side of a full tile
        self.patch_embedding = nn.Conv2d(v["num_channels"], v["hidden_size"], v["patch_size"], v["patch_size"])
        self.position_embedding = nn.Embedding(self.side ** 2, v["hidden_size"])

    def forward(self, pixel_values: torch.Tensor, patch_mask: torch.Tensor) -> torch.Tensor:
        """(tiles, 3, H, W), (tiles, H/p, W/p) -> (tiles, patches, hidden)."""
        x = self.patch_embedding(pixel_values).flatten(2).transpose(1, 2)
        return x + self.position_embedding(bucketed_position_ids(patch_mask, self.side))


class SiglipAttention(nn.Module):
    def __init__(self, v: dict) -> None:
        super().__init__()
        hidden, self.num_heads = v["hidden_size"], v["num_attention_heads"]
        self.head_dim = hidden // self.num_heads
        self.qkv_proj = nn.Linear(hidden, 3 * hidden)
        self.qkv_proj.shard_sizes = [hidden, hidden, hidden]      # read by the loader
        self.out_proj = nn.Linear(hidden, hidden)

    def forward(self, x: torch.Tensor, tiles: int, key_mask: torch.Tensor | None) -> torch.Tensor:
        """x: (tiles x patches, hidden); each tile attends within itself, to its real patches (key_mask:
        (tiles, 1, 1, patches) bool, or None when every patch is real)."""
        rows, hidden = x.shape
        qkv = self.qkv_proj(x).view(tiles, rows // tiles, 3, self.num_heads, self.head_dim)
        q, k, v = qkv.permute(2, 0, 3, 1, 4)                        # each (tiles, heads, patches, head_dim)
        o = F.scaled_dot_product_attention(q, k, v, attn_mask=key_mask)
        return self.out_proj(o.transpose(1, 2).reshape(rows, hidden))


class SiglipMLP(nn.Module):
    def __init__(self, v: dict) -> None:
        super().__init__()
        self.fc1 = nn.Linear(v["hidden_size"], v["intermediate_size"])
        self.fc2 = nn.Linear(v["intermediate_size"], v["hidden_size"])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(F.gelu(self.fc1(x), approximate="tanh"))     # hidden_act gelu_pytorch_tanh


class SiglipEncoderLayer(nn.Module):
    def __init__(self, v: dict) -> None:
        super().__init__()
        self.layer_norm1 = nn.LayerNorm(v["hidden_size"], eps=v["layer_norm_eps"])
        self.self_attn = SiglipAttention(v)
        self.layer_norm2 = nn.LayerNorm(v["hidden_size"], eps=v["layer_norm_eps"])
        self.mlp = SiglipMLP(v)

    def forward(self, x, tiles, key_mask):
        x = x + self.self_attn(self.layer_norm1(x), tiles, key_mask)
        return x + self.mlp(self.layer_norm2(x))


class SiglipEncoder(nn.Module):
    """The layers, under the checkpoint's name (encoder.layers.N); the tower's forward runs them."""

    def __init__(self, v: dict) -> None:
        super().__init__()
        self.layers = nn.ModuleList(SiglipEncoderLayer(v) for _ in range(v["num_hidden_layers"]))


class SiglipVisionTransformer(nn.Module):
    """`v`: config.json's vision_config (models/config.py reads and checks it)."""

    def __init__(self, v: dict) -> None:
        super().__init__()
        self.embeddings = SiglipVisionEmbeddings(v)
        self.encoder = SiglipEncoder(v)
        self.post_layernorm = nn.LayerNorm(v["hidden_size"], eps=v["layer_norm_eps"])

    def forward(self, pixel_values: torch.Tensor, patch_mask: torch.Tensor) -> torch.Tensor:
        """(tiles, 3, H, W) pixels and (tiles, H/p, W/p) real patches -> (tiles, patches, hidden)."""
        tiles = pixel_values.shape[0]
        x = self.embeddings(pixel_values, patch_mask)
        patches = x.shape[1]
        key_mask = None if patch_mask.all() else patch_mask.reshape(tiles, 1, 1, patches)
        x = x.reshape(tiles * patches, -1)                          # rows, as every linear takes them
        for layer in self.encoder.layers:
            x = layer(x, tiles, key_mask)
        return self.post_layernorm(x).view(tiles, patches, -1)
