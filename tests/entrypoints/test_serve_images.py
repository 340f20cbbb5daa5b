"""`nanopaged serve --allowed-local-media-path DIR --limit-mm-per-prompt '{"image": 1}'`: the real server, API server
and engine core in their own processes. Every bad image on /v1/chat/completions and /v1/messages is a 400 naming
its field, a text model's refusal of a good image is a 400 too, and the server answers text chats after them."""
import base64
import io
import json
import pathlib
import sys
import urllib.error
import urllib.request

import pytest

for module in ("fastapi", "uvicorn", "prometheus_client"):
    pytest.importorskip(module, reason="the serve extra: pip install -e '.[serve]'")
from PIL import Image  # noqa: E402

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[2]))
from benchmarks.serve import start_nanopaged  # noqa: E402


def png() -> bytes:
    out = io.BytesIO()
    Image.new("RGB", (4, 4), (255, 0, 0)).save(out, format="PNG")
    return out.getvalue()


PNG_URL = "data:image/png;base64," + base64.b64encode(png()).decode()


@pytest.fixture(scope="module")
def media_dir(tmp_path_factory):
    root = tmp_path_factory.mktemp("served_media")
    (root / "red.png").write_bytes(png())
    return root


@pytest.fixture(scope="module")
def server(tiny_model_dirs, media_dir):
    args = ["--num-kv-blocks", "64", "--block-size", "4", "--allowed-local-media-path", str(media_dir),
            "--limit-mm-per-prompt", json.dumps({"image": 1})]
    with pytest.MonkeyPatch.context() as env:
        env.delenv("NANOPAGED_API_KEY", raising=False)
        with start_nanopaged(tiny_model_dirs["llama"], args, timeout_s=120) as s:
            yield s


def post(server, path: str, body: dict) -> tuple[int, dict]:
    request = urllib.request.Request(server.base_url + path, data=json.dumps(body).encode(),
                                     headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=60) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


def chat(*urls: str) -> dict:
    parts = [{"type": "text", "text": "What is it?"}] + [{"type": "image_url", "image_url": {"url": u}} for u in urls]
    return {"messages": [{"role": "user", "content": parts}], "max_tokens": 2}


@pytest.mark.parametrize("url, param, says", [
    ("http://example.com/cat.png", "messages[0].content[1].image_url", "never fetches"),
    ("data:image/png;base64,***", "messages[0].content[1].image_url", "base64 is not valid"),
    ("data:text/plain;base64,aGk=", "messages[0].content[1].image_url", "media type must be image/"),
    ("/etc/hostname", "messages[0].content[1].image_url", "lies outside allowed_local_media_path"),
    (PNG_URL, "messages", ""),                      # a good image: the text model refuses it
    ("{media}/red.png", "messages", ""),            # a good file under the allowed folder: the same
])
def test_a_bad_or_unwanted_image_on_the_chat_route_is_a_400_naming_its_field(server, media_dir, url, param, says):
    status, body = post(server, "/v1/chat/completions", chat(url.format(media=media_dir)))
    assert status == 400, body
    assert body["error"]["param"] == param and says in body["error"]["message"]


def test_more_images_than_the_flag_allows_is_a_400(server):
    status, body = post(server, "/v1/chat/completions", chat(PNG_URL, PNG_URL))
    assert status == 400 and "holds 2 images; at most 1" in body["error"]["message"]


@pytest.mark.parametrize("source, says", [
    ({"type": "url", "url": "https://example.com/a.png"}, "messages[0].content[0].source: a url source is refused"),
    ({"type": "base64", "media_type": "image/png", "data": "%%"}, "messages[0].content[0].source: the data URL's"),
    ({"type": "base64", "media_type": "image/png", "data": base64.b64encode(png()).decode()}, ""),
])
def test_an_anthropic_image_block_that_cannot_run_is_a_400_in_anthropics_shape(server, source, says):
    status, body = post(server, "/v1/messages", {"max_tokens": 2, "messages": [
        {"role": "user", "content": [{"type": "image", "source": source}, {"type": "text", "text": "?"}]}]})
    assert status == 400 and body["type"] == "error", body
    assert body["error"]["type"] == "invalid_request_error" and says in body["error"]["message"]


def test_the_server_answers_text_chats_after_the_refusals(server):
    status, body = post(server, "/v1/chat/completions", {"messages": [{"role": "user", "content": [
        {"type": "text", "text": "Hi"}]}], "max_tokens": 2})
    assert status == 200 and body["choices"][0]["message"]["content"] is not None
