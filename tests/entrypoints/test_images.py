"""Images on the server's routes, in process: every bad image on /v1/chat/completions or /v1/messages is a 400
whose error names its field, never a 500; a text model's refusal of images is a 400 too; a prompt's images cross
the engine core's socket as plain bytes and come out as the same pixels (core_messages.py, engine_core.py)."""
import asyncio
import base64
import io
import pathlib
import sys
from types import SimpleNamespace

import pytest

pytest.importorskip("fastapi", reason="the serve extra: pip install -e '.[serve]'")
from PIL import Image  # noqa: E402
from transformers import AutoTokenizer  # noqa: E402

from nanopaged import LLM  # noqa: E402
from nanopaged.entrypoints import core_messages as m  # noqa: E402
from nanopaged.entrypoints.engine_core import EngineCore  # noqa: E402
from nanopaged.entrypoints.openai import anthropic_api  # noqa: E402
from nanopaged.entrypoints.openai.core_client import CoreClient  # noqa: E402
from nanopaged.entrypoints.openai.engine_loop import EngineLoop, Submission  # noqa: E402
from nanopaged.entrypoints.openai.protocol import OpenAIError, parse_request  # noqa: E402
from nanopaged.multimodal.media import load_image  # noqa: E402

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1] / "models"))
from vlm_fixtures import tiny_idefics3  # noqa: E402

# A template that renders parts, as a vision-language model's does.
PARTS_TEMPLATE = ("{% for m in messages %}{% for p in m['content'] %}{% if p['type'] == 'image' %}<image>"
                  "{% else %}{{ p['text'] }}{% endif %}{% endfor %}{% endfor %}")


def png(color=(255, 0, 0), size=(4, 4)) -> bytes:
    out = io.BytesIO()
    Image.new("RGB", size, color).save(out, format="PNG")
    return out.getvalue()


