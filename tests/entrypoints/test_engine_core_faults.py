"""One message never takes the engine core down (nanopaged/entrypoints/engine_core.py).

A hostile peer on the engine core's socket sends well-typed messages with hostile fields (lora=[],
a negative or a text id, a huge list, parameters of the wrong type, an adapter folder that is no
adapter): each gets its request's Refused or AdapterDone with the reason, and the next request is
served as LLM.generate serves it. Through a real server with --allow-runtime-lora-updating, in both
layouts: a malformed adapter is a 400, then a request is served and /health is 200.
docs/12_lora.md, "Limits".
"""
import http.client
import json
import pathlib
import shutil
import sys
import threading

import pytest

for module in ("fastapi", "uvicorn", "prometheus_client", "zmq", "msgspec"):
    pytest.importorskip(module, reason="the serve extra: pip install -e '.[serve]'")

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[2]))
from benchmarks.serve import start_nanopaged  # noqa: E402
from nanopaged import LLM, SamplingParams  # noqa: E402

SETTINGS = dict(block_size=4, num_kv_blocks=192, max_num_seqs=16, dtype="float32", enable_lora=True, max_loras=2)
ENGINE_ARGS = ["--block-size", "4", "--num-kv-blocks", "192", "--max-num-seqs", "16", "--dtype", "float32",
               "--enable-lora", "--max-loras", "2", "--allow-runtime-lora-updating"]
GREEDY = SamplingParams(temperature=0, max_tokens=3)


def broken_adapters(good: str, root: pathlib.Path) -> dict[str, pathlib.Path]:
    """Copies of a good adapter folder, each broken one way a hostile client could."""
    broken = {}
    for name, config in {"list": "[1, 2]", "alpha-text": None, "deep": "[" * 100_000 + "]" * 100_000}.items():
        folder = broken[name] = pathlib.Path(shutil.copytree(good, root / name))
        if config is None:
            config = json.dumps({**json.loads((folder / "adapter_config.json").read_text()), "lora_alpha": "16"})
        (folder / "adapter_config.json").write_text(config)
    return broken


@pytest.fixture
def core(tiny_model_dirs, tmp_path):
    """(an engine core's loop on a thread, a DEALER peer on its socket, the greedy tokens its LLM gives
    [5, 6, 7] offline, taken before the loop holds the LLM)."""
    import zmq
    from nanopaged.entrypoints.engine_core import EngineCore
    llm = LLM(tiny_model_dirs["llama"], **SETTINGS)
    expected = llm.generate({"prompt_token_ids": [5, 6, 7]}, GREEDY, use_tqdm=False)[0].outputs[0].token_ids
    engine_core = EngineCore(llm, f"ipc://{tmp_path}/core")
    loop = threading.Thread(target=engine_core.run, daemon=True)
    loop.start()
    peer = zmq.Context.instance().socket(zmq.DEALER)
    peer.setsockopt(zmq.IDENTITY, b"api-0")
    peer.connect(f"ipc://{tmp_path}/core")
    yield loop, peer, expected
    from nanopaged.entrypoints import core_messages as m
    peer.send(m.encode(m.Shutdown()))
    loop.join(timeout=30)
    peer.close(linger=0)


def answers_until(peer, done, timeout_ms=60_000) -> list:
    """The engine core's answers until `done(answers)` holds (or nothing comes for timeout_ms)."""
    from nanopaged.entrypoints import core_messages as m
    answers = []
    while not done(answers) and peer.poll(timeout_ms):
        answers.append(m.client_decoder.decode(peer.recv()))
    return answers


