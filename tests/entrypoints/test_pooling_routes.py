"""/classify, /pooling, /score and /rerank (and their aliases) on the one-process server's app: each body
in vLLM's shape, equal to the offline calls (LLM.classify, reward, score, encode), and every bad request a
4xx naming its field, the runner or the task. Straight into the ASGI app (no server process, no HTTP
library); the default layout, over the engine core's socket, is tests/entrypoints/test_serve_pooling_tasks.py.
"""
import asyncio
import json
import types

import pytest

pytest.importorskip("fastapi", reason="the serve extra: pip install -e '.[serve]'")

from test_pooling_tasks import PROMPTS, SETTINGS, save_classifier  # noqa: E402

from nanopaged import LLM  # noqa: E402
from nanopaged.entrypoints.openai.app import build_app  # noqa: E402
from nanopaged.entrypoints.openai.engine_loop import EngineLoop  # noqa: E402
from nanopaged.entrypoints.openai.limits import BodyLimits  # noqa: E402
from nanopaged.entrypoints.openai.metrics import ServerMetrics  # noqa: E402
from nanopaged.entrypoints.openai.served_models import ServedModels  # noqa: E402

NAME = "m"


async def call(app, path: str, body) -> tuple[int, dict]:
    """One POST straight into the ASGI app."""
    raw = body if isinstance(body, bytes) else json.dumps(body).encode()
    messages, received = [], []

    async def receive():
        if not received:
            received.append(True)
            return {"type": "http.request", "body": raw, "more_body": False}
        await asyncio.sleep(3600)

    async def send(message):
        messages.append(message)

    scope = {"type": "http", "asgi": {"version": "3.0"}, "http_version": "1.1", "method": "POST", "scheme": "http",
             "path": path, "raw_path": path.encode(), "root_path": "", "query_string": b"",
             "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(raw)).encode())],
             "client": ("127.0.0.1", 1), "server": ("127.0.0.1", 80)}
    await app(scope, receive, send)
    status = next(m["status"] for m in messages if m["type"] == "http.response.start")
    return status, json.loads(b"".join(m.get("body", b"") for m in messages if m["type"] == "http.response.body"))


class Server:
    """The app the one-process server builds around an engine, and an LLM of the same model beside it
    (`llm`: the offline answers to compare with)."""

    def __init__(self, folder: str, **settings) -> None:
        served, self.llm = LLM(folder, **SETTINGS, **settings), LLM(folder, **SETTINGS, **settings)
        engine = self.engine = served.llm_engine
        self.loop = EngineLoop(engine, hold=served.one_call_at_a_time)
        self.loop.start()
        self.app = build_app(self.loop, ServerMetrics(), ServedModels(NAME, folder, engine.config.max_model_len),
                             BodyLimits(1 << 20, 10.0))

    def post(self, path: str, body) -> tuple[int, dict]:
        return asyncio.run(call(self.app, path, body))

    def blocks_free(self) -> bool:
        pool = self.engine.scheduler.block_pool
        return pool.num_free_blocks == pool.num_blocks


@pytest.fixture(scope="module")
def cross(tiny_model_dirs, tmp_path_factory):
    folder = save_classifier(tiny_model_dirs["qwen2"], tmp_path_factory.mktemp("cross") / "cross", 1,
                             id2label={0: "relevant"})
    server = Server(folder, runner="pooling")
    yield server
    server.loop.stop()


@pytest.fixture(scope="module")
def labels3(tiny_model_dirs, tmp_path_factory):
    folder = save_classifier(tiny_model_dirs["llama"], tmp_path_factory.mktemp("labels3") / "labels3", 3,
                             id2label={0: "neg", 1: "neutral", 2: "pos"})
    server = Server(folder, runner="pooling")
    yield server
    server.loop.stop()


@pytest.fixture(scope="module")
def embedder(tiny_model_dirs):
    server = Server(tiny_model_dirs["llama"], runner="pooling")
    yield server
    server.loop.stop()


def close(a, b, atol=1e-5):
    return len(a) == len(b) and all(abs(x - y) <= atol for x, y in zip(a, b))


# ---- the answers, as vLLM shapes them ---------------------------------------------------------------------
def test_classify_answers_the_probabilities_and_the_likeliest_label(labels3):
    status, body = labels3.post("/classify", {"model": NAME, "input": ["Hello world", "The quick brown fox"]})
    assert status == 200, body
    assert body["object"] == "list" and body["id"].startswith("classify-") and body["model"] == NAME
    expected = labels3.llm.classify(["Hello world", "The quick brown fox"], use_tqdm=False)
    for i, (d, e) in enumerate(zip(body["data"], expected)):
        probs = e.outputs.probs
        assert d["index"] == i and d["num_classes"] == 3 and close(d["probs"], probs)
        assert d["label"] == ["neg", "neutral", "pos"][probs.index(max(probs))]
    assert body["usage"]["prompt_tokens"] == sum(len(e.prompt_token_ids) for e in expected)
    assert labels3.blocks_free()


def test_pooling_defaults_to_the_token_task(cross, embedder):
    status, body = cross.post("/pooling", {"input": [PROMPTS[1]]})          # a classifier: token_classify
    assert status == 200, body
    [reward] = cross.llm.reward([{"prompt_token_ids": PROMPTS[1]}], use_tqdm=False)
    [d] = body["data"]
    assert d["object"] == "pooling" and body["id"].startswith("pool-")
    assert len(d["data"]) == len(PROMPTS[1])
    assert close([row[0] for row in d["data"]], reward.outputs.data[:, 0].tolist())
    status, body = embedder.post("/pooling", {"input": "Hello world"})      # an embedding model: token_embed
    [rows] = embedder.llm.encode(["Hello world"], pooling_task="token_embed", use_tqdm=False)
    assert status == 200 and len(body["data"][0]["data"]) == rows.outputs.data.shape[0]
    assert close(body["data"][0]["data"][-1], rows.outputs.data[-1].tolist())
    status, body = embedder.post("/pooling", {"input": "Hello world", "task": "embed", "encoding_format": "base64"})
    assert status == 200 and isinstance(body["data"][0]["data"], str)


