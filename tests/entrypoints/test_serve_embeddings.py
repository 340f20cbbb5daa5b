"""POST /v1/embeddings with the openai client, on `nanopaged serve --runner pooling`, in both layouts
(the engine-core process, the vectors crossing its socket; and --engine-in-process).

The vectors equal LLM.embed's (float and base64, one input or many, strings or token ids); every bad
request is a 4xx naming its field; a generating server names the runner.
"""
import asyncio
import base64
import json
import struct
import time
import types
import urllib.error
import urllib.request

import pytest

for module in ("fastapi", "uvicorn"):
    pytest.importorskip(module, reason="the serve extra: pip install -e '.[serve]'")
openai = pytest.importorskip("openai", reason="the test extra: pip install -e '.[test]'")

from benchmarks.serve import start_nanopaged  # noqa: E402
from nanopaged import LLM  # noqa: E402

SETTINGS = dict(block_size=4, num_kv_blocks=64, dtype="float32")
ENGINE_ARGS = ["--runner", "pooling", "--block-size", "4", "--num-kv-blocks", "64", "--dtype", "float32"]
MODEL_NAME = "tiny-embed"


@pytest.fixture(scope="module", params=["processes", "in-process"])
def server(tiny_model_dirs, request):
    layout = ["--engine-in-process"] if request.param == "in-process" else []
    with pytest.MonkeyPatch.context() as env:
        env.delenv("NANOPAGED_API_KEY", raising=False)
        with start_nanopaged(tiny_model_dirs["llama"], [*ENGINE_ARGS, *layout], served_model_name=MODEL_NAME,
                             timeout_s=120) as s:
            yield s


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.base_url + "/v1", api_key="none", max_retries=0, timeout=60)


@pytest.fixture(scope="module")
def offline(tiny_model_dirs):
    return LLM(tiny_model_dirs["llama"], runner="pooling", **SETTINGS)


def post(server, path: str, body) -> tuple[int, dict]:
    data = body if isinstance(body, bytes) else json.dumps(body).encode()
    request = urllib.request.Request(server.base_url + path, data=data, headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=60) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


def close(a, b, atol=1e-5):
    return len(a) == len(b) and all(abs(x - y) <= atol for x, y in zip(a, b))


def test_embeddings_equal_llm_embed(client, offline):
    texts = ["Hello world", "The quick brown fox jumps over the lazy dog", "a"]
    response = client.embeddings.create(model=MODEL_NAME, input=texts)
    expected = offline.embed(texts, use_tqdm=False)
    assert [d.index for d in response.data] == [0, 1, 2] and response.model == MODEL_NAME
    for d, e in zip(response.data, expected):
        assert d.object == "embedding" and close(d.embedding, e.outputs.embedding)
    assert response.usage.prompt_tokens == response.usage.total_tokens == sum(len(e.prompt_token_ids)
                                                                             for e in expected)


def test_one_string_and_token_ids(client, offline):
    [one] = offline.embed(["Hello world"], use_tqdm=False)
    ids = one.prompt_token_ids
    for given in ("Hello world", ids, [ids]):
        [d] = client.embeddings.create(model=MODEL_NAME, input=given, encoding_format="float").data
        assert close(d.embedding, one.outputs.embedding)
    two = client.embeddings.create(model=MODEL_NAME, input=[ids, ids[:2]]).data
    assert len(two) == 2 and close(two[0].embedding, one.outputs.embedding)


def test_base64_is_little_endian_float32(server, client, offline):
    [one] = offline.embed(["Hello world"], use_tqdm=False)
    status, body = post(server, "/v1/embeddings", {"model": MODEL_NAME, "input": "Hello world",
                                                     "encoding_format": "base64", "user": "someone"})
    assert status == 200
    raw = base64.b64decode(body["data"][0]["embedding"])
    assert close(list(struct.unpack(f"<{len(raw) // 4}f", raw)), one.outputs.embedding)
    # the openai client asks for base64 when no format is given, and decodes it itself
    [d] = client.embeddings.create(model=MODEL_NAME, input="Hello world").data
    assert close(d.embedding, one.outputs.embedding)


def test_dimensions_are_refused_by_name_on_a_model_without_matryoshka(client):
    with pytest.raises(openai.BadRequestError) as e:
        client.embeddings.create(model=MODEL_NAME, input="Hello", dimensions=8)
    error = e.value.body.get("error", e.value.body)          # the client keeps the whole body, or its error
    assert error["param"] == "dimensions" and "Matryoshka" in error["message"]


