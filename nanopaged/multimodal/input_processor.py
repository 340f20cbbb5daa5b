"""A vision-language engine's way in: `{"prompt": text, "multi_modal_data": {"image": ...}}` to a request.

Every image is checked (media.py: decodable, not too large, not too many), hashed by its content, and run
through the model folder's processor with the prompt (the model class's `process`: it expands each image's
placeholder into its span of tokens); each request then carries one `EncoderInput` per image, which the
scheduler reads (core/encoder_cache.py) and the block hash keys on. A prompt without images runs as text.
"""
from __future__ import annotations

import hashlib

from nanopaged.core.encoder_cache import EncoderInput
from nanopaged.engine.input_processor import MAX_CHARS_PER_TOKEN, InputProcessor
from nanopaged.multimodal.media import check_image_count, images_per_prompt, load_images

MODALITIES = ("image",)
DEFAULT_ENCODER_ROWS = 16384


class MultiModalInputProcessor(InputProcessor):
    def __init__(self, default: InputProcessor, model_class) -> None:
        super().__init__(default.config, default.tokenizer, default.num_kv_blocks)
        self.process_images = model_class.process     # (processor, text, images) -> MultiModalPrompt
        self.processor = model_class.load_processor(default.config.model)

    def process(self, request_id: str, prompt, params=None):
        data = prompt.get("multi_modal_data") if isinstance(prompt, dict) else None
        if data is None:
            return super().process(request_id, prompt, params)
        text, images = self._checked(prompt, data, params)
        mm = self.process_images(self.processor, text, images)
        self._check_sizes(mm.images)
        rest = {key: value for key, value in prompt.items() if key not in ("multi_modal_data", "prompt")}
        samples = super().process(request_id, {**rest, "prompt_token_ids": mm.token_ids, "prompt": text}, params)
        inputs = [EncoderInput(image_hash(image), placed.offset, placed.length, placed.num_embeds, placed)
                  for image, placed in zip(images, mm.images)]
        for sample in samples:
            sample.encoder_inputs = list(inputs)
            sample.extension_fields["multimodal"] = mm
        return samples

    def _checked(self, prompt: dict, data, params) -> tuple[str, list]:
        if not isinstance(prompt.get("prompt"), str) or "prompt_token_ids" in prompt:
            raise ValueError("a prompt with multi_modal_data must be a text 'prompt' (the processor expands each "
                             "image's placeholder in the text), not prompt_token_ids")
        if params is not None and getattr(params, "truncate_prompt_tokens", None) is not None:
            raise ValueError("truncate_prompt_tokens cannot cut a prompt with images (it would cut an image's span)")
        if not isinstance(data, dict) or not set(data) <= set(MODALITIES):
            raise ValueError(f"multi_modal_data must be a dict with the keys {list(MODALITIES)}, got "
                             f"{sorted(data) if isinstance(data, dict) else type(data).__name__}")
        if len(prompt["prompt"]) > self.config.max_model_len * MAX_CHARS_PER_TOKEN:
            self._encode(prompt["prompt"])      # refuses a text far past the context from its start alone
        given = data.get("image", [])
        given = list(given) if isinstance(given, (list, tuple)) else [given]
        check_image_count(len(given), images_per_prompt(self.config.limit_mm_per_prompt), "multi_modal_data['image']")
        images = load_images([(image, f"multi_modal_data['image'][{i}]") for i, image in enumerate(given)],
                             "multi_modal_data['image']")
        return prompt["prompt"], images

    def _check_sizes(self, placed) -> None:
        budget, cache_size = encoder_limits(self.config)
        for i, image in enumerate(placed):
            if image.num_embeds > min(budget, cache_size):
                raise ValueError(f"image {i} gives {image.num_embeds} encoder rows, more than one step may encode "
                                 f"(max_num_encoder_input_tokens={budget}, encoder_cache_size={cache_size}): "
                                 "send a smaller image or raise both")


def encoder_limits(config) -> tuple[int, int]:
    """(encoder rows a step may compute, rows the cache keeps): the settings, or by default as many as the
    largest image the two families make at their processors' default sizes (Qwen2.5-VL's max_pixels), so
    no default image is refused, and at least a step's token budget."""
    budget = config.max_num_encoder_input_tokens or max(config.max_num_batched_tokens, DEFAULT_ENCODER_ROWS)
    return budget, config.encoder_cache_size or budget


def image_hash(image) -> str:
    """The image's content: its mode, size and pixels (the processor's settings are the engine's, the same for all)."""
    digest = hashlib.sha256(f"{image.mode}:{image.size}".encode())
    digest.update(image.tobytes())
    return digest.hexdigest()

