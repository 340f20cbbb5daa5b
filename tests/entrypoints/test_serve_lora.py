"""`nanopaged serve --enable-lora`: LoRA adapters asked for by name, as vLLM's server serves them.

Two real server processes on the tiny random Llama (free loopback ports). The first serves two
adapters given by --lora-modules (one in each spelling), with runtime updating on and an API key;
the second has no runtime updating, so its load and unload routes do not exist. An adapter's
greedy answer equals `LLM.generate`'s with the same adapter; /v1/models lists the adapters under
the base model; an unknown name is vLLM's 404; an adapter loaded at run time serves at once, and
after its unload its name is a 404 again. In process: the command line's checks, and the name
table's rules (ids in order, never reused). The key is a made-up string. docs/08_server.md, "LoRA adapters".
"""
import http.client
import json
import pathlib
import sys

import pytest

for module in ("fastapi", "uvicorn", "prometheus_client"):
    pytest.importorskip(module, reason="the serve extra: pip install -e '.[serve]'")
openai = pytest.importorskip("openai", reason="the test extra: pip install -e '.[test]'")

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[2]))
from benchmarks.serve import start_nanopaged  # noqa: E402
from nanopaged import LLM, LoRARequest, SamplingParams  # noqa: E402

# float32, as tests/entrypoints/test_serve.py: the server batches differently from one offline call.
SETTINGS = dict(block_size=4, num_kv_blocks=192, max_num_seqs=16, dtype="float32", enable_lora=True, max_loras=2)
ENGINE_ARGS = ["--block-size", "4", "--num-kv-blocks", "192", "--max-num-seqs", "16", "--dtype", "float32",
               "--enable-lora", "--max-loras", "2"]
KEY = "made-up-test-key-not-a-secret"
MODEL_NAME = "tiny"
PROMPT = "Once upon a time, in a land far away"
CHAT = [{"role": "user", "content": "Name a colour."}]


@pytest.fixture(scope="module")
def adapters(tiny_adapters):
    return tiny_adapters["llama"]                 # "attn", "mlp", "all": three ranks and target sets


@pytest.fixture(scope="module")
def server(tiny_model_dirs, adapters):
    modules = [f"attn={adapters['attn']}",
               json.dumps({"name": "mlp", "path": adapters["mlp"], "base_model_name": MODEL_NAME})]
    with pytest.MonkeyPatch.context() as env:
        env.delenv("NANOPAGED_API_KEY", raising=False)
        env.delenv("VLLM_ALLOW_RUNTIME_LORA_UPDATING", raising=False)
        with start_nanopaged(tiny_model_dirs["llama"], [*ENGINE_ARGS, "--api-key", KEY, "--allow-runtime-lora-updating",
                                                        "--lora-modules", *modules],
                             served_model_name=MODEL_NAME, timeout_s=120) as s:
            yield s
    log = s.log.read_text(errors="replace")
    assert "Traceback" not in log, log[-3000:]


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.base_url + "/v1", api_key=KEY, max_retries=0, timeout=60)


@pytest.fixture(scope="module")
def offline(tiny_model_dirs):
    return LLM(tiny_model_dirs["llama"], **SETTINGS)


def greedy(max_tokens):
    return SamplingParams(temperature=0, max_tokens=max_tokens)


def offline_text(offline, adapters, name, max_tokens=16, chat=False) -> str:
    """LLM.generate's (or chat's) greedy text with adapter `name` (None: the base model); the int id is
    the offline engine's own, unrelated to the server's."""
    lora = None if name is None else LoRARequest(name, list(adapters).index(name) + 1, adapters[name])
    if chat:
        return offline.chat(CHAT, greedy(max_tokens), use_tqdm=False, lora_request=lora)[0].outputs[0].text
    return offline.generate(PROMPT, greedy(max_tokens), use_tqdm=False, lora_request=lora)[0].outputs[0].text


