"""nanopaged/multimodal/chat_parts.py: a conversation's image parts become the template's {"type": "image"} markers
and vLLM's multi_modal_data, in order; a conversation without images renders exactly as before."""
import base64
import io
import json
import pathlib
import shutil
import sys
from types import SimpleNamespace

import pytest
from PIL import Image
from transformers import AutoTokenizer

from nanopaged import LLM
from nanopaged.config import EngineConfig
from nanopaged.engine.input_processor import render_chat
from nanopaged.multimodal.chat_parts import chat_prompt, folder_chat_template

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1] / "models"))
from vlm_fixtures import tiny_idefics3  # noqa: E402

# What a Hugging Face VLM template does with parts (Idefics3's, shortened): each image part writes the marker.
TEMPLATE = ("{% for m in messages %}<{{ m['role'] }}>{% for p in m['content'] %}"
            "{% if p['type'] == 'image' %}<image>{% else %}{{ p['text'] }}{% endif %}{% endfor %}|{% endfor %}"
            "{% if add_generation_prompt %}<assistant>{% endif %}")
RED, BLUE = (255, 0, 0), (0, 0, 255)


def png_url(color) -> str:
    out = io.BytesIO()
    Image.new("RGB", (4, 3), color).save(out, format="PNG")
    return "data:image/png;base64," + base64.b64encode(out.getvalue()).decode()


def settings(folder, **kw):
    """The EngineConfig fields chat_prompt reads: a vision-language model's (its config has `vision`)."""
    return SimpleNamespace(model=str(folder), allowed_local_media_path=kw.get("allowed"),
                           limit_mm_per_prompt=kw.get("limit"),
                           model_config=SimpleNamespace(vision={}, architecture="SomeVisionLanguageModel"))


@pytest.fixture(scope="module")
def tokenizer(tiny_model_dirs):
    return AutoTokenizer.from_pretrained(tiny_model_dirs["llama"], local_files_only=True)


def two_images():
    return [{"role": "system", "content": "Be brief."},
            {"role": "user", "content": [{"type": "text", "text": "Compare"},
                                         {"type": "image_url", "image_url": {"url": png_url(RED)}},
                                         {"type": "text", "text": "and"},
                                         {"type": "image_pil", "image_pil": Image.new("RGB", (2, 2), BLUE)}]}]


def test_image_parts_become_markers_and_their_images_follow_in_order(tokenizer, tiny_model_dirs):
    prompt = chat_prompt(tokenizer, two_images(), settings(tiny_model_dirs["llama"]), TEMPLATE)
    assert prompt["prompt"] == "<system>Be brief.|<user>Compare<image>and<image>|<assistant>"
    images = prompt["multi_modal_data"]["image"]
    assert [im.getpixel((0, 0)) for im in images] == [RED, BLUE] and images[0].size == (4, 3)
    assert "prompt_token_ids" not in prompt          # the processor tokenizes, placing the images' tokens


def test_a_text_only_conversation_renders_exactly_as_before(tokenizer, tiny_model_dirs):
    config = settings(tiny_model_dirs["llama"])
    for content in ("Hi there", [{"type": "text", "text": "Hi"}, {"type": "text", "text": "there"}]):
        conversation = [{"role": "user", "content": content}]
        assert chat_prompt(tokenizer, conversation, config) == render_chat(tokenizer, conversation)


def test_the_processors_template_beside_the_model_renders_images(tokenizer, tiny_model_dirs, tmp_path):
    folder = tmp_path / "vlm"
    shutil.copytree(tiny_model_dirs["llama"], folder)
    (folder / "chat_template.jinja").unlink(missing_ok=True)     # transformers 5 saves the tokenizer's there
    (folder / "chat_template.json").write_text(json.dumps({"chat_template": TEMPLATE}))
    prompt = chat_prompt(tokenizer, two_images(), settings(folder))
    assert prompt["prompt"].count("<image>") == 2
    (folder / "chat_template.jinja").write_text("{% for m in messages %}[{{ m['content'] | length }}]{% endfor %}")
    folder_chat_template.cache_clear()
    assert folder_chat_template(str(folder)).startswith("{% for m in messages %}[")   # .jinja first
    assert chat_prompt(tokenizer, two_images(), settings(folder))["prompt"] == "[1][4]"


def test_more_images_than_the_limit_are_refused_before_any_is_loaded(tokenizer, tiny_model_dirs):
    conversation = two_images()
    conversation[1]["content"][1]["image_url"]["url"] = "data:image/png;base64,@@@"     # never read
    with pytest.raises(ValueError, match=r"messages holds 2 images; at most 1 per prompt"):
        chat_prompt(tokenizer, conversation, settings(tiny_model_dirs["llama"], limit={"image": 1}), TEMPLATE)