def test_score_and_its_alias_answer_the_cross_encoders_scores(cross):
    expected = [o.outputs.score for o in cross.llm.score("what is a cat", ["a cat", "the sky"], use_tqdm=False)]
    for path in ("/score", "/v1/score"):
        status, body = cross.post(path, {"model": NAME, "text_1": "what is a cat", "text_2": ["a cat", "the sky"]})
        assert status == 200, body
        assert body["object"] == "list" and body["id"].startswith("score-")
        assert [d["index"] for d in body["data"]] == [0, 1] and {d["object"] for d in body["data"]} == {"score"}
        assert close([d["score"] for d in body["data"]], expected)


@pytest.mark.parametrize("path", ["/rerank", "/v1/rerank", "/v2/rerank"])
def test_rerank_answers_the_documents_best_first(cross, path):
    documents = ["a cat", "the sky", "cats purr", "blue"]
    scores = [o.outputs.score for o in cross.llm.score("what is a cat", documents, use_tqdm=False)]
    status, body = cross.post(path, {"query": "what is a cat", "documents": documents, "top_n": 3})
    assert status == 200, body
    best = sorted(range(4), key=lambda i: -scores[i])[:3]
    assert [r["index"] for r in body["results"]] == best and body["id"].startswith("rerank-")
    assert [r["document"]["text"] for r in body["results"]] == [documents[i] for i in best]
    assert close([r["relevance_score"] for r in body["results"]], [scores[i] for i in best])
    assert body["usage"]["total_tokens"] > 0


def test_an_embedding_model_scores_by_cosine(embedder):
    expected = [o.outputs.score for o in embedder.llm.score("Hello", ["Hello world", "fox"], use_tqdm=False)]
    status, body = embedder.post("/score", {"text_1": "Hello", "text_2": ["Hello world", "fox"]})
    assert status == 200 and close([d["score"] for d in body["data"]], expected), body
    status, body = embedder.post("/rerank", {"query": "Hello", "documents": ["Hello world", "fox"]})
    assert status == 200 and close(sorted(r["relevance_score"] for r in body["results"]), sorted(expected))


# ---- refused by name ----------------------------------------------------------------------------------------
@pytest.mark.parametrize("path, body, param", [
    ("/classify", {"input": ""}, "input"), ("/classify", {"input": "a", "temperature": 0}, "temperature"),
    ("/classify", {"input": "a", "use_activation": "yes"}, "use_activation"),
    ("/classify", {"input": "a", "truncate_prompt_tokens": 0}, "truncate_prompt_tokens"),
    ("/classify", {"input": "a", "user": 5}, "user"), ("/classify", {"input": [100000]}, "input"),
    ("/pooling", {"input": "a", "task": "generate"}, "task"), ("/pooling", {"input": "a", "task": "embed"}, "task"),
    ("/pooling", {"input": "a", "normalize": True}, "normalize"),
    ("/pooling", {"input": "a", "encoding_format": "int8"}, "encoding_format"),
    ("/score", {"text_1": ["a", "b"], "text_2": ["c", "d", "e"]}, "text_1"), ("/score", {"text_1": "a"}, "text_2"),
    ("/score", {"text_1": 5, "text_2": "a"}, "text_1"),
    ("/rerank", {"query": 5, "documents": ["a"]}, "query"), ("/rerank", {"query": "a", "documents": []}, "documents"),
    ("/rerank", {"query": "a", "documents": ["b"], "top_n": "2"}, "top_n"),
    ("/v1/embeddings", {"input": "a"}, "model"),                 # a classifier embeds nothing
])
def test_bad_requests_are_400s_naming_their_field(cross, path, body, param):
    status, answer = cross.post(path, body)
    assert status == 400, answer
    assert answer["error"]["param"] == param, answer
    assert cross.blocks_free()


def test_the_classifier_routes_on_an_embedding_model_name_the_task(embedder, labels3):
    status, answer = embedder.post("/classify", {"input": "a"})
    assert status == 400 and "task='classify' needs a sequence-classification model" in answer["error"]["message"]
    status, answer = labels3.post("/score", {"text_1": "a", "text_2": "b"})      # three labels: no cross-encoder
    assert status == 400 and "num_labels=3" in answer["error"]["message"], answer


def test_a_wrong_model_is_a_404_and_bad_json_a_400(cross):
    assert cross.post("/classify", {"model": "other", "input": "a"})[0] == 404
    assert cross.post("/rerank", b"{not json")[0] == 400


@pytest.mark.parametrize("path", ["/classify", "/pooling", "/score", "/v1/score", "/rerank", "/v1/rerank",
                                  "/v2/rerank"])
def test_every_route_on_a_generating_server_names_the_runner(path):
    """A generating server (a CoreClient: only its config is read before the runner's check)."""
    core_client = types.SimpleNamespace(config=types.SimpleNamespace(runner="generate"), tokenizer=None)
    app = build_app(core_client, ServerMetrics(), ServedModels(NAME, "/nowhere", 64), BodyLimits(1 << 20, 10.0))
    status, answer = asyncio.run(call(app, path, {"input": "a", "text_1": "a", "text_2": "b", "query": "a",
                                                  "documents": ["b"]}))
    assert status == 400 and "runner='generate'" in answer["error"]["message"], answer