def request(server, path: str, body=None, method: str = "POST", key: str | None = KEY) -> tuple[int, str]:
    """(status, body text) of one request on a connection of its own."""
    headers = {"Content-Type": "application/json", **({"Authorization": f"Bearer {key}"} if key else {})}
    conn = http.client.HTTPConnection(server.base_url.removeprefix("http://"), timeout=60)
    try:
        conn.request(method, path, body=None if body is None else json.dumps(body), headers=headers)
        response = conn.getresponse()
        return response.status, response.read().decode()
    finally:
        conn.close()


def complete(client, model: str, max_tokens: int = 16) -> str:
    out = client.completions.create(model=model, prompt=PROMPT, max_tokens=max_tokens, temperature=0)
    assert out.model == model
    return out.choices[0].text


# ---- answers -------------------------------------------------------------------------------------
def test_an_adapter_by_name_answers_as_llm_generate_with_it(client, offline, adapters):
    served = {name: complete(client, name) for name in (MODEL_NAME, "attn", "mlp")}
    expected = {MODEL_NAME: offline_text(offline, adapters, None),
                "attn": offline_text(offline, adapters, "attn"), "mlp": offline_text(offline, adapters, "mlp")}
    assert served == expected
    assert served["attn"] != served[MODEL_NAME] or served["mlp"] != served[MODEL_NAME]   # the adapters do act
    streamed = "".join(c.choices[0].text for c in client.completions.create(
        model="attn", prompt=PROMPT, max_tokens=16, temperature=0, stream=True))
    assert streamed == expected["attn"]


def test_chat_with_an_adapter_answers_as_llm_chat_with_it(client, offline, adapters):
    out = client.chat.completions.create(model="mlp", messages=CHAT, max_tokens=12, temperature=0)
    assert out.model == "mlp"
    assert out.choices[0].message.content == offline_text(offline, adapters, "mlp", 12, chat=True)


def test_models_lists_the_base_model_then_each_adapter_under_it(client, server, adapters, tiny_model_dirs):
    status, text = request(server, "/v1/models", method="GET")
    cards = json.loads(text)["data"]
    assert status == 200 and [c["id"] for c in cards] == [MODEL_NAME, "attn", "mlp"]
    assert [(c["root"], c["parent"]) for c in cards] == [
        (tiny_model_dirs["llama"], None), (adapters["attn"], MODEL_NAME), (adapters["mlp"], MODEL_NAME)]
    assert all(c["object"] == "model" and c["owned_by"] == "nanopaged" and c["max_model_len"] == 512 for c in cards)
    assert [m.id for m in client.models.list().data] == [MODEL_NAME, "attn", "mlp"]


def test_an_unknown_model_is_vllms_404(client, server):
    with pytest.raises(openai.NotFoundError):
        complete(client, "no-such-adapter")
    status, text = request(server, "/v1/chat/completions", {"model": "no-such-adapter", "messages": CHAT})
    assert status == 404 and json.loads(text) == {"error": {
        "message": "The model `no-such-adapter` does not exist.", "type": "NotFoundError", "param": "model",
        "code": 404}}


# ---- loading and unloading while serving ---------------------------------------------------------
def test_an_adapter_loaded_at_run_time_serves_until_it_is_unloaded(client, server, offline, adapters):
    load = {"lora_name": "all", "lora_path": adapters["all"]}
    assert request(server, "/v1/load_lora_adapter", load) == (200, "Success: LoRA adapter 'all' added successfully.")
    expected = offline_text(offline, adapters, "all")
    assert complete(client, "all") == expected
    assert [m.id for m in client.models.list().data] == [MODEL_NAME, "attn", "mlp", "all"]
    status, text = request(server, "/v1/load_lora_adapter", load)                  # the name is taken
    assert status == 400 and "already been loaded" in json.loads(text)["error"]["message"]

    unload = {"lora_name": "all"}
    assert request(server, "/v1/unload_lora_adapter", unload) == (
        200, "Success: LoRA adapter 'all' removed successfully.")
    with pytest.raises(openai.NotFoundError):
        complete(client, "all")
    assert [m.id for m in client.models.list().data] == [MODEL_NAME, "attn", "mlp"]
    status, text = request(server, "/v1/unload_lora_adapter", unload)               # gone already
    assert status == 404 and json.loads(text)["error"]["type"] == "NotFoundError"

    assert request(server, "/v1/load_lora_adapter", load)[0] == 200                 # again, under a new id
    assert complete(client, "all") == expected
    assert request(server, "/v1/unload_lora_adapter", unload)[0] == 200