@pytest.mark.parametrize("part, match", [
    ({"type": "image_url", "image_url": {"url": "https://x/a.png"}},
     r"messages\[1\]\.content\[1\]\.image_url: .*never fetches"),
    ({"type": "image_url", "image_url": "data:image/png;base64,AAAA"},
     r"messages\[1\]\.content\[1\]\.image_url must be an object"),
    ({"type": "image_pil", "image_pil": "not an image"}, r"messages\[1\]\.content\[1\]\.image_pil must be a PIL image"),
    ({"type": "image", "image": b"GIF89a broken"}, r"messages\[1\]\.content\[1\]\.image is not an image"),
    ({"type": "video_url", "video_url": {}}, r"messages\[1\]\.content\[1\] must be a text part"),
])
def test_a_bad_part_beside_an_image_is_refused_naming_its_field(tokenizer, tiny_model_dirs, part, match):
    conversation = two_images()
    conversation[1]["content"][1] = part
    with pytest.raises(ValueError, match=match):
        chat_prompt(tokenizer, conversation, settings(tiny_model_dirs["llama"]), TEMPLATE)


def test_llm_chat_hands_generate_the_rendered_text_and_the_images(monkeypatch, tmp_path):
    Image.new("RGB", (3, 3), BLUE).save(tmp_path / "blue.png")
    llm = LLM(tiny_idefics3(tmp_path / "idefics3"), num_kv_blocks=16, allowed_local_media_path=str(tmp_path))
    seen = []
    monkeypatch.setattr(llm, "generate", lambda prompts, *a, **k: seen.extend(prompts))
    llm.chat([{"role": "user", "content": [{"type": "image_url", "image_url": {"url": f"file://{tmp_path}/blue.png"}},
                                           {"type": "text", "text": "What color?"}]}], chat_template=TEMPLATE)
    assert seen[0]["prompt"] == "<user><image>What color?|<assistant>"
    assert [im.getpixel((0, 0)) for im in seen[0]["multi_modal_data"]["image"]] == [BLUE]


def test_a_message_without_content_beside_an_image_is_a_value_error(tokenizer, tiny_model_dirs):
    conversation = two_images() + [{"role": "user"}]
    with pytest.raises(ValueError, match=r"messages\[2\]: a chat message is a dict with 'role' and 'content'"):
        chat_prompt(tokenizer, conversation, settings(tiny_model_dirs["llama"]), TEMPLATE)


def test_a_template_that_cannot_render_parts_is_a_value_error(tokenizer, tiny_model_dirs):
    with pytest.raises(ValueError, match="chat template cannot render image parts"):
        chat_prompt(tokenizer, two_images(), settings(tiny_model_dirs["llama"]), "{{ messages[1]['content'] + 'x' }}")


def test_a_text_model_refuses_images_in_chat_with_a_value_error(tiny_model_dirs):
    llm = LLM(tiny_model_dirs["llama"], num_kv_blocks=16)
    with pytest.raises(ValueError, match="LlamaForCausalLM is a text-only model and takes no images"):
        llm.chat([{"role": "user", "content": [{"type": "image_url", "image_url": {"url": png_url(RED)}}]}],
                 chat_template=TEMPLATE, use_tqdm=False)


@pytest.mark.parametrize("kwargs, match", [
    ({"allowed_local_media_path": "/no/such/folder"}, r"allowed_local_media_path='/no/such/folder' is not a folder"),
    ({"limit_mm_per_prompt": {"image": -1}}, r"limit_mm_per_prompt\['image'\] must be"),
    ({"limit_mm_per_prompt": {"image": 2, "video": 1}}, r"takes images only; \['video'\] may only be 0"),
    ({"limit_mm_per_prompt": 3}, r"limit_mm_per_prompt must be a dict"),
])
def test_the_media_settings_are_checked_by_name(tiny_model_dirs, kwargs, match):
    with pytest.raises(ValueError, match=match):
        EngineConfig(tiny_model_dirs["llama"], **kwargs)


def test_vllms_unset_media_settings_are_accepted(tiny_model_dirs):
    config = EngineConfig(tiny_model_dirs["llama"], allowed_local_media_path="",
                          limit_mm_per_prompt={"image": 2, "video": 0})
    assert config.allowed_local_media_path is None and config.limit_mm_per_prompt["image"] == 2
