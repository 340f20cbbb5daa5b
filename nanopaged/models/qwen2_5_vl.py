"""Qwen2.5-VL: a vision encoder (models/qwen2_5_vl_vision.py) beside Qwen2's layers, with multimodal rotary positions.

The language model is llama.py's Qwen2 (q/k/v biases); two things differ. An image's placeholder tokens take the
encoder's rows instead of their embeddings (`inputs_embeds`, which the engine assembles from `embed_input_ids`
and `encode_image`). And a position is three numbers, (temporal, height, width), not one (M-RoPE): a text token
has the same number in all three, one past the token before; an image's tokens are a grid, the first row at the
image's start, each token numbered by its (frame, row, column) within it, and the text after it resumes one past
the largest. Each head's rotary frequencies are cut into three sections (`mrope_section`), turned by the
temporal, height and width numbers in turn. Positions therefore run slower than token indices: past the prompt a
token's three numbers are its index + `mrope_delta` (negative where images saved positions).
"""
from __future__ import annotations

import torch

from nanopaged.models.config import ModelConfig
from nanopaged.models.llama import LlamaForCausalLM, LlamaModel, RotaryEmbedding
from nanopaged.models.qwen2_5_vl_vision import VisionTransformer
from nanopaged.multimodal.placeholders import ImageInput, MultiModalPrompt


class MRotaryEmbedding(RotaryEmbedding):
    """RotaryEmbedding's tables, read with three positions per token: frequency i turns with row
    `rows[i]` of the positions (0 temporal, 1 height, 2 width), as the config's mrope_section cuts them."""

    def __init__(self, cfg: ModelConfig, max_len: int) -> None:
        super().__init__(cfg, max_len)
        half = [row for row, size in enumerate(cfg.mrope_section) for _ in range(size)]    # head_dim / 2 of them
        self.register_buffer("rows", torch.tensor(half + half), persistent=False)    # (head_dim,): both halves alike

    def forward(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """positions (3, tokens) -> the step's (cos, sin), each (tokens, 1, head_dim); (tokens,) positions (text
        alone, as the runner's memory profile passes them) turn all three sections alike."""
        positions = positions.expand(3, -1) if positions.dim() == 1 else positions
        per_dim = positions.t()[:, self.rows]                     # (tokens, head_dim): the position each dim turns by
        dims = torch.arange(per_dim.shape[1], device=per_dim.device)
        return self.cos[per_dim, dims].unsqueeze(1).to(dtype), self.sin[per_dim, dims].unsqueeze(1).to(dtype)


class Qwen2_5_VLTextModel(LlamaModel):
    def __init__(self, cfg: ModelConfig, backend, max_len: int) -> None:
        super().__init__(cfg, backend, max_len)
        self.rotary = MRotaryEmbedding(cfg, max_len)


class Qwen2_5_VLForConditionalGeneration(LlamaForCausalLM):
    """`model` (the language model) and `lm_head` as in LlamaForCausalLM, `visual` beside them: the names of
    the checkpoints on the hub; newer files nest both under `model.` (read by models/loader.py)."""
    model_class = Qwen2_5_VLTextModel
    checkpoint_prefixes = {"model.language_model.": "model.", "model.visual.": "visual."}
    mrope = True            # its positions are (3, tokens): the engine fills them (multimodal/encoder_outputs.py)

    def __init__(self, cfg: ModelConfig, backend, max_len: int) -> None:
        super().__init__(cfg, backend, max_len)
        self.visual = VisionTransformer(cfg.vision)

    def embed_input_ids(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.model.embed_tokens(input_ids)

    def encode_image(self, data: dict[str, torch.Tensor]) -> torch.Tensor:
        """One image's rows for its placeholder tokens, (num_embeds, hidden), in the model's dtype."""
        return self.visual(data["pixel_values"], data["image_grid_thw"])

    @staticmethod
    def load_processor(folder: str):
        """The folder's processor for images: transformers' AutoProcessor also builds Qwen2.5-VL's video processor,
        which needs torchvision; images need only the image processor and the tokenizer."""
        # here, not at the top: transformers' processing modules import its modeling code and torch's compiler
        from transformers import AutoImageProcessor, AutoTokenizer, Qwen2_5_VLProcessor

        class ImagesOnly(Qwen2_5_VLProcessor):
            def __init__(self, image_processor=None, tokenizer=None, chat_template=None, **kwargs) -> None:
                super().__init__(image_processor, tokenizer, None, chat_template=chat_template, **kwargs)
        return ImagesOnly(AutoImageProcessor.from_pretrained(folder), AutoTokenizer.from_pretrained(folder))

    @staticmethod
    def process(processor, prompt: str, images: list) -> MultiModalPrompt:
        """The prompt's token ids with each image's placeholder run expanded by `processor` (the folder's
        Qwen2_5_VLProcessor), each image's span and encoder inputs, and its M-RoPE positions."""
        token = processor.image_token
        if prompt.count(token) != len(images):
            raise ValueError(f"the prompt holds {prompt.count(token)} image placeholders ({token}) but "
                             f"{len(images)} images were given")
        out = processor(text=[prompt], images=images or None, return_tensors="pt")
        token_ids = out["input_ids"][0].tolist()
        spans = placeholder_runs(token_ids, processor.image_token_id)
        merge = processor.image_processor.merge_size
        inputs, first_row = [], 0
        for i, (offset, length) in enumerate(spans):
            grid = out["image_grid_thw"][i:i + 1]
            patches = int(grid.prod())
            assert length == patches // merge ** 2, "the processor expands each image to one token per merge block"
            data = {"pixel_values": out["pixel_values"][first_row:first_row + patches], "image_grid_thw": grid}
            inputs.append(ImageInput(offset, length, list(range(length)), data))
            first_row += patches
        positions, delta = mrope_positions(len(token_ids), inputs, merge)
        return MultiModalPrompt(token_ids, inputs, positions, delta)


def placeholder_runs(token_ids: list[int], token_id: int) -> list[tuple[int, int]]:
    """(offset, length) of each run of `token_id`, in order."""
    runs = []
    for i, t in enumerate(token_ids):
        if t != token_id:
            continue
        if runs and runs[-1][0] + runs[-1][1] == i:
            runs[-1] = (runs[-1][0], runs[-1][1] + 1)
        else:
            runs.append((i, 1))
    return runs


def mrope_positions(num_tokens: int, images: list[ImageInput], merge: int) -> tuple[torch.Tensor, int]:
    """(3, num_tokens) positions and the delta past the prompt (transformers' get_rope_index, one sequence):
    text advances all three rows by one a token; an image's tokens are its (frame, row, column) grid of merge
    blocks, each number added to the image's start; the next text starts one past the largest number so far."""
    pieces, next_position, cursor = [], 0, 0
    for image in images:
        text = image.offset - cursor                          # the text before this image
        pieces.append(torch.arange(text).expand(3, -1) + next_position)
        next_position += text
        t, h, w = (int(v) for v in image.data["image_grid_thw"].reshape(3))
        grid = torch.meshgrid(torch.arange(t), torch.arange(h // merge), torch.arange(w // merge), indexing="ij")
        pieces.append(torch.stack(grid).reshape(3, -1) + next_position)
        next_position = int(pieces[-1].max()) + 1
        cursor = image.offset + image.length
    pieces.append(torch.arange(num_tokens - cursor).expand(3, -1) + next_position)
    positions = torch.cat(pieces, dim=1)
    return positions, int(positions.max()) + 1 - num_tokens if num_tokens else 0