def test_a_folder_that_is_no_adapter_is_a_400_naming_why_and_the_server_serves_on(client, server, tmp_path):
    status, text = request(server, "/v1/load_lora_adapter", {"lora_name": "empty", "lora_path": str(tmp_path)})
    error = json.loads(text)["error"]
    assert status == 400 and "no adapter_config.json" in error["message"] and error["param"] == "lora_path"
    status, text = request(server, "/v1/load_lora_adapter", {"lora_name": "no-path"})
    assert status == 400 and json.loads(text)["error"]["param"] == "lora_path"
    assert complete(client, "attn", max_tokens=3)
    assert [m.id for m in client.models.list().data] == [MODEL_NAME, "attn", "mlp"]


def test_the_load_route_needs_the_api_key(server, adapters):
    status, text = request(server, "/v1/load_lora_adapter", {"lora_name": "all", "lora_path": adapters["all"]},
                           key=None)
    assert status == 401 and json.loads(text)["error"]["code"] == "invalid_api_key"
    assert request(server, "/v1/unload_lora_adapter", {"lora_name": "attn"}, key="wrong")[0] == 401
    assert [c["id"] for c in json.loads(request(server, "/v1/models", method="GET")[1])["data"]] == [
        MODEL_NAME, "attn", "mlp"]


def test_without_runtime_updating_the_load_and_unload_routes_do_not_exist(tiny_model_dirs, adapters):
    with pytest.MonkeyPatch.context() as env:
        env.delenv("NANOPAGED_API_KEY", raising=False)
        env.delenv("VLLM_ALLOW_RUNTIME_LORA_UPDATING", raising=False)
        with start_nanopaged(tiny_model_dirs["llama"], [*ENGINE_ARGS, "--lora-modules", f"attn={adapters['attn']}"],
                             served_model_name=MODEL_NAME, timeout_s=120) as s:
            assert request(s, "/v1/load_lora_adapter", {"lora_name": "all", "lora_path": adapters["all"]},
                           key=None)[0] == 404
            assert request(s, "/v1/unload_lora_adapter", {"lora_name": "attn"}, key=None)[0] == 404
            client = openai.OpenAI(base_url=s.base_url + "/v1", api_key="none", max_retries=0, timeout=60)
            assert complete(client, "attn", max_tokens=3)               # the adapter still serves


# ---- the command line ----------------------------------------------------------------------------
def test_lora_modules_without_enable_lora_is_an_error_naming_both_flags(capsys):
    from nanopaged.entrypoints.serve import parse_args
    for flags in (["--lora-modules", "a=/x"], ["--allow-runtime-lora-updating"]):
        with pytest.raises(SystemExit) as stopped:
            parse_args(["serve", "/some/model", *flags])
        assert stopped.value.code == 2 and f"{flags[0]} needs --enable-lora" in capsys.readouterr().err
    args = parse_args(["serve", "/m", "--enable-lora", "--lora-modules", "a=/x=y",
                       '{"name": "b", "path": "/z", "base_model_name": "m"}'])
    assert [(m.name, m.path, m.base_model_name) for m in args.lora_modules] == [("a", "/x=y", None), ("b", "/z", "m")]
    for bad in ("a", "=/x", '{"name": "b"}', '{"name": "b", "path": "/z", "rank": 8}'):
        with pytest.raises(SystemExit):
            parse_args(["serve", "/m", "--enable-lora", "--lora-modules", bad])