def truncated_png() -> bytes:
    out = io.BytesIO()
    Image.effect_noise((64, 64), 50).convert("RGB").save(out, format="PNG")
    return out.getvalue()[:out.tell() // 2]


def data_url(data: bytes, media_type: str = "image/png") -> str:
    return f"data:{media_type};base64,{base64.b64encode(data).decode()}"


def chat(*image_urls: str) -> dict:
    parts = [{"type": "text", "text": "What is it?"}] + [{"type": "image_url", "image_url": {"url": u}}
                                                          for u in image_urls]
    return {"messages": [{"role": "user", "content": parts}], "max_tokens": 2}


@pytest.fixture(scope="module")
def media_dir(tmp_path_factory):
    root = tmp_path_factory.mktemp("media")
    (root / "allowed").mkdir()
    (root / "allowed" / "red.png").write_bytes(png())
    (root / "secret.png").write_bytes(png((0, 0, 255)))
    return root


@pytest.fixture(scope="module")
def engine_loop(media_dir, tmp_path_factory):
    """A tiny vision-language model (Idefics3), so that every image is read and decoded."""
    folder = tiny_idefics3(tmp_path_factory.mktemp("idefics3"))
    llm = LLM(folder, dtype="float32", block_size=4, num_kv_blocks=256,
              allowed_local_media_path=str(media_dir / "allowed"), limit_mm_per_prompt={"image": 2})
    return EngineLoop(llm.llm_engine)


@pytest.fixture(scope="module")
def text_loop(tiny_model_dirs, media_dir):
    llm = LLM(tiny_model_dirs["llama"], block_size=4, num_kv_blocks=64,
              allowed_local_media_path=str(media_dir / "allowed"))
    return EngineLoop(llm.llm_engine)


def refusal(engine_loop, body: dict) -> OpenAIError:
    """The error the chat route answers `body` with: parsed as the handler does, processed as its input thread does."""
    loop = asyncio.new_event_loop()
    try:
        with pytest.raises(OpenAIError) as e:
            engine_loop._process(Submission(parse_request(body, "chat", "m"), ["r0"], loop))
    finally:
        loop.close()
    assert e.value.status == 400, e.value.message
    return e.value


@pytest.mark.parametrize("url, match", [
    ("https://example.com/cat.png", "this engine never fetches"),
    ("data:image/png;base64,!!not-base64!!", "base64 is not valid"),
    ("data:text/html;base64,PGI+aGk8L2I+", "media type must be image/"),
    (data_url(truncated_png()), "truncated or corrupt"),
    (data_url(b"GIF89a, but no"), "is not an image"),
    ("{media}/secret.png", "lies outside allowed_local_media_path"),
    ("file://{media}/allowed/../secret.png", "lies outside allowed_local_media_path"),
    ("{media}/allowed/missing.png", "is not a file"),
])
def test_a_bad_image_url_is_a_400_naming_its_part(engine_loop, media_dir, url, match):
    error = refusal(engine_loop, chat(data_url(png()), url.format(media=media_dir)))
    assert error.param == "messages[0].content[2].image_url"
    assert match in error.message and error.message.startswith("messages[0].content[2].image_url")


def test_more_images_than_limit_mm_per_prompt_is_a_400(engine_loop):
    error = refusal(engine_loop, chat(*[data_url(png())] * 3))
    assert error.param == "messages" and "holds 3 images; at most 2" in error.message


def test_a_local_file_without_the_flag_is_a_400_naming_the_flag(tiny_model_dirs, media_dir):
    loop = EngineLoop(LLM(tiny_model_dirs["llama"], block_size=4, num_kv_blocks=64).llm_engine)
    error = refusal(loop, chat(str(media_dir / "allowed" / "red.png")))
    assert error.param == "messages[0].content[1].image_url" and "allowed_local_media_path" in error.message


def test_a_text_model_refuses_a_good_image_with_a_400(text_loop, media_dir):
    for url in (data_url(png()), str(media_dir / "allowed" / "red.png"), f"file://{media_dir}/allowed/red.png"):
        error = refusal(text_loop, chat(url))
        assert error.param == "messages" and "LlamaForCausalLM is a text-only model and takes no images" in error.message


def test_anthropic_image_blocks_become_images_and_bad_ones_are_named():
    def body(source):
        return {"max_tokens": 3, "messages": [{"role": "user", "content": [
            {"type": "text", "text": "Look:"}, {"type": "image", "source": source}]}]}
    good = anthropic_api.to_chat_body(body({"type": "base64", "media_type": "image/png", "data":
                                            base64.b64encode(png((0, 255, 0))).decode()}))
    text, image = good["messages"][0]["content"]
    assert text == {"type": "text", "text": "Look:"} and load_image(image["image"], "x").getpixel((0, 0)) == (0, 255, 0)
    for source, match in [({"type": "url", "url": "https://x/a.png"}, "this engine never fetches"),
                          ({"type": "base64", "media_type": "image/png", "data": "@@"}, "base64 is not valid"),
                          ({"type": "base64", "media_type": "text/plain", "data": "aGk="}, "media type must be image/"),
                          ({"type": "base64", "media_type": "image/png", "data": "R0lGODlhAQABAAAAACw="},
                           "not an image"),
                          ({"type": "base64", "media_type": "image/png",
                            "data": base64.b64encode(png(size=(9000, 1))).decode()}, "9000x1 pixels"),
                          ({"type": "file", "file_id": "f"}, "source must be")]:
        with pytest.raises(OpenAIError) as e:
            anthropic_api.to_chat_body(body(source))
        assert e.value.status == 400 and e.value.message.startswith("messages[0].content[1].source"), e.value.message
        assert match in e.value.message


def anthropic_body(*pngs: bytes) -> dict:
    return anthropic_api.to_chat_body({"max_tokens": 3, "system": "Look.", "messages": [{"role": "user", "content": [
        {"type": "image", "source": {"type": "base64", "media_type": "image/png",
                                     "data": base64.b64encode(data).decode()}} for data in pngs]}]})


def test_an_anthropic_image_on_a_text_model_is_a_400(text_loop):
    error = refusal(text_loop, anthropic_body(png()))
    assert error.param == "messages" and "takes no images" in error.message


def test_a_truncated_anthropic_image_is_a_400_when_decoded_with_the_prompts_others(engine_loop):
    error = refusal(engine_loop, anthropic_body(png(), truncated_png()))
    assert "truncated or corrupt" in error.message and error.param == "messages[1].content[1].image"



# ---- across the engine core's socket --------------------------------------------------------------
def test_the_api_server_sends_a_prompts_images_as_png_bytes(tiny_model_dirs, tmp_path):
    """CoreClient's input thread keeps each image prompt's text and images for AddRequest (no engine core needed)."""
    taken = []
    client = SimpleNamespace(tokenizer=AutoTokenizer.from_pretrained(tiny_model_dirs["llama"], local_files_only=True),
                             config=SimpleNamespace(model=str(tmp_path), allowed_local_media_path=None,
                                                    limit_mm_per_prompt=None,
                                                    model_config=SimpleNamespace(vision={}, architecture="VLM")),
                             input_processor=SimpleNamespace(process=lambda rid, p, params: taken.append(p) or []))
    client.tokenizer.chat_template = PARTS_TEMPLATE
    loop = asyncio.new_event_loop()
    body = {**chat(data_url(png((1, 2, 3)))), "max_tokens": None}
    submission = Submission(parse_request(body, "chat", "m"), ["r0"], loop)
    loop.close()
    CoreClient._process(client, submission)
    text, images = submission.media["r0"]
    assert text == taken[0]["prompt"] == "What is it?<image>"
    assert load_image(images[0], "x").getpixel((0, 0)) == (1, 2, 3) and isinstance(images[0], bytes)


def test_images_cross_the_socket_and_reach_the_engine_as_a_multimodal_prompt():
    message = m.AddRequest("r0", [5, 6, 7], {}, prompt="Hi<image>", images=[png((9, 8, 7))])
    received = m.core_decoder.decode(m.encode(message))
    seen = []
    core = SimpleNamespace(engine=SimpleNamespace(process_request=lambda rid, prompt, *a, **k: seen.append(prompt)))
    EngineCore.check(core, received)
    prompt = seen[0]
    assert prompt["prompt"] == "Hi<image>" and "prompt_token_ids" not in prompt
    assert load_image(prompt["multi_modal_data"]["image"][0], "x").getpixel((0, 0)) == (9, 8, 7)
    EngineCore.check(core, m.core_decoder.decode(m.encode(m.AddRequest("r1", [5, 6], {}))))
    assert seen[1] == {"prompt_token_ids": [5, 6]}                 # a text prompt: its token ids, as before
