"""An image in a prompt, as processing leaves it: where its placeholder tokens sit and what the encoder reads.

A vision-language model's processor turns a prompt with images into token ids in which each image is a span of
placeholder tokens (Idefics3: a grid of tiles, each `<row_i_col_j>` followed by its image tokens, between
`<fake_token_around_image>` markers; Qwen2.5-VL: a run of `<|image_pad|>`). The encoder gives one row per image
token; the model takes those rows in place of the image tokens' embeddings. vLLM: PlaceholderRange and is_embed.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch


@dataclass
class ImageInput:
    offset: int                       # the prompt position of the span's first token
    length: int                       # the span's tokens, markers between tiles included
    embed_positions: list[int]        # offsets within the span whose rows take the encoder's rows, in order
    data: dict[str, torch.Tensor] = field(default_factory=dict)   # what the model's encode_image reads

    @property
    def num_embeds(self) -> int:
        """Rows the encoder gives for this image: the encoder cache's unit."""
        return len(self.embed_positions)


@dataclass
class MultiModalPrompt:
    token_ids: list[int]
    images: list[ImageInput]
    mrope_positions: torch.Tensor | None = None   # (3, len(token_ids)): multimodal rotary positions (Qwen2.5-VL)
    mrope_delta: int = 0                          # a position past the prompt: its index + mrope_delta
