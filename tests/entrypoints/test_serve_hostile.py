"""One request never takes the server down: hostile requests against a real server, on both layouts.

Each case sends what a hostile (or careless) client would, expects a 4xx that names the limit, then
checks that a normal request is still served and /health answers 200, in the default process layout
(an engine core and an API server, where every request crosses a ZeroMQ socket as MessagePack) and
with --engine-in-process. And if the API server's socket thread dies anyway, its process exits so
its supervisor sees it. docs/08_server.md, "Faults".
"""
import http.client
import json
import os
import pathlib
import subprocess
import sys
import textwrap

import pytest

for module in ("fastapi", "uvicorn", "prometheus_client", "zmq", "msgspec"):
    pytest.importorskip(module, reason="the serve extra: pip install -e '.[serve]'")

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[2]))
from benchmarks.serve import start_nanopaged  # noqa: E402
from nanopaged.entrypoints.serve import RUNTIME_LORA_ENV, parse_args  # noqa: E402
from nanopaged.sampling_params import MAX_N, MAX_STOP_STRINGS  # noqa: E402

ENGINE_ARGS = ["--block-size", "4", "--num-kv-blocks", "192", "--max-num-seqs", "8", "--dtype", "float32"]
CHAT = {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 4, "temperature": 0}
LAYOUTS = {"processes": [], "in-process": ["--engine-in-process"]}


@pytest.fixture(scope="module", params=list(LAYOUTS))
def server(request, tiny_model_dirs):
    with pytest.MonkeyPatch.context() as env:
        env.delenv("NANOPAGED_API_KEY", raising=False)
        with start_nanopaged(tiny_model_dirs["qwen2"], [*ENGINE_ARGS, *LAYOUTS[request.param]],
                             served_model_name="tiny", timeout_s=180) as s:
            yield s
    log = s.log.read_text(errors="replace")
    assert "Traceback" not in log, log[-3000:]       # nothing a client did here is a server error


def call(server, method: str, path: str, body=None) -> tuple[int, dict, str]:
    host, port = server.base_url.removeprefix("http://").split(":")
    conn = http.client.HTTPConnection(host, int(port), timeout=120)
    try:
        data = None if body is None else json.dumps(body).encode()
        conn.request(method, path, body=data, headers={"Content-Type": "application/json"})
        response = conn.getresponse()
        raw = response.read().decode()
        try:
            parsed = json.loads(raw) if raw else {}
        except ValueError:
            parsed = {}
        return response.status, parsed, raw
    finally:
        conn.close()


def served_and_healthy(server) -> None:
    status, body, _ = call(server, "POST", "/v1/chat/completions", CHAT)
    assert status == 200 and body["choices"][0]["message"]["role"] == "assistant", body
    status, body, raw = call(server, "POST", "/v1/chat/completions", {**CHAT, "stream": True})
    assert status == 200 and raw.rstrip().endswith("data: [DONE]"), raw[-300:]
    assert call(server, "GET", "/health")[0] == 200


def refused(server, body: dict, match: str, path: str = "/v1/chat/completions", status: int = 400) -> None:
    got, answer, raw = call(server, "POST", path, body)
    assert got == status, raw[:500]
    assert match in raw, raw[:500]
    served_and_healthy(server)


@pytest.mark.parametrize("change, match", [
    ({"max_tokens": None, "min_tokens": 10**30}, "min_tokens is 1000000000000000000000000000000, outside"),
    ({"max_tokens": None, "min_tokens": 2**64 - 1}, "min_tokens must be in [0, 9223372036854775807]"),
    ({"seed": 2**64}, "seed is 18446744073709551616, outside"),
    ({"stop_token_ids": [2**64]}, "stop_token_ids[0] is 18446744073709551616, outside"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {
        "type": "integer", "maximum": 2**70}}}},
     "response_format.json_schema.schema.maximum is 1180591620717411303424"),
    ({"max_tokens": 2**63}, "max_tokens must be in [1, 9223372036854775807]"),
])
def test_an_integer_past_what_the_socket_carries_is_a_400_and_the_server_serves_on(server, change, match):
    refused(server, {k: v for k, v in {**CHAT, **change}.items() if v is not None}, match)


@pytest.mark.parametrize("n, match", [(10**30, "n is 1000000000000000000000000000000, outside"),
                                      (10**6, f"n must be in [1, {MAX_N}]"), (MAX_N + 1, f"n must be in [1, {MAX_N}]")])
def test_n_past_its_cap_is_refused_before_anything_is_made_per_sample(server, n, match):
    refused(server, {**CHAT, "n": n}, match)


def test_n_past_max_num_seqs_is_a_400_that_names_it(server):
    refused(server, {**CHAT, "n": 9}, "max_num_seqs=8")


def test_too_many_stop_strings_are_a_400_naming_the_limit(server):
    refused(server, {**CHAT, "stop": [f"stop-{i}" for i in range(200_000)]}, f"MAX_STOP_STRINGS={MAX_STOP_STRINGS}")
    refused(server, {**CHAT, "stop": ["x" * 10_000]}, "MAX_STOP_STRING_CHARS=")


