"""Tiny random vision-language models saved as transformers saves them, each with a processor built offline."""
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
