"""A chat conversation with images as the engine's prompt: the chat template's text and the images, in order.

OpenAI's messages carry images as content parts, {"type": "image_url", "image_url": {"url": ...}}; offline,
vLLM takes {"type": "image_pil", "image_pil": PIL image} and {"type": "image", "image": PIL image or bytes}
too. Hugging Face's multimodal chat templates read each image as {"type": "image"} and write the model's
image marker where it stands; the model's processor (engine side) later widens each marker into the image's
placeholder tokens. So each image part becomes {"type": "image"}, its image is loaded (media.py), and the
result is vLLM's prompt form {"prompt": text, "multi_modal_data": {"image": [...]}}. A conversation without
image parts renders exactly as before (engine/input_processor.py: render_chat).
vLLM: vllm/entrypoints/chat_utils.py (parse_chat_messages, resolve_hf_chat_template).
"""
from __future__ import annotations

import functools
import json
from pathlib import Path

from nanopaged.engine.input_processor import CHAT_ROLES, render_chat
from nanopaged.multimodal.media import check_image_count, image_bytes_from_url, images_per_prompt, load_images
from nanopaged.validation import encodes_as_utf8

IMAGE_PARTS = ("image_url", "image_pil", "image")      # a content part's type that carries an image


def chat_prompt(tokenizer, conversation, config, chat_template: str | None = None) -> dict:
    """One conversation as a prompt. With image parts: the template's text and the images loaded, under the
    engine's allowed_local_media_path and limit_mm_per_prompt; without: render_chat's prompt, as always."""
    tools = conversation.get("tools") if isinstance(conversation, dict) else None
    messages = conversation.get("messages") if isinstance(conversation, dict) else conversation
    if not holds_images(messages):
        return render_chat(tokenizer, conversation, chat_template)
    counted = sum(_is_image(p) for m in messages if isinstance(m, dict) and isinstance(m.get("content"), list)
                  for p in m["content"])
    check_image_count(counted, images_per_prompt(config.limit_mm_per_prompt), "messages")
    sources = []                 # (encoded bytes or a PIL image, its field), in order
    messages = [_message(m, i, sources, config.allowed_local_media_path) for i, m in enumerate(messages)]
    if config.model_config.vision is None:      # each part checked and read above, none decoded
        raise ValueError(f"messages: {config.model_config.architecture} is a text-only model and takes no images "
                         "(a vision-language model's folder does)")
    images = load_images(sources, "messages")
    # The processor's template first, as vLLM: a VLM's tokenizer may carry a text-only one.
    template = chat_template or folder_chat_template(config.model)
    try:
        text = tokenizer.apply_chat_template(messages, tools=tools, tokenize=False, add_generation_prompt=True,
                                             chat_template=template)
    except Exception as e:       # jinja's TypeError, TemplateError, ...: a text model's template meets a list
        raise ValueError(f"messages: the chat template cannot render image parts (is this a vision-language "
                         f"model?): {type(e).__name__}: {e}") from None
    return {"prompt": text, "multi_modal_data": {"image": images}}


def holds_images(messages) -> bool:
    return isinstance(messages, (list, tuple)) and any(
        isinstance(m, dict) and isinstance(m.get("content"), list) and any(_is_image(p) for p in m["content"])
        for m in messages)


def _is_image(part) -> bool:
    return isinstance(part, dict) and part.get("type") in IMAGE_PARTS


def _message(m, i: int, sources: list, allowed_local_media_path: str | None) -> dict:
    """The message as a multimodal template reads it: content always a list of parts (a string becomes
    one text part, vLLM's "openai" content format); each image part {"type": "image"}, its source appended."""
    if not isinstance(m, dict) or "role" not in m or "content" not in m:
        raise ValueError(f"messages[{i}]: a chat message is a dict with 'role' and 'content', got {m!r:.200}")
    if m["role"] not in CHAT_ROLES:
        raise ValueError(f"messages[{i}].role must be one of {list(CHAT_ROLES)}, got {m['role']!r:.100}")
    content = m["content"]
    if isinstance(content, str):
        content = [{"type": "text", "text": content}]
    if not isinstance(content, list):
        raise ValueError(f"messages[{i}].content must be a string or a list of parts, got {content!r:.200}")
    parts = [_part(p, f"messages[{i}].content[{j}]", sources, allowed_local_media_path)
             for j, p in enumerate(content)]
    return {**m, "content": parts}


def _part(part, where: str, sources: list, allowed_local_media_path: str | None) -> dict:
    kind = part.get("type") if isinstance(part, dict) else None
    if kind == "text" and isinstance(part.get("text"), str):
        if not encodes_as_utf8(part["text"]):
            raise ValueError(f"{where}.text must encode as UTF-8 (it holds a lone surrogate)")
        return {"type": "text", "text": part["text"]}
    if kind == "image_url":
        spec = part.get("image_url")
        if not isinstance(spec, dict):
            raise ValueError(f"{where}.image_url must be an object {{'url': ...}}, got {spec!r:.200}")
        where = f"{where}.image_url"
        sources.append((image_bytes_from_url(spec.get("url"), allowed_local_media_path, where), where))
    elif kind in ("image_pil", "image"):
        sources.append((part.get(kind), f"{where}.{kind}"))
    else:
        raise ValueError(f"{where} must be a text part {{'type': 'text', 'text': ...}} or an image part (type "
                         f"{' | '.join(IMAGE_PARTS)}), got {part!r:.200}")
    return {"type": "image"}


@functools.lru_cache(maxsize=8)
def folder_chat_template(folder: str) -> str | None:
    """The processor's chat template transformers saves beside a vision-language model (chat_template.jinja,
    or chat_template.json in older versions); None if there is none (the tokenizer's own is used)."""
    jinja, saved = Path(folder) / "chat_template.jinja", Path(folder) / "chat_template.json"
    if jinja.is_file():
        return jinja.read_text(encoding="utf-8")
    if not saved.is_file():
        return None
    try:
        template = json.loads(saved.read_text(encoding="utf-8"))["chat_template"]
    except (ValueError, KeyError, TypeError):
        template = None
    if not isinstance(template, str):
        raise ValueError(f"{saved} must be a JSON object with a 'chat_template' string")
    return template