def test_runtime_updating_honours_vllms_environment_variable(monkeypatch):
    from nanopaged.entrypoints.serve import parse_args, runtime_lora_updating
    monkeypatch.delenv("VLLM_ALLOW_RUNTIME_LORA_UPDATING", raising=False)
    assert not runtime_lora_updating(parse_args(["serve", "/m", "--enable-lora"]))
    assert runtime_lora_updating(parse_args(["serve", "/m", "--enable-lora", "--allow-runtime-lora-updating"]))
    for value, on in (("True", True), ("1", True), ("0", False), ("false", False)):
        monkeypatch.setenv("VLLM_ALLOW_RUNTIME_LORA_UPDATING", value)
        assert runtime_lora_updating(parse_args(["serve", "/m", "--enable-lora"])) is on
        assert not runtime_lora_updating(parse_args(["serve", "/m"]))          # no adapters, no routes


def test_a_bad_adapter_folder_stops_the_start_with_the_reason(tiny_model_dirs, adapters, tmp_path):
    from nanopaged.entrypoints.serve import main
    args = [tiny_model_dirs["llama"], "--port", "0", *ENGINE_ARGS, "--lora-modules", f"attn={adapters['attn']}",
            f"broken={tmp_path}"]
    with pytest.raises(SystemExit) as stopped:
        main(args)
    message = str(stopped.value.code)                   # sys.exit(message): exit status 1
    assert message.startswith("nanopaged serve: --lora-modules 'broken': ") and "no adapter_config.json" in message


# ---- the name table ------------------------------------------------------------------------------
class FakeManager:
    """The LoRA manager's two calls the table makes, recorded; a path "bad" fails as a bad folder would."""

    def __init__(self):
        self.read, self.unloaded = [], []

    def adapter(self, lora_request):
        if lora_request.lora_path == "bad":
            raise ValueError(f"LoRA adapter {lora_request.lora_name!r}: no adapter_config.json in 'bad'")
        self.read.append(lora_request.lora_int_id)

    def unload(self, lora_int_id):
        self.unloaded.append(lora_int_id)


def test_modules_take_ids_in_order_and_a_loaded_adapter_the_next_id_never_a_reused_one():
    from nanopaged.entrypoints.api_server import served_models
    from nanopaged.entrypoints.openai.protocol import OpenAIError
    from nanopaged.entrypoints.serve import parse_args
    manager = FakeManager()
    args = parse_args(["serve", "/m", "--served-model-name", "base", "--enable-lora", "--lora-modules", "a=/a",
                       '{"name": "b", "path": "/b"}'])
    models = served_models(args, manager, 64)
    assert {n: r.lora_int_id for n, r in models.adapters.items()} == {"a": 1, "b": 2} and manager.read == [1, 2]
    models.unload("b")
    assert manager.unloaded == [2] and models.load("b", "/b").lora_int_id == 3      # not 2: a running request may hold it
    for name, path, status in (("a", "/a", 400), ("base", "/x", 400), ("c", "bad", 400)):
        with pytest.raises(OpenAIError) as refused:
            models.load(name, path)
        assert refused.value.status == status
    with pytest.raises(OpenAIError) as refused:
        models.unload("c")
    assert refused.value.status == 404 and [c["id"] for c in models.table.cards] == ["base", "a", "b"]
    assert models.load("c", "/c").lora_int_id == 4                                   # a failed read took no id

    args = parse_args(["serve", "/m", "--served-model-name", "base", "--enable-lora", "--lora-modules",
                       '{"name": "a", "path": "/a", "base_model_name": "other"}'])
    with pytest.raises(ValueError, match="base_model_name 'other' is not the served model, 'base'"):
        served_models(args, manager, 64)
