"""Tiny random vision-language models saved as transformers saves them, with processors built offline."""
from pathlib import Path

import torch

from conftest import _randomize, _tiny_tokenizer

# Idefics3: 32-pixel tiles of 8-pixel patches (a 4 x 4 grid), pixel shuffle by 2: 4 <image> tokens a tile; an
# image's longest edge is resized to 96 pixels, so a 96 x 64 image splits into 2 x 3 tiles and its global tile
IDEFICS3_TILE, IDEFICS3_IMAGE_SEQ_LEN = 32, 4
IDEFICS3_CHAT_TEMPLATE = (
    "{% for message in messages %}<|im_start|>{{ message['role'] | capitalize }}:"
    "{% for item in message['content'] %}{% if item['type'] == 'image' %}<image>"
    "{% else %}{{ item['text'] }}{% endif %}{% endfor %}<end_of_utterance>\n{% endfor %}"
    "{% if add_generation_prompt %}Assistant:{% endif %}")


def tiny_idefics3(folder) -> str:
    """A tiny random Idefics3ForConditionalGeneration (float32, untied head), its Idefics3Processor and
    tokenizer, saved in `folder`; returns the folder as a string."""
    from transformers import (Idefics3Config, Idefics3ForConditionalGeneration, Idefics3ImageProcessorPil,
                              Idefics3Processor)
    tokenizer = _tiny_tokenizer()
    markers = ["<fake_token_around_image>", "<image>", "<global-img>", "<end_of_utterance>"]
    markers += [f"<row_{i}_col_{j}>" for i in range(1, 7) for j in range(1, 7)]
    tokenizer.add_special_tokens({"additional_special_tokens": markers})
    image_processor = Idefics3ImageProcessorPil(
        size={"longest_edge": 3 * IDEFICS3_TILE}, max_image_size={"longest_edge": IDEFICS3_TILE})
    processor = Idefics3Processor(image_processor, tokenizer, image_seq_len=IDEFICS3_IMAGE_SEQ_LEN,
                                  chat_template=IDEFICS3_CHAT_TEMPLATE)
    config = Idefics3Config(
        vision_config=dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                           image_size=IDEFICS3_TILE, patch_size=8),
        text_config=dict(model_type="llama", vocab_size=len(tokenizer), hidden_size=64, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, intermediate_size=128,
                         max_position_embeddings=512, rms_norm_eps=1e-5, bos_token_id=1, eos_token_id=2,
                         pad_token_id=2),
        scale_factor=2, image_token_id=tokenizer.convert_tokens_to_ids("<image>"), tie_word_embeddings=False)
    torch.manual_seed(0)
    model = Idefics3ForConditionalGeneration(config).float()
    _randomize(model)
    model.save_pretrained(folder, safe_serialization=True)
    processor.save_pretrained(folder)
    return str(folder)


# Qwen2-VL's chat template in small: an image content part becomes its one placeholder run between markers.
QWEN_VL_CHAT_TEMPLATE = (
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n"
    "{% if message['content'] is string %}{{ message['content'] }}{% else %}{% for part in message['content'] %}"
    "{% if part['type'] == 'image' %}<|vision_start|><|image_pad|><|vision_end|>"
    "{% elif part['type'] == 'text' %}{{ part['text'] }}{% endif %}{% endfor %}{% endif %}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
QWEN_VL_TOKENS = ["<|vision_start|>", "<|image_pad|>", "<|vision_end|>"]


def qwen2_5_vl_processor(image_processor, tokenizer):
    """Qwen2_5_VLProcessor for images only: transformers' own needs a video processor, which needs torchvision."""
    from transformers import Qwen2_5_VLProcessor

    class ImageOnlyProcessor(Qwen2_5_VLProcessor):
        def __init__(self, image_processor=None, tokenizer=None, chat_template=None, **kwargs):
            super().__init__(image_processor, tokenizer, None, chat_template=chat_template, **kwargs)

    return ImageOnlyProcessor(image_processor=image_processor, tokenizer=tokenizer, chat_template=QWEN_VL_CHAT_TEMPLATE)


def tiny_qwen2_5_vl(folder: str | Path):
    """A Qwen2.5-VL of 2 text layers (hidden 64) and 4 vision blocks (hidden 32; blocks 1 and 3 attend over the
    whole image, 0 and 2 within windows of 2 x 2 merged tokens, 56 pixels), saved in `folder` with its
    tokenizer and image processor; returns its processor: 14-pixel patches merged 2 x 2, so an image becomes
    one token per 28 x 28 pixels (between 4 and 64 of them)."""
    from transformers import Qwen2_5_VLConfig, Qwen2_5_VLForConditionalGeneration, Qwen2VLImageProcessorPil
    tokenizer = _tiny_tokenizer()
    tokenizer.add_special_tokens({"additional_special_tokens": QWEN_VL_TOKENS})
    image_token_id, start_id = tokenizer.convert_tokens_to_ids(["<|image_pad|>", "<|vision_start|>"])
    config = Qwen2_5_VLConfig(
        text_config=dict(vocab_size=len(tokenizer), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                         rms_norm_eps=1e-6, bos_token_id=1, eos_token_id=2, pad_token_id=2,
                         rope_parameters={"rope_type": "default", "rope_theta": 1_000_000.0,
                                          "mrope_section": [2, 3, 3]}),
        vision_config=dict(depth=4, hidden_size=32, intermediate_size=48, num_heads=2, out_hidden_size=64,
                           patch_size=14, temporal_patch_size=2, spatial_merge_size=2, window_size=56,
                           fullatt_block_indexes=[1, 3]),
        image_token_id=image_token_id, vision_start_token_id=start_id, tie_word_embeddings=False)
    torch.manual_seed(0)
    model = Qwen2_5_VLForConditionalGeneration(config).float()
    _randomize(model)
    model.save_pretrained(folder, safe_serialization=True)
    processor = qwen2_5_vl_processor(Qwen2VLImageProcessorPil(min_pixels=28 * 28 * 4, max_pixels=28 * 28 * 64),
                                     tokenizer)
    processor.save_pretrained(folder)
    return processor
