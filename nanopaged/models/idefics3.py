"""Idefics3 / SmolVLM: a SigLIP vision tower, a connector, and a Llama text model that reads their rows.

The processor turns each image into square tiles (a large one: a grid of tiles, then the whole image shrunk
to one "global" tile) and each tile into a run of `<image>` tokens in the prompt. The vision tower
(models/siglip.py) gives one row per patch of a tile; the connector's pixel shuffle folds each s x s block of
neighbouring patch rows into one row s^2 times wider, and one linear takes it to the text model's width:
one row per `<image>` token. Those rows replace the `<image>` tokens' embeddings; the rest is the text model
of models/llama.py, with its paged KV cache, unchanged.

The text model sits at `model`, as in every LlamaForCausalLM, so each stage of the model pipeline (quantize,
pack, adapters, fuse: models/pipeline.py) finds the text layers where it always does; the loader maps the
checkpoint's names onto this layout by `checkpoint_prefixes`. vLLM: model_executor/models/idefics3.py.
"""
from __future__ import annotations

import torch
from torch import nn

from nanopaged.models.config import ModelConfig
from nanopaged.models.llama import LlamaForCausalLM
from nanopaged.models.siglip import SiglipVisionTransformer
from nanopaged.multimodal.placeholders import ImageInput, MultiModalPrompt


def pixel_shuffle(x: torch.Tensor, s: int) -> torch.Tensor:
    """(tiles, side^2, d) -> (tiles, (side/s)^2, d s^2): each s x s block of neighbouring patches becomes one
    row, their features side by side; the same moves as transformers' Idefics3Connector.pixel_shuffle."""
    tiles, seq, d = x.shape
    side = int(seq ** 0.5)
    x = x.view(tiles, side, side // s, d * s)                      # s neighbours along a row of patches
    x = x.permute(0, 2, 1, 3).reshape(tiles, side // s, side // s, d * s * s)   # then s such rows
    return x.permute(0, 2, 1, 3).reshape(tiles, seq // (s * s), d * s * s)


class ModalityProjection(nn.Module):
    """One linear, under the checkpoint's name (connector.modality_projection.proj)."""

    def __init__(self, in_features: int, out_features: int) -> None:
        super().__init__()
        self.proj = nn.Linear(in_features, out_features, bias=False)


class Idefics3Connector(nn.Module):
    def __init__(self, vision_hidden: int, text_hidden: int, scale_factor: int) -> None:
        super().__init__()
        self.scale_factor = scale_factor
        self.modality_projection = ModalityProjection(vision_hidden * scale_factor ** 2, text_hidden)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """(tiles, patches, vision hidden) -> (tiles x patches / s^2, text hidden), tile after tile."""
        x = pixel_shuffle(x, self.scale_factor)
        return self.modality_projection.proj(x.reshape(-1, x.shape[-1]))


class Idefics3ForConditionalGeneration(LlamaForCausalLM):
    """The text model and its head (LlamaForCausalLM: build, compute_logits), the vision tower and connector
    beside them. `cfg.vision`: config.json's vision numbers (models/vision_config.py: idefics3_vision)."""

    # checkpoint name prefix -> ours (vLLM: hf_to_vllm_mapper), read by models/loader.py
    checkpoint_prefixes = {"model.text_model.": "model.", "model.vision_model.": "vision_model.",
                           "model.connector.": "connector."}

    def __init__(self, cfg: ModelConfig, backend, max_len: int) -> None:
        super().__init__(cfg, backend, max_len)
        vision = cfg.vision["vision_config"]
        self.patch_size = vision["patch_size"]
        self.vision_model = SiglipVisionTransformer(vision)
        self.connector = Idefics3Connector(vision["hidden_size"], cfg.hidden_size, cfg.vision["scale_factor"])

    # ---- prompt processing (no weights) --------------------------------------------------------------
    @staticmethod
    def load_processor(folder: str):
        """The folder's Idefics3Processor: transformers' image splitting, resizing and placeholder expansion."""
        # here, not at the top: transformers' processing modules import its modeling code and torch's compiler
        from transformers import AutoProcessor
        return AutoProcessor.from_pretrained(folder)

    @staticmethod
    def process(processor, prompt: str, images: list) -> MultiModalPrompt:
        """The prompt's token ids with every `<image>` expanded by the folder's processor (AutoProcessor), and
        per image its span, the offsets of its `<image>` tokens in the span, and its own tiles' tensors."""
        placeholders = prompt.count(processor.image_token)
        if placeholders != len(images):
            raise ValueError(f"the prompt holds {placeholders} {processor.image_token} placeholders but "
                             f"{len(images)} images were given: one image per placeholder")
        out = processor(text=[prompt], images=[list(images)] if images else None, return_tensors="pt")
        ids = out["input_ids"][0].tolist()
        spans = image_spans(ids, processor.fake_image_token_id, processor.global_image_token_id,
                            processor.image_seq_len)
        if len(spans) != len(images):
            raise ValueError(f"the prompt spells image markers of its own: {len(spans)} image spans after "
                             f"processing, {len(images)} images")
        inputs, first_tile = [], 0
        for start, end in spans:
            embed_positions = [i - start for i in range(start, end) if ids[i] == processor.image_token_id]
            tiles = len(embed_positions) // processor.image_seq_len
            data = {name: out[name][0, first_tile:first_tile + tiles].clone()   # this image's tiles alone
                    for name in ("pixel_values", "pixel_attention_mask") if name in out}
            inputs.append(ImageInput(start, end - start, embed_positions, data))
            first_tile += tiles
        return MultiModalPrompt(ids, inputs)

    # ---- the engine's calls -----------------------------------------------------------------------------
    def encode_image(self, data: dict[str, torch.Tensor]) -> torch.Tensor:
        """One image's tiles -> (tiles x image_seq_len, text hidden) in the model's dtype: the rows of its
        `<image>` tokens in their order (transformers' get_image_features for that image, flattened)."""
        conv = self.vision_model.embeddings.patch_embedding       # never swapped by a pipeline stage
        pixels = data["pixel_values"].to(conv.weight.device, conv.weight.dtype)
        mask = data.get("pixel_attention_mask")
        mask = torch.ones_like(pixels[:, 0], dtype=torch.bool) if mask is None else mask.to(pixels.device)
        p = self.patch_size
        patch_mask = mask.unfold(1, p, p).unfold(2, p, p).sum(dim=(-1, -2)) > 0   # a patch with any real pixel
        return self.connector(self.vision_model(pixels, patch_mask))

    def embed_input_ids(self, input_ids: torch.Tensor) -> torch.Tensor:
        """(tokens,) -> (tokens, hidden): the embeddings an image's rows then overwrite at its positions."""
        return self.model.embed_tokens(input_ids)


def image_spans(ids: list[int], fake_id: int, global_id: int, image_seq_len: int) -> list[tuple[int, int]]:
    """[start, end) of each image in the processed ids: from its first `<fake_token_around_image>` through the
    one that closes its global tile, `<fake_token_around_image><global-img>` + image_seq_len x `<image>` +
    `<fake_token_around_image>`, which every image ends with, split or not."""
    spans, start, i = [], None, 0
    while i < len(ids):
        if ids[i] == fake_id and start is None:
            start = i
        elif ids[i] == global_id and start is not None:
            end = i + image_seq_len + 2         # past <global-img>, its image tokens and the closing marker
            spans.append((start, end))
            start, i = None, end
            continue
        i += 1
    return spans
