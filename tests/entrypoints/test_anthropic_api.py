"""`/v1/messages`, Anthropic's Messages API (nanopaged/entrypoints/openai/anthropic_api.py).

The translation on its own: an Anthropic body as the chat body that asks for the same thing, a chat
completion as Anthropic's message, chat chunks as Anthropic's events in their order; then the
official `anthropic` client against a real server: a message, a system prompt, stop sequences,
streaming (the events and their order), the key in x-api-key, and bad requests as Anthropic errors.
"""
import json
import pathlib
import sys

import pytest

from nanopaged.entrypoints.openai import anthropic_api as a
from nanopaged.entrypoints.openai.protocol import OpenAIError


def test_a_body_becomes_the_chat_body_that_asks_the_same():
    body = {"model": "m", "max_tokens": 7, "system": [{"type": "text", "text": "Be brief."}],
            "messages": [{"role": "user", "content": [{"type": "text", "text": "Hi"}]},
                         {"role": "assistant", "content": [{"type": "text", "text": "Let me look."},
                                                           {"type": "tool_use", "id": "t1", "name": "f",
                                                            "input": {"x": 1}}]},
                         {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "t1", "content": "2"},
                                                      {"type": "text", "text": "and?"}]}],
            "stop_sequences": ["\n\n"], "temperature": 0.5, "top_k": 3, "stream": True,
            "tools": [{"name": "f", "description": "adds one", "input_schema": {"type": "object"}}],
            "tool_choice": {"type": "any"}}
    chat = a.to_chat_body(body)
    assert chat["messages"] == [
        {"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"},
        {"role": "assistant", "content": "Let me look.",
         "tool_calls": [{"id": "t1", "type": "function", "function": {"name": "f", "arguments": '{"x": 1}'}}]},
        {"role": "tool", "tool_call_id": "t1", "content": "2"}, {"role": "user", "content": "and?"}]
    assert chat["stop"] == ["\n\n"] and chat["temperature"] == 0.5 and chat["top_k"] == 3 and chat["max_tokens"] == 7
    assert chat["stream"] and chat["stream_options"] == {"include_usage": True}
    assert chat["tools"] == [{"type": "function", "function": {"name": "f", "description": "adds one",
                                                               "parameters": {"type": "object"}}}]
    assert chat["tool_choice"] == "required"
    assert a.to_chat_body({**body, "tool_choice": {"type": "tool", "name": "f"}})["tool_choice"] == \
        {"type": "function", "function": {"name": "f"}}
    del body["tool_choice"]
    assert a.to_chat_body(body)["tool_choice"] == "auto"


@pytest.mark.parametrize("change, param", [
    ({"max_tokens": None}, "max_tokens"), ({"max_tokens": 0}, "max_tokens"), ({"max_tokens": True}, "max_tokens"),
    ({"messages": []}, "messages"), ({"messages": [{"role": "system", "content": "x"}]}, "messages"),
    ({"messages": [{"role": "user", "content": [{"type": "image"}]}]}, "messages"),
    ({"messages": [{"role": "user", "content": [{"type": "tool_use", "name": "f"}]}]}, "messages"),
    ({"system": 3}, "system"), ({"stop_sequences": [""]}, "stop_sequences"), ({"tools": [{"name": "f"}]}, "tools"),
    ({"tool_choice": {"type": "some"}}, "tool_choice"), ({"thinking": {}}, "thinking")])
def test_a_bad_body_is_a_400_naming_its_field(change, param):
    body = {"max_tokens": 5, "messages": [{"role": "user", "content": "x"}], **change}
    body = {k: v for k, v in body.items() if v is not None}
    with pytest.raises(OpenAIError) as bad:
        a.to_chat_body(body)
    assert bad.value.status == 400 and bad.value.param == param
    assert a.error_body(bad.value)["error"]["type"] == "invalid_request_error"


