"""Qwen2.5-VL's vision encoder: an image's patches in, one row per language-model token out.

The processor cuts an image into patches of patch_size x patch_size pixels (each repeated temporal_patch_size
times: a still image is a video of one step) and lists them merge block by merge block: the
spatial_merge_size^2 patches that become one language-model token are consecutive rows. The encoder:

  patch_embed   a 3D convolution whose kernel is the patch: one linear map per patch
  rotary        2D positions: half of each head's frequencies turn with the patch's row, half with its column
  blocks        pre-norm transformer blocks (RMSNorm, SwiGLU MLP); most attend within windows of
                window_size pixels, the fullatt_block_indexes over the whole image
  merger        each merge block's patches concatenated, then an MLP: one row per language-model token

Windows are made by reordering: the merge blocks are sorted window by window, every block runs on the
reordered rows (a window is then a contiguous run), and the merger's rows are put back in the image's order.
One image at a time, so full attention spans one frame and window attention one window of it.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from nanopaged.models.llama import RMSNorm, apply_rotary

VISION_EPS = 1e-6     # every norm of the encoder (transformers hard-codes it too)
# transformers' Qwen2_5_VLVisionConfig defaults: a hub config.json may leave a field out
VISION_DEFAULTS = dict(depth=32, hidden_size=3584, intermediate_size=3420, num_heads=16, in_channels=3, patch_size=14,
                       spatial_merge_size=2, temporal_patch_size=2, window_size=112, out_hidden_size=3584,
                       fullatt_block_indexes=(7, 15, 23, 31), hidden_act="silu")


class PatchEmbed(nn.Module):
    def __init__(self, vision: dict) -> None:
        super().__init__()
        self.hidden_size = vision["hidden_size"]
        self.shape = (vision["in_channels"], vision["temporal_patch_size"], vision["patch_size"], vision["patch_size"])
        self.proj = nn.Conv3d(vision["in_channels"], self.hidden_size, kernel_size=self.shape[1:],
                              stride=self.shape[1:], bias=False)

    def forward(self, pixel_values: torch.Tensor) -> torch.Tensor:   # (patches, channels * t * p * p)
        patches = pixel_values.to(self.proj.weight.dtype).view(-1, *self.shape)
        return self.proj(patches).view(-1, self.hidden_size)        # (patches, hidden)


class VisionAttention(nn.Module):
    def __init__(self, vision: dict) -> None:
        super().__init__()
        self.num_heads = vision["num_heads"]
        self.qkv = nn.Linear(vision["hidden_size"], 3 * vision["hidden_size"])
        self.proj = nn.Linear(vision["hidden_size"], vision["hidden_size"])

    def forward(self, x, rope, segments: list[int]) -> torch.Tensor:
        """Each segment of consecutive rows (a window, or a frame) attends to itself alone."""
        n = x.shape[0]
        q, k, v = self.qkv(x).view(n, 3, self.num_heads, -1).unbind(1)        # each (patches, heads, head_dim)
        q, k = (apply_rotary(t.float(), rope).to(t.dtype) for t in (q, k))    # rotated in float32, as transformers
        out = [F.scaled_dot_product_attention(*(t.transpose(0, 1) for t in seg)).transpose(0, 1)
               for seg in zip(q.split(segments), k.split(segments), v.split(segments))]
        return self.proj(torch.cat(out).reshape(n, -1))


class VisionMLP(nn.Module):
    """SwiGLU with biases; gate and up in one matmul (the loader fills the two halves)."""

    def __init__(self, vision: dict) -> None:
        super().__init__()
        hidden, inner = vision["hidden_size"], vision["intermediate_size"]
        self.gate_up_proj = nn.Linear(hidden, 2 * inner)
        self.gate_up_proj.shard_sizes = [inner, inner]
        self.down_proj = nn.Linear(inner, hidden)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up_proj(x).chunk(2, dim=-1)
        return self.down_proj(F.silu(gate) * up)


class VisionBlock(nn.Module):
    def __init__(self, vision: dict) -> None:
        super().__init__()
        self.norm1 = RMSNorm(vision["hidden_size"], VISION_EPS)
        self.attn = VisionAttention(vision)
        self.norm2 = RMSNorm(vision["hidden_size"], VISION_EPS)
        self.mlp = VisionMLP(vision)

    def forward(self, x, rope, segments):
        x = x + self.attn(self.norm1(x), rope, segments)
        return x + self.mlp(self.norm2(x))


class PatchMerger(nn.Module):
    def __init__(self, vision: dict) -> None:
        super().__init__()
        merged = vision["hidden_size"] * vision["spatial_merge_size"] ** 2
        self.ln_q = RMSNorm(vision["hidden_size"], VISION_EPS)
        self.mlp = nn.Sequential(nn.Linear(merged, merged), nn.GELU(), nn.Linear(merged, vision["out_hidden_size"]))

    def forward(self, x: torch.Tensor) -> torch.Tensor:    # (patches, hidden) -> (patches / merge^2, out_hidden)
        return self.mlp(self.ln_q(x).view(-1, self.mlp[0].in_features))


class VisionTransformer(nn.Module):
    def __init__(self, vision: dict) -> None:
        super().__init__()
        vision = {**VISION_DEFAULTS, **vision}
        if vision["hidden_act"] != "silu":
            raise ValueError(f"vision_config.hidden_act {vision['hidden_act']!r} is not supported; only 'silu'")
        self.merge = vision["spatial_merge_size"]
        # a window's side in merge blocks (window_size is in pixels)
        self.window = vision["window_size"] // vision["spatial_merge_size"] // vision["patch_size"]
        self.full_attention = set(vision["fullatt_block_indexes"])
        self.head_dim = vision["hidden_size"] // vision["num_heads"]
        self.rope_theta = (vision.get("rope_parameters") or {}).get("rope_theta", 10000.0)
        self.patch_embed = PatchEmbed(vision)
        self.blocks = nn.ModuleList(VisionBlock(vision) for _ in range(vision["depth"]))
        self.merger = PatchMerger(vision)

    def forward(self, pixel_values: torch.Tensor, grid_thw: torch.Tensor) -> torch.Tensor:
        """One image's rows: pixel_values (t * h * w, patch values), grid_thw (1, 3) its patches (t, h, w)."""
        t, h, w = (int(v) for v in grid_thw.reshape(3))
        unit = self.merge ** 2
        order, window_lengths = self.window_order(t, h // self.merge, w // self.merge)
        rows = (order[:, None] * unit + torch.arange(unit)).flatten().to(pixel_values.device)  # patches, windowed
        x = self.patch_embed(pixel_values)[rows]
        rope = tuple(table[rows] for table in self.rotary(t, h, w))
        frames = [h * w] * t
        windows = [n * unit for n in window_lengths]
        for i, block in enumerate(self.blocks):
            x = block(x, rope, frames if i in self.full_attention else windows)
        merged = self.merger(x)                          # (merge blocks, out_hidden), in window order
        return merged[torch.argsort(order.to(merged.device))]

    def rotary(self, t: int, h: int, w: int) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin per patch in the processor's order (merge block by merge block), each (patches, 1, head_dim):
        the first quarter of the frequencies turned by the patch's row, the second by its column, then repeated."""
        m, quarter = self.merge, torch.arange(0, self.head_dim // 2, 2, dtype=torch.float) / (self.head_dim // 2)
        inv_freq = 1.0 / self.rope_theta ** quarter      # (head_dim / 4,), float32 whatever the model's dtype
        row, col = torch.meshgrid(torch.arange(h), torch.arange(w), indexing="ij")
        # (h, w) -> (h / m, w / m, m, m): the patches of a merge block next to each other
        blocks = lambda grid: grid.view(h // m, m, w // m, m).transpose(1, 2).flatten().repeat(t)   # noqa: E731
        positions = torch.stack((blocks(row), blocks(col)), dim=-1)           # (patches, 2)
        freqs = (positions[..., None].float() * inv_freq).flatten(1)          # (patches, head_dim / 2)
        emb = torch.cat((freqs, freqs), dim=-1)[:, None].to(self.merger.ln_q.weight.device)
        return emb.cos(), emb.sin()

    def window_order(self, t: int, h: int, w: int) -> tuple[torch.Tensor, list[int]]:
        """The merge blocks (a grid of t x h x w) listed window by window, each window a square of `self.window`
        blocks a side from the top left (those at the right and bottom edges smaller); and each window's count."""
        index = torch.arange(t * h * w).view(t, h, w)
        order, lengths = [], []
        for frame in index:
            for top in range(0, h, self.window):
                for left in range(0, w, self.window):
                    window = frame[top:top + self.window, left:left + self.window].flatten()
                    order.append(window)
                    lengths.append(window.numel())
        return torch.cat(order), lengths
