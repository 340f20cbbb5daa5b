"""Images: a vision-language model's prompts, encoder and encoder cache (docs/16_images_and_pooling.md).

    extension.py        MultiModal: how it attaches to the engine, installed for a vision-language model folder
    input_processor.py  {"prompt", "multi_modal_data"} in: images checked, hashed, processed into spans of tokens
    placeholders.py     the records processing leaves: each image's span, its embedding rows, the encoder's inputs
    encoder_outputs.py  before the forward pass: encode the step's new images, put their rows in place
    media.py            an image from bytes, a data: URL or an allowed local file, checked before it is decoded
    chat_parts.py       chat messages with image_url parts to a prompt and its images

The scheduler's half, which images a step encodes and which it keeps, is core: core/encoder_cache.py.
"""