def test_a_chat_completion_becomes_a_message():
    response = {"id": "chatcmpl-abc", "model": "m", "usage": {"prompt_tokens": 5, "completion_tokens": 3},
                "choices": [{"finish_reason": "stop", "stop_reason": "\n\n",
                             "message": {"role": "assistant", "content": "Hi"}}]}
    message = a.to_message(response)
    assert message == {"id": "msg_abc", "type": "message", "role": "assistant", "model": "m",
                       "content": [{"type": "text", "text": "Hi"}], "stop_reason": "stop_sequence",
                       "stop_sequence": "\n\n", "usage": {"input_tokens": 5, "output_tokens": 3}}
    calls = {**response["choices"][0], "finish_reason": "tool_calls", "stop_reason": None,
             "message": {"role": "assistant", "content": None, "tool_calls": [
                 {"id": "c1", "type": "function", "function": {"name": "f", "arguments": '{"x": 2}'}}]}}
    message = a.to_message({**response, "choices": [calls]})
    assert message["content"] == [{"type": "tool_use", "id": "c1", "name": "f", "input": {"x": 2}}]
    assert message["stop_reason"] == "tool_use"
    assert a.stop_reason("length", None) == ("max_tokens", None) and a.stop_reason("stop", 2) == ("end_turn", None)


def test_chunks_become_anthropics_events_in_their_order():
    w = a.EventWriter("m", "chatcmpl-abc")
    events = w.start(5)
    events += w.chunk({"choices": [{"delta": {"role": "assistant", "content": ""}, "finish_reason": None}]}, None)
    events += w.chunk({"choices": [{"delta": {"content": "Hel"}, "finish_reason": None}]}, None)
    events += w.chunk({"choices": [{"delta": {"content": "lo"}, "finish_reason": None}]}, None)
    events += w.chunk({"choices": [{"delta": {"tool_calls": [{"index": 0, "id": "c1", "type": "function",
                                                             "function": {"name": "f", "arguments": '{"x":'}}]},
                                    "finish_reason": None}]}, None)
    events += w.chunk({"choices": [{"delta": {"tool_calls": [{"index": 0, "function": {"arguments": " 1}"}}]},
                                    "finish_reason": "tool_calls"}]}, None)
    events += w.end(4)
    names = [e.split("\n")[0].removeprefix("event: ") for e in events]
    assert names == ["message_start", "ping", "content_block_start", "content_block_delta", "content_block_delta",
                     "content_block_stop", "content_block_start", "content_block_delta", "content_block_delta",
                     "content_block_stop", "message_delta", "message_stop"]
    data = [json.loads(e.split("\n")[1].removeprefix("data: ")) for e in events]
    assert data[0]["message"]["id"] == "msg_abc" and data[0]["message"]["usage"]["input_tokens"] == 5
    assert [d["index"] for d in data if d["type"] == "content_block_start"] == [0, 1]
    assert data[6]["content_block"] == {"type": "tool_use", "id": "c1", "name": "f", "input": {}}
    assert "".join(d["delta"].get("partial_json", "") for d in data if d["type"] == "content_block_delta") == '{"x": 1}'
    assert data[-2]["delta"] == {"stop_reason": "tool_use", "stop_sequence": None}
    assert data[-2]["usage"] == {"output_tokens": 4}


# ---- the official client against a real server -------------------------------------------------
anthropic = pytest.importorskip("anthropic", reason="the test extra: pip install -e '.[test]'")
for module in ("fastapi", "uvicorn", "prometheus_client", "zmq", "msgspec"):
    pytest.importorskip(module, reason="the serve extra: pip install -e '.[serve]'")
sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[2]))
from benchmarks.serve import start_nanopaged  # noqa: E402
from nanopaged import LLM, SamplingParams  # noqa: E402
from test_serve import ENGINE_ARGS, SETTINGS  # noqa: E402

KEY = "sk-test-anthropic"


