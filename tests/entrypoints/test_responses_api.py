"""`/v1/responses`, OpenAI's Responses API (nanopaged/entrypoints/openai/responses_api.py).

The translation on its own (input items as chat messages, a completion as output items, chat chunks
as the Responses events in their order, the store's bounds); then the official `openai` client against
real servers: a tiny Qwen3 with Qwen3's template and `--reasoning-parser qwen3` in one process, and the
tiny Llama in the default layout (an engine core and an API server): whole and streamed responses,
reasoning items, a follow-up through previous_response_id (the earlier turn is in the prompt), an
unknown id, bad bodies as 4xx in the API's error shape, the store's bound, function tools.
docs/08_server.md, "The Responses API".
"""
import json
import pathlib
import re
import sys

import pytest

from nanopaged.entrypoints.openai import responses_api as r
from nanopaged.entrypoints.openai.protocol import OpenAIError

for module in ("fastapi", "uvicorn", "prometheus_client"):
    pytest.importorskip(module, reason="the serve extra: pip install -e '.[serve]'")
pytest.importorskip("xgrammar", reason="the structured extra: pip install -e '.[structured]'")
openai = pytest.importorskip("openai", reason="the test extra: pip install -e '.[test]'")

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[2]))
sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
from test_serve import post  # noqa: E402
from test_serve_reasoning import THINK_THEN_ANSWER, client_of, qwen3_dir, start  # noqa: E402,F401

FORCED = {"extra_body": {"structured_outputs": {"regex": THINK_THEN_ANSWER}}}
WEATHER = {"type": "function", "name": "get_weather", "description": "The weather in a city",
           "parameters": {"type": "object", "required": ["city"],
                          "properties": {"city": {"type": "string", "enum": ["Paris", "Rome"]}}}}