def test_a_hostile_message_is_refused_alone_and_the_engine_core_serves_on(core, tiny_adapters, tmp_path):
    from nanopaged.entrypoints import core_messages as m
    loop, peer, expected = core
    params = m.params_to_wire(GREEDY)
    hostile = {"empty-lora": dict(lora=[]), "negative-id": dict(lora=["x", -1, "/p"]),
               "text-id": dict(lora=["x", "1", "/p"]), "huge-lora": dict(lora=[["x"]] * 100_000),
               "lora-of-dicts": dict(lora=[{}, 1, {}]), "n-as-text": dict(params={**params, "n": "many"}),
               "temperature-list": dict(params={**params, "temperature": [1]}),
               "pooling-junk": dict(pooling={"dimensions": {"a": 1}}), "no-params": dict(params={"max_tokens": []})}
    for rid, fields in hostile.items():
        peer.send(m.encode(m.AddRequest(rid, [5, 6, 7], **{"params": params, **fields})))
    bad = broken_adapters(tiny_adapters["llama"]["attn"], tmp_path)
    adapters = [m.Adapter(True, []), m.Adapter(False, ["", -3, ""]),
                *(m.Adapter(True, [name, 10 + i, str(folder)]) for i, (name, folder) in enumerate(bad.items()))]
    for message in adapters:
        peer.send(m.encode(message))
    answers = answers_until(peer, lambda a: len(a) >= len(hostile) + len(adapters))
    refused = {a.request_id for a in answers if isinstance(a, m.Refused)}
    assert refused == set(hostile) and loop.is_alive()
    done = sorted((a.lora_int_id, a.error is not None) for a in answers if isinstance(a, m.AdapterDone))
    assert done == [(-3, True), (0, True), (10, True), (11, True), (12, True)]

    peer.send(m.encode(m.AddRequest("ok", [5, 6, 7], params)))
    answers = answers_until(peer, lambda a: any(isinstance(x, m.Outputs) and x.deltas[0].samples[0].finish_reason
                                                   for x in a))
    tokens = [t for a in answers if isinstance(a, m.Outputs) for t in a.deltas[0].samples[0].token_ids]
    assert tokens == expected


def test_an_adapter_is_read_off_the_engine_thread(core, tiny_adapters, monkeypatch):
    """The loop goes on stepping while an adapter is read: a read that waits for a request's end
    would never end if the read ran on the loop's thread."""
    from nanopaged.entrypoints import core_messages as m
    from nanopaged.lora import manager as lora_manager
    loop, peer, expected = core
    finished = threading.Event()
    real = lora_manager.load_adapter

    def slow_read(*args, **kwargs):
        assert finished.wait(60), "the request never finished while the adapter was read"
        return real(*args, **kwargs)
    monkeypatch.setattr(lora_manager, "load_adapter", slow_read)
    peer.send(m.encode(m.Adapter(True, ["attn", 1, tiny_adapters["llama"]["attn"]])))
    peer.send(m.encode(m.AddRequest("ok", [5, 6, 7], m.params_to_wire(GREEDY))))
    answers = answers_until(peer, lambda a: any(isinstance(x, m.Outputs) and x.deltas[0].samples[0].finish_reason
                                                   for x in a))
    finished.set()
    answers += answers_until(peer, lambda a: any(isinstance(x, m.AdapterDone) for x in a))
    assert [a.error for a in answers if isinstance(a, m.AdapterDone)] == [None]


def post(server, path: str, body: dict) -> tuple[int, str]:
    conn = http.client.HTTPConnection(server.base_url.removeprefix("http://"), timeout=120)
    try:
        conn.request("POST", path, body=json.dumps(body), headers={"Content-Type": "application/json"})
        response = conn.getresponse()
        return response.status, response.read().decode()
    finally:
        conn.close()


def health(server) -> int:
    conn = http.client.HTTPConnection(server.base_url.removeprefix("http://"), timeout=30)
    try:
        conn.request("GET", "/health")
        return conn.getresponse().status
    finally:
        conn.close()


@pytest.mark.parametrize("layout", [[], ["--engine-in-process"]], ids=["processes", "in-process"])
def test_a_malformed_adapter_is_a_400_and_the_server_serves_on(tiny_model_dirs, tiny_adapters, tmp_path, layout):
    bad = broken_adapters(tiny_adapters["llama"]["attn"], tmp_path)
    with pytest.MonkeyPatch.context() as env:
        env.delenv("NANOPAGED_API_KEY", raising=False)
        env.delenv("VLLM_ALLOW_RUNTIME_LORA_UPDATING", raising=False)
        with start_nanopaged(tiny_model_dirs["llama"], [*ENGINE_ARGS, *layout], served_model_name="tiny",
                             timeout_s=180) as server:
            for name, folder in bad.items():
                status, text = post(server, "/v1/load_lora_adapter", {"lora_name": name, "lora_path": str(folder)})
                assert status == 400 and "adapter_config.json" in json.loads(text)["error"]["message"], text
            assert post(server, "/v1/load_lora_adapter",
                        {"lora_name": "attn", "lora_path": tiny_adapters["llama"]["attn"]})[0] == 200
            for model in ("tiny", "attn"):
                status, text = post(server, "/v1/completions", {"model": model, "prompt": "Once upon a time",
                                                                "max_tokens": 3, "temperature": 0})
                assert status == 200 and json.loads(text)["choices"][0]["text"], text
            assert health(server) == 200
    log = server.log.read_text(errors="replace")
    assert "Traceback" not in log, log[-3000:]
