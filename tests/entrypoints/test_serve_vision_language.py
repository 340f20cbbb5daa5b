"""`nanopaged serve` on a vision-language model, in both layouts (an engine core behind the API server, and
--engine-in-process): the official openai client's chat with an image as a data: URL answers what the offline
LLM.chat answers for the same messages, Anthropic's base64 image block too, the same image sent twice is
encoded once, and a bad image is a 400 while the server goes on."""
import base64
import io
import pathlib
import re
import sys
import time
import urllib.request

import pytest

for module in ("fastapi", "uvicorn", "prometheus_client"):
    pytest.importorskip(module, reason="the serve extra: pip install -e '.[serve]'")
openai = pytest.importorskip("openai", reason="the test extra: pip install -e '.[test]'")
anthropic = pytest.importorskip("anthropic", reason="the test extra: pip install -e '.[test]'")
import numpy as np  # noqa: E402
from PIL import Image  # noqa: E402

ROOT = pathlib.Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tests" / "models"))
from benchmarks.serve import start_nanopaged  # noqa: E402
from nanopaged import LLM, SamplingParams  # noqa: E402
from vlm_fixtures import tiny_idefics3  # noqa: E402

ARGS = ["--dtype", "float32", "--num-kv-blocks", "256"]


def png(seed: int) -> bytes:
    pixels = np.random.default_rng(seed).integers(0, 256, (64, 96, 3), dtype=np.uint8)
    out = io.BytesIO()
    Image.fromarray(pixels).save(out, format="PNG")
    return out.getvalue()


def data_url(seed: int) -> str:
    return "data:image/png;base64," + base64.b64encode(png(seed)).decode()


def messages(seed: int, question: str = "what is it?") -> list[dict]:
    return [{"role": "user", "content": [{"type": "text", "text": question},
                                         {"type": "image_url", "image_url": {"url": data_url(seed)}}]}]


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    return tiny_idefics3(tmp_path_factory.mktemp("served_idefics3"))


@pytest.fixture(scope="module", params=["engine core", "in process"])
def server(request, folder):
    args = ARGS + (["--engine-in-process"] if request.param == "in process" else [])
    with pytest.MonkeyPatch.context() as env:
        env.delenv("NANOPAGED_API_KEY", raising=False)
        with start_nanopaged(folder, args, timeout_s=180) as s:
            yield s


@pytest.fixture(scope="module")
def offline(folder):
    llm = LLM(folder, dtype="float32")
    return lambda seed, question="what is it?": llm.chat(messages(seed, question), SamplingParams(
        temperature=0, max_tokens=6), use_tqdm=False)[0]


def test_a_chat_with_a_data_url_image_answers_as_the_offline_llm(server, offline):
    client = openai.OpenAI(base_url=server.base_url + "/v1", api_key="none", max_retries=0, timeout=120)
    # the third sends the first image again behind another question: no prefix hit, an encoder-cache hit
    for seed, question in ((1, "what is it?"), (2, "what is it?"), (1, "and this?")):
        reply = client.chat.completions.create(model=server.model_name, messages=messages(seed, question),
                                               max_tokens=6, temperature=0)
        want = offline(seed, question)
        assert reply.choices[0].message.content == want.outputs[0].text
        assert reply.usage.prompt_tokens == len(want.prompt_token_ids)
    assert encoder_counts(server) == (2, 1)          # two images encoded; the repeat found its output cached


def encoder_counts(server, wait_s: float = 30) -> tuple[float, float]:
    """(images encoded, images found cached) from /metrics, once the engine's figures have arrived."""
    deadline = time.monotonic() + wait_s
    while True:
        text = urllib.request.urlopen(server.base_url + "/metrics", timeout=30).read().decode()
        found = dict(re.findall(r"^\S*encoder_(calls|hits)_total (\S+)$", text, flags=re.M))
        if len(found) == 2 or time.monotonic() > deadline:
            return float(found.get("calls", -1)), float(found.get("hits", -1))
        time.sleep(0.5)


def test_anthropics_base64_image_block_is_read(server, offline):
    client = anthropic.Anthropic(base_url=server.base_url, api_key="none", max_retries=0, timeout=120)
    image = {"type": "image", "source": {"type": "base64", "media_type": "image/png",
                                         "data": base64.b64encode(png(3)).decode()}}
    reply = client.messages.create(model=server.model_name, max_tokens=6, extra_body={"temperature": 0}, messages=[
        {"role": "user", "content": [{"type": "text", "text": "what is it?"}, image]}])
    assert reply.content[0].text == offline(3).outputs[0].text


def test_a_bad_image_is_a_400_and_the_server_answers_the_next_chat(server):
    client = openai.OpenAI(base_url=server.base_url + "/v1", api_key="none", max_retries=0, timeout=120)
    bad = [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": data_url(4)[:-40]}}]}]
    with pytest.raises(openai.BadRequestError, match="image_url"):
        client.chat.completions.create(model=server.model_name, messages=bad, max_tokens=2)
    assert client.chat.completions.create(model=server.model_name, messages=messages(5), max_tokens=2).choices