# ---- the translation ---------------------------------------------------------------------------
def test_input_items_become_the_chat_messages_that_ask_the_same():
    store = r.ResponseStore(10, 1 << 20)
    turn = r.parse({"input": [{"role": "developer", "content": "Be brief."},
                              {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "Hi"}]},
                              {"type": "reasoning", "id": "rs_1", "summary": []},
                              {"type": "function_call", "call_id": "c1", "name": "f", "arguments": "{}"},
                              {"type": "function_call_output", "call_id": "c1", "output": "2"}],
                    "instructions": "You are terse.", "max_output_tokens": 9, "temperature": 0.5,
                    "tools": [WEATHER], "tool_choice": {"type": "function", "name": "get_weather"},
                    "text": {"format": {"type": "json_object"}}}, store)
    assert turn.chat_body["messages"] == [
        {"role": "system", "content": "You are terse."}, {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Hi"},
        {"role": "assistant", "content": None,
         "tool_calls": [{"id": "c1", "type": "function", "function": {"name": "f", "arguments": "{}"}}]},
        {"role": "tool", "tool_call_id": "c1", "content": "2"}]
    assert turn.conversation == turn.chat_body["messages"][1:]            # the instructions are not kept
    assert turn.chat_body["max_tokens"] == 9 and turn.chat_body["temperature"] == 0.5
    assert turn.chat_body["tools"] == [{"type": "function", "function": {k: WEATHER[k] for k in
                                                                         ("name", "description", "parameters")}}]
    assert turn.chat_body["tool_choice"] == {"type": "function", "function": {"name": "get_weather"}}
    assert turn.chat_body["response_format"] == {"type": "json_object"}


@pytest.mark.parametrize("body, param", [
    ({}, "input"), ({"input": []}, "input"), ({"input": [{"role": "robot", "content": "x"}]}, "input"),
    ({"input": [{"role": "user", "content": [{"type": "input_file"}]}]}, "input"),
    ({"input": "x", "instructions": 3}, "instructions"), ({"input": "x", "tools": [{"type": "web_search"}]}, "tools"),
    ({"input": "x", "tool_choice": "sometimes"}, "tool_choice"), ({"input": "x", "text": {"format": "yaml"}}, "text"),
    ({"input": "x", "store": "yes"}, "store"), ({"input": "x", "parallel_tool_calls": False}, "parallel_tool_calls"),
    ({"input": "x", "background": True}, "background"), ({"input": "x", "metadata": {"a": 1}}, "metadata")])
def test_a_bad_body_is_a_400_naming_its_field(body, param):
    with pytest.raises(OpenAIError) as bad:
        r.parse(body, r.ResponseStore(10, 1 << 20))
    assert bad.value.status == 400 and bad.value.param == param


def test_a_completion_becomes_output_items():
    turn = r.parse({"input": "x"}, r.ResponseStore(10, 1 << 20))
    completion = {"model": "m", "usage": {"prompt_tokens": 5, "completion_tokens": 3},
                  "choices": [{"finish_reason": "tool_calls", "message": {
                      "role": "assistant", "content": "Let me look.", "reasoning_content": "they want weather",
                      "tool_calls": [{"id": "c1", "type": "function",
                                      "function": {"name": "f", "arguments": '{"x": 1}'}}]}}]}
    response = turn.response(completion)
    assert [i["type"] for i in response["output"]] == ["reasoning", "message", "function_call"]
    assert response["output"][0]["content"] == [{"type": "reasoning_text", "text": "they want weather"}]
    assert response["output"][1]["content"][0]["text"] == "Let me look."
    assert response["output"][2]["call_id"] == "c1" and response["output"][2]["arguments"] == '{"x": 1}'
    assert response["status"] == "completed" and response["usage"]["total_tokens"] == 8
    cut = turn.response({**completion, "choices": [{"finish_reason": "length", "message": {"content": "a"}}]})
    assert cut["status"] == "incomplete" and cut["incomplete_details"] == {"reason": "max_output_tokens"}


def events_of(texts: list[str]) -> list[dict]:
    return [json.loads(t.split("data: ", 1)[1]) for t in texts]


def test_chunks_become_the_responses_events_in_their_order():
    turn = r.parse({"input": "x"}, r.ResponseStore(10, 1 << 20))
    w = r.EventWriter(turn, "m")
    texts = w.start()
    for delta in ({"reasoning_content": "hm"}, {"reasoning_content": "m"}, {"content": "Hi"}, {"content": "!"},
                  {"tool_calls": [{"index": 0, "id": "c1", "function": {"name": "f", "arguments": ""}}]},
                  {"tool_calls": [{"index": 0, "function": {"arguments": "{}"}}]}):
        texts += w.chunk({"choices": [{"delta": delta, "finish_reason": None}]})
    texts += w.end({"prompt_tokens": 2, "completion_tokens": 4})
    events = events_of(texts)
    assert [e["type"] for e in events] == [
        "response.created", "response.in_progress",
        "response.output_item.added", "response.content_part.added", "response.reasoning_text.delta",
        "response.reasoning_text.delta", "response.reasoning_text.done", "response.content_part.done",
        "response.output_item.done",
        "response.output_item.added", "response.content_part.added", "response.output_text.delta",
        "response.output_text.delta", "response.output_text.done", "response.content_part.done",
        "response.output_item.done",
        "response.output_item.added", "response.function_call_arguments.delta",
        "response.function_call_arguments.done", "response.output_item.done", "response.completed"]
    assert [e["sequence_number"] for e in events] == list(range(len(events)))
    final = events[-1]["response"]
    assert [i["type"] for i in final["output"]] == ["reasoning", "message", "function_call"]
    assert final["output"][1]["content"][0]["text"] == "Hi!" and final["output"][2]["arguments"] == "{}"
    assert [e["item"] for e in events if e["type"] == "response.output_item.done"] == final["output"]


def test_the_store_keeps_the_most_recently_used_within_its_count_and_bytes():
    store = r.ResponseStore(2, 10_000)
    for rid in ("a", "b", "c"):
        store.put({"id": rid}, [{"role": "user", "content": rid}])
    with pytest.raises(OpenAIError) as gone:
        store.get("a")
    assert gone.value.status == 404 and gone.value.param == "previous_response_id"
    store.get("b")                                   # used: "c" is now the least recently used
    store.put({"id": "d"}, [])
    assert store.get("b") and store.get("d")
    with pytest.raises(OpenAIError):
        store.get("c")
    store.put({"id": "e"}, [{"role": "user", "content": "x" * 6_000}])
    store.put({"id": "f"}, [{"role": "user", "content": "y" * 6_000}])
    assert store.bytes <= 10_000 and list(store.entries) == ["f"]
    store.put({"id": "g"}, [{"role": "user", "content": "z" * 20_000}])     # larger than the store: not kept
    assert list(store.entries) == ["f"]


# ---- the server ----------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def qwen_server(qwen3_dir):
    with start(qwen3_dir, "--engine-in-process", "--reasoning-parser", "qwen3", "--max-stored-responses", "3",
               "--enable-auto-tool-choice", "--tool-call-parser", "hermes") as s:
        yield s


@pytest.fixture(scope="module")
def core_server(tiny_model_dirs):
    with start(tiny_model_dirs["qwen3"], "--max-stored-responses", "3") as s:     # engine core + API server
        yield s


def create(server, **kw):
    return client_of(server).responses.create(**{"model": "qwen3", "max_output_tokens": 40, "temperature": 0, **kw})


def test_a_response_whole_and_streamed_alike(qwen_server):
    whole = create(qwen_server, input="Why is the sky blue?", instructions="Think first.", **FORCED)
    assert whole.id.startswith("resp_") and whole.status == "completed" and whole.object == "response"
    reasoning, message = whole.output
    assert reasoning.type == "reasoning" and message.type == "message"
    assert re.fullmatch(THINK_THEN_ANSWER, f"<think>{reasoning.content[0].text}</think>{whole.output_text}")
    assert whole.usage.input_tokens > 0 and whole.usage.output_tokens > 0
    with client_of(qwen_server).responses.stream(model="qwen3", input="Why is the sky blue?", instructions="Think first.",
                                                 max_output_tokens=40, temperature=0, **FORCED) as stream:
        kinds = [event.type for event in stream]
        streamed = stream.get_final_response()
    assert kinds[:2] == ["response.created", "response.in_progress"] and kinds[-1] == "response.completed"
    assert kinds.count("response.output_text.delta") > 1 and "response.reasoning_text.delta" in kinds
    assert streamed.output_text == whole.output_text
    assert streamed.output[0].content[0].text == reasoning.content[0].text
    assert streamed.usage.output_tokens == whole.usage.output_tokens


def test_stream_true_gives_the_events_as_the_client_reads_them(qwen_server):
    events = list(create(qwen_server, input="Hello", stream=True, max_output_tokens=8))
    assert events[0].type == "response.created" and events[-1].type == "response.completed"
    text = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert text == events[-1].response.output_text and events[-1].response.status == "incomplete"


@pytest.mark.parametrize("which", ["qwen_server", "core_server"])
def test_a_follow_up_carries_the_earlier_turn_in_its_prompt(request, which):
    server = request.getfixturevalue(which)
    first = create(server, input="Name a colour.", max_output_tokens=12)
    follow = create(server, input="And another?", previous_response_id=first.id, max_output_tokens=12)
    alone = create(server, input="And another?", max_output_tokens=12)
    # the prompt holds the first question, its answer and the new question
    assert follow.usage.input_tokens > alone.usage.input_tokens + first.usage.output_tokens
    assert follow.previous_response_id == first.id
    assert client_of(server).responses.retrieve(first.id).output_text == first.output_text


def test_a_streamed_response_is_stored_too(qwen_server):
    events = list(create(qwen_server, input="Hi", stream=True, max_output_tokens=6))
    rid = events[-1].response.id
    assert client_of(qwen_server).responses.retrieve(rid).output_text == events[-1].response.output_text
    assert create(qwen_server, input="more", previous_response_id=rid, max_output_tokens=4).status


def test_an_unknown_or_forgotten_id_is_a_404_in_the_error_shape(qwen_server):
    status, body = post(qwen_server, "/v1/responses", {"input": "x", "previous_response_id": "resp_nobody"})
    assert status == 404 and body["error"]["param"] == "previous_response_id" and "not found" in body["error"]["message"]
    first = create(qwen_server, input="one", max_output_tokens=2)
    for i in range(3):                               # the server keeps 3 (--max-stored-responses)
        create(qwen_server, input=f"other {i}", max_output_tokens=2)
    with pytest.raises(openai.NotFoundError):
        create(qwen_server, input="two", previous_response_id=first.id)
    unstored = create(qwen_server, input="one", max_output_tokens=2, store=False)
    with pytest.raises(openai.NotFoundError):
        client_of(qwen_server).responses.retrieve(unstored.id)


@pytest.mark.parametrize("body, status, param", [
    ({"input": "x", "max_output_tokens": -1}, 400, "max_output_tokens"),
    ({"input": "x", "max_output_tokens": 10 ** 6}, 400, "max_output_tokens"),
    ({"input": "x", "temperature": "hot"}, 400, "temperature"),
    ({"input": "x", "model": "gpt-5"}, 404, "model"),
    ({"input": "x", "reasoning": {"effort": "high"}}, 400, "reasoning"),
    ({"input": [{"role": "user"}]}, 400, "input"),
    ({"input": "x", "tools": [WEATHER], "tool_choice": "auto", "stream": "yes"}, 400, "stream"),
    (b"{not json", 400, None)])
def test_bad_bodies_are_4xx_in_the_error_shape(qwen_server, body, status, param):
    got, answer = post(qwen_server, "/v1/responses", body)
    assert got == status and set(answer) == {"error"} and answer["error"]["param"] == param
    assert answer["error"]["message"] and answer["error"]["type"]


def test_function_tools_come_back_as_function_call_items(qwen_server):
    tool_choice = {"type": "function", "name": "get_weather"}
    whole = create(qwen_server, input="Weather in Paris?", tools=[WEATHER], tool_choice=tool_choice,
                   max_output_tokens=60)
    call = next(item for item in whole.output if item.type == "function_call")
    assert call.name == "get_weather" and json.loads(call.arguments)["city"] in ("Paris", "Rome")
    events = list(create(qwen_server, input="Weather in Paris?", tools=[WEATHER], tool_choice=tool_choice,
                         max_output_tokens=60, stream=True))
    arguments = "".join(e.delta for e in events if e.type == "response.function_call_arguments.delta")
    assert arguments == call.arguments
    answer = create(qwen_server, previous_response_id=whole.id, max_output_tokens=4,
                    input=[{"type": "function_call_output", "call_id": call.call_id, "output": "sunny"}])
    assert answer.usage.input_tokens > whole.usage.input_tokens