@pytest.fixture(scope="module")
def server(tiny_model_dirs):
    with pytest.MonkeyPatch.context() as env:
        env.delenv("NANOPAGED_API_KEY", raising=False)
        with start_nanopaged(tiny_model_dirs["qwen2"], [*ENGINE_ARGS, "--api-key", KEY], served_model_name="tiny",
                             timeout_s=120) as s:
            yield s


@pytest.fixture(scope="module")
def client(server):
    return anthropic.Anthropic(base_url=server.base_url, api_key=KEY, max_retries=0, timeout=60)


@pytest.fixture(scope="module")
def offline(tiny_model_dirs):
    return LLM(tiny_model_dirs["qwen2"], **SETTINGS)


def offline_chat(offline, messages, **kw):
    return offline.chat(messages, SamplingParams(temperature=0, **kw), use_tqdm=False)[0].outputs[0]


def test_a_message_with_a_system_prompt_equals_offline_chat(client, offline):
    answer = client.messages.create(model="tiny", max_tokens=12, extra_body={"temperature": 0}, system="You are terse.",
                                    messages=[{"role": "user", "content": "Hello there"}])
    expected = offline_chat(offline, [{"role": "system", "content": "You are terse."},
                                      {"role": "user", "content": "Hello there"}], max_tokens=12)
    assert answer.type == "message" and answer.role == "assistant" and answer.id.startswith("msg_")
    assert [b.type for b in answer.content] == ["text"] and answer.content[0].text == expected.text
    assert answer.stop_reason == {"length": "max_tokens", "stop": "end_turn"}[expected.finish_reason]
    assert answer.usage.output_tokens == len(expected.token_ids)


def test_a_stop_sequence_is_named(client, offline):
    full = offline_chat(offline, [{"role": "user", "content": "Tell me more"}], max_tokens=24).text
    cut = next(full[i:i + 2] for i in range(3, len(full) - 1) if full[i:i + 2].strip())     # a pair from the middle
    answer = client.messages.create(model="tiny", max_tokens=24, extra_body={"temperature": 0}, stop_sequences=[cut],
                                    messages=[{"role": "user", "content": "Tell me more"}])
    assert answer.stop_reason == "stop_sequence" and answer.stop_sequence == cut
    assert answer.content[0].text == full[:full.index(cut)]


def test_streaming_sends_anthropics_events_in_order_with_the_same_text(client, offline):
    messages = [{"role": "user", "content": "Hello there"}]
    with client.messages.stream(model="tiny", max_tokens=12, extra_body={"temperature": 0}, messages=messages) as stream:
        kinds = [e.type for e in stream]
        final = stream.get_final_message()
    expected = offline_chat(offline, messages, max_tokens=12)
    assert kinds[0] == "message_start" and kinds[-1] == "message_stop" and "message_delta" in kinds
    assert kinds.index("content_block_start") < kinds.index("content_block_stop") < kinds.index("message_delta")
    assert final.content[0].text == expected.text and final.usage.output_tokens == len(expected.token_ids)


def test_the_key_goes_in_x_api_key_and_a_wrong_one_is_a_401(server):
    wrong = anthropic.Anthropic(base_url=server.base_url, api_key="wrong", max_retries=0, timeout=30)
    with pytest.raises(anthropic.AuthenticationError):
        wrong.messages.create(model="tiny", max_tokens=2, messages=[{"role": "user", "content": "x"}])


def test_bad_requests_are_anthropic_errors(client):
    with pytest.raises(anthropic.BadRequestError) as bad:
        client.messages.create(model="tiny", max_tokens=0, messages=[{"role": "user", "content": "x"}])
    assert bad.value.body["type"] == "error" and "max_tokens" in bad.value.body["error"]["message"]
    with pytest.raises(anthropic.NotFoundError):
        client.messages.create(model="claude-9", max_tokens=2, messages=[{"role": "user", "content": "x"}])
