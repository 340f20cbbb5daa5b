"""The pooling tasks' routes on `nanopaged serve --runner pooling` in its default layout: API server and
engine core in two processes, every result crossing the socket with its request's last delta (flat: a
token task's rows one after another). A cross-encoder (a classifier of one label) answers /classify,
/pooling (its per-token rewards), /score and /rerank as LLM.classify, reward and score do offline.
The routes' every field and error: tests/entrypoints/test_pooling_routes.py (in-process, fast).
"""
import json
import urllib.error
import urllib.request

import pytest

for module in ("fastapi", "uvicorn"):
    pytest.importorskip(module, reason="the serve extra: pip install -e '.[serve]'")

from test_pooling_tasks import SETTINGS, save_classifier  # noqa: E402

from benchmarks.serve import start_nanopaged  # noqa: E402
from nanopaged import LLM  # noqa: E402

ENGINE_ARGS = ["--runner", "pooling", "--block-size", "4", "--num-kv-blocks", "64", "--dtype", "float32"]


@pytest.fixture(scope="module")
def folder(tiny_model_dirs, tmp_path_factory):
    return save_classifier(tiny_model_dirs["qwen2"], tmp_path_factory.mktemp("cross") / "cross", 1)


@pytest.fixture(scope="module")
def server(folder):
    with pytest.MonkeyPatch.context() as env:
        env.delenv("NANOPAGED_API_KEY", raising=False)
        with start_nanopaged(folder, ENGINE_ARGS, served_model_name="tiny-cross", timeout_s=120) as s:
            yield s


def post(server, path: str, body: dict) -> tuple[int, dict]:
    request = urllib.request.Request(server.base_url + path, data=json.dumps(body).encode(),
                                     headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=60) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


def close(a, b, atol=1e-5):
    return len(a) == len(b) and all(abs(x - y) <= atol for x, y in zip(a, b))


def test_every_pooling_route_crosses_the_engine_cores_socket_with_the_offline_answers(server, folder):
    offline = LLM(folder, runner="pooling", **SETTINGS)
    texts, documents = ["Hello world", "The quick brown fox"], ["a cat", "the sky", "cats purr"]

    status, body = post(server, "/classify", {"input": texts})
    assert status == 200, body
    assert close([d["probs"][0] for d in body["data"]], [o.outputs.probs[0] for o in offline.classify(texts)])

    status, body = post(server, "/pooling", {"input": texts[1]})                # token_classify: every token
    [reward] = offline.reward(texts[1:])
    assert status == 200 and close([row[0] for row in body["data"][0]["data"]], reward.outputs.data[:, 0].tolist())

    scores = [o.outputs.score for o in offline.score("what is a cat", documents)]
    status, body = post(server, "/score", {"text_1": "what is a cat", "text_2": documents})
    assert status == 200 and close([d["score"] for d in body["data"]], scores), body
    status, body = post(server, "/v2/rerank", {"query": "what is a cat", "documents": documents, "top_n": 2})
    best = sorted(range(3), key=lambda i: -scores[i])[:2]
    assert status == 200 and [r["index"] for r in body["results"]] == best, body

    status, body = post(server, "/v1/embeddings", {"input": "a"})               # a classifier embeds nothing
    assert status == 400 and "task='embed'" in body["error"]["message"], body