@pytest.mark.parametrize("body, param", [
    ({"input": ""}, "input"), ({"input": []}, "input"), ({"input": [""]}, "input"), ({}, "input"),
    ({"input": [1, "a"]}, "input"), ({"input": [[1], []]}, "input"), ({"input": [True]}, "input"),
    ({"input": {"text": "a"}}, "input"), ({"input": [100000]}, "input"),
    ({"input": "a", "encoding_format": "int8"}, "encoding_format"),
    ({"input": "a", "dimensions": 0}, "dimensions"), ({"input": "a", "dimensions": "8"}, "dimensions"),
    ({"input": "a", "user": 5}, "user"), ({"input": "a", "temperature": 0}, "temperature"),
])
def test_bad_requests_name_their_field(server, body, param):
    status, answer = post(server, "/v1/embeddings", {"model": MODEL_NAME, **body})
    assert status == 400, answer
    assert answer["error"]["param"] == param, answer


def test_a_wrong_model_is_a_404_and_bad_json_a_400(server):
    assert post(server, "/v1/embeddings", {"model": "other", "input": "a"})[0] == 404
    assert post(server, "/v1/embeddings", b"{not json")[0] == 400


def test_completions_on_a_pooling_server_name_the_runner(client):
    with pytest.raises(openai.BadRequestError, match="runner='pooling'"):
        client.completions.create(model=MODEL_NAME, prompt="Hello", max_tokens=2)


def test_blocks_are_free_after_the_requests(server):
    status, _ = post(server, "/v1/embeddings", {"input": ["a b c"] * 5})
    assert status == 200
    deadline = time.monotonic() + 20          # the loop posts its figures right after the step
    while True:
        with urllib.request.urlopen(server.base_url + "/metrics", timeout=30) as r:
            usage = [line for line in r.read().decode().splitlines()
                     if line.startswith("nanopaged:kv_cache_usage_perc")]
        if (usage and float(usage[0].split()[-1]) == 0.0) or time.monotonic() > deadline:
            break
        time.sleep(0.05)
    assert usage and float(usage[0].split()[-1]) == 0.0, usage


async def call(app, body: bytes) -> tuple[int, dict]:
    """One POST /v1/embeddings straight into the ASGI app (no server, no HTTP client library)."""
    messages, received = [], []

    async def receive():
        if not received:
            received.append(True)
            return {"type": "http.request", "body": body, "more_body": False}
        await asyncio.sleep(3600)

    async def send(message):
        messages.append(message)

    scope = {"type": "http", "asgi": {"version": "3.0"}, "http_version": "1.1", "method": "POST", "scheme": "http",
             "path": "/v1/embeddings", "raw_path": b"/v1/embeddings", "root_path": "", "query_string": b"",
             "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())],
             "client": ("127.0.0.1", 1), "server": ("127.0.0.1", 80)}
    await app(scope, receive, send)
    status = next(m["status"] for m in messages if m["type"] == "http.response.start")
    return status, json.loads(b"".join(m.get("body", b"") for m in messages if m["type"] == "http.response.body"))


@pytest.mark.parametrize("runner, status, words", [("generate", 400, "runner='generate'")])
def test_the_route_on_a_generating_server_names_the_runner(runner, status, words):
    """A generating server (a CoreClient: only its config is read here) names the runner."""
    from fastapi import FastAPI
    from fastapi.responses import JSONResponse

    from nanopaged.entrypoints.openai.embeddings import register_embeddings
    from nanopaged.entrypoints.openai.limits import BodyLimits
    from nanopaged.entrypoints.openai.protocol import OpenAIError

    app = FastAPI()

    @app.exception_handler(OpenAIError)
    async def openai_error(_request, e):
        return JSONResponse(e.body(), status_code=e.status)

    core_client = types.SimpleNamespace(config=types.SimpleNamespace(runner=runner))
    models = types.SimpleNamespace(name="m", adapters={})
    register_embeddings(app, core_client, models, BodyLimits(1 << 20, 10.0))
    answer_status, answer = asyncio.run(call(app, json.dumps({"model": "m", "input": "a"}).encode()))
    assert answer_status == status and words in answer["error"]["message"], answer