def test_deep_json_inside_a_tool_calls_arguments_is_a_400(server):
    deep = "[" * 5000 + "]" * 5000
    for arguments in (deep, "[" * 200 + "]" * 200):
        messages = [{"role": "user", "content": "Hi"},
                    {"role": "assistant", "content": None, "tool_calls": [
                        {"id": "c1", "type": "function", "function": {"name": "f", "arguments": arguments}}]},
                    {"role": "tool", "tool_call_id": "c1", "content": "ok"}]
        refused(server, {**CHAT, "messages": messages}, "nest too deep")


def test_a_named_tool_cut_by_max_tokens_is_an_anthropic_message(server):
    body = {"model": "tiny", "max_tokens": 3, "messages": [{"role": "user", "content": "Weather?"}],
            "tools": [{"name": "f", "input_schema": {"type": "object", "properties": {"city": {"type": "string"}},
                                                     "required": ["city"]}}],
            "tool_choice": {"type": "tool", "name": "f"}}
    status, answer, raw = call(server, "POST", "/v1/messages", body)
    assert status == 200 and answer["stop_reason"] == "max_tokens", raw[:500]
    served_and_healthy(server)


def test_vllms_runtime_lora_variable_needs_one_api_server_too(monkeypatch, capsys):
    monkeypatch.setenv(RUNTIME_LORA_ENV, "1")
    with pytest.raises(SystemExit):
        parse_args(["--enable-lora", "--api-server-count", "2"])
    assert RUNTIME_LORA_ENV in capsys.readouterr().err


def test_the_api_server_exits_non_zero_if_its_engine_core_thread_dies(tiny_model_dirs):
    """A fault outside any one request (here: made to happen) must not leave a process that answers
    503 for ever: it says so on stderr and exits, for the supervisor to see."""
    script = textwrap.dedent(f"""
        import multiprocessing, sys, time
        from nanopaged.config import EngineConfig
        from nanopaged.engine.input_processor import load_tokenizer
        from nanopaged.entrypoints.openai.core_client import CoreClient
        config = EngineConfig(model={str(tiny_model_dirs["qwen2"])!r}, block_size=4, num_kv_blocks=16)
        lifeline, _keep = multiprocessing.Pipe(duplex=False)
        client = CoreClient("api-0", "ipc:///tmp/nanopaged-test-nowhere", config, load_tokenizer(config.tokenizer),
                            16, lifeline)
        def broken():
            raise RuntimeError("a bug outside any one request")
        client._take_commands = broken
        client.start()                           # its first command (Hello) wakes the thread, which dies
        time.sleep(60)
        sys.exit(0)                              # not reached: the thread's end exits the process
    """)
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120,
                          env={**os.environ, "PYTHONPATH": str(pathlib.Path(__file__).resolve().parents[2])})
    assert done.returncode == 1, done.stderr[-2000:]
    assert "engine-core thread died" in done.stderr and "a bug outside any one request" in done.stderr


def test_one_requests_outputs_failing_fails_that_request_alone(tiny_model_dirs):
    """The socket thread's step of outputs, driven by hand: a bug met by one request's outputs is its
    500; the other request of the same step gets its output, and nothing propagates to the thread."""
    import asyncio
    import multiprocessing

    from nanopaged.config import EngineConfig
    from nanopaged.engine.input_processor import load_tokenizer
    from nanopaged.entrypoints import core_messages as m
    from nanopaged.entrypoints.openai.core_client import CoreClient
    from nanopaged.entrypoints.openai.engine_loop import Submission
    from nanopaged.entrypoints.openai.protocol import parse_request

    config = EngineConfig(model=str(tiny_model_dirs["qwen2"]), block_size=4, num_kv_blocks=16)
    lifeline, _keep = multiprocessing.Pipe(duplex=False)
    client = CoreClient("api-test", f"ipc:///tmp/nanopaged-test-{os.getpid()}", config,
                        load_tokenizer(config.tokenizer), 16, lifeline)
    real = client.outputs.process

    def process(sampled):
        if any(r.request_id == "bad" for r in sampled):
            raise RuntimeError("a bug met by one request")
        return real(sampled)

    client.outputs.process = process

    async def run():
        loop, subs = asyncio.get_running_loop(), {}
        for rid in ("good", "bad"):
            subs[rid] = Submission(parse_request({"prompt": "Hi", "max_tokens": 4, "stream": True}, "completion",
                                                 "tiny"), [rid], loop)
            client._add(subs[rid], client._process(subs[rid]))
        client._outputs(m.Outputs([m.RequestDelta(rid, [m.SampleDelta(0, [5], None, None, None)], 0)
                                   for rid in ("good", "bad")]))
        await asyncio.sleep(0.1)                     # the posted callbacks run
        return subs
    subs = asyncio.run(run())
    assert list(subs["good"].pending) == ["good"] and subs["good"].error is None
    assert subs["bad"].error.status == 500 and "a bug met by one request" in subs["bad"].error.message
    assert "bad" not in client.routes and "good" in client.routes
