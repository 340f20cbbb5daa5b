"""The tool parsers (nanopaged/entrypoints/openai/tool_parsers.py) and the checks of tools and tool_choice
(tools.py), without a model or a server.

The whole-text cases are vLLM's own test strings where they fit (tests/tool_parsers/
test_llama3_json_tool_parser.py, test_hermes_tool_parser.py); every case is also streamed a character
at a time, and the stream's content and calls must add up to the whole parse.
"""
import json

import pytest

from nanopaged.entrypoints.openai.tool_parsers import (HermesToolParser, Llama3JsonToolParser, NamedToolCall,
                                                       RequiredToolCalls, ToolCallStream, extract_tool_calls)
from nanopaged.engine.chat_tools import chat_messages
from nanopaged.entrypoints.openai.tools import check_tool_choice, constraint


def streamed(parser, text: str, step: int = 1) -> tuple[str | None, list[dict], list[dict]]:
    """(content, calls, deltas) of `text` fed to a ToolCallStream `step` characters at a time."""
    stream, deltas = ToolCallStream(parser), []
    for end in list(range(step, len(text), step)) + [len(text)]:
        delta = stream.delta(text[:end], end == len(text))
        if delta:
            deltas.append(delta)
    content, calls = "", []
    for delta in deltas:
        content += delta.get("content", "")
        for piece in delta.get("tool_calls", []):
            if "id" in piece:                                  # a call's first delta: id, type, name
                assert piece["index"] == len(calls) and piece["type"] == "function"
                calls.append({"id": piece["id"], "type": "function",
                              "function": {"name": piece["function"]["name"], "arguments": ""}})
            calls[piece["index"]]["function"]["arguments"] += piece["function"]["arguments"]
    return content or None, calls, deltas


def same_calls(a: list[dict], b: list[dict]) -> bool:
    """Equal but for the ids, which are drawn fresh each time."""
    return [c["function"] for c in a] == [c["function"] for c in b]


def check_stream_equals_whole(parser, text: str):
    content, calls = extract_tool_calls(parser, text)
    for step in (1, 3, 7):
        s_content, s_calls, _ = streamed(parser, text, step)
        assert s_content == content and same_calls(s_calls, calls), (step, s_content, s_calls)
    assert all(c["id"].startswith("chatcmpl-tool-") and len(c["id"]) == len("chatcmpl-tool-") + 32 for c in calls)
    return content, calls


def args(call: dict) -> dict:
    return json.loads(call["function"]["arguments"])


# ---- llama3_json: vLLM's strings -------------------------------------------------------------------
def test_llama3_json_one_call_with_arguments():
    text = '{"name": "searchTool", "parameters": {"query": "test query", "limit": 10}}'
    content, calls = check_stream_equals_whole(Llama3JsonToolParser(), text)
    assert content is None and [c["function"]["name"] for c in calls] == ["searchTool"]
    assert '"query": "test query"' in calls[0]["function"]["arguments"] and args(calls[0])["limit"] == 10


def test_llama3_json_several_calls_separated_by_semicolons_with_or_without_spaces():
    for separator in ("; ", " ; "):
        text = separator.join(['{"name": "searchTool", "parameters": {"query": "test1"}}',
                               '{"name": "getOpenIncidentsTool", "parameters": {}}',
                               '{"name": "searchTool", "parameters": {"query": "test2"}}'])
        content, calls = check_stream_equals_whole(Llama3JsonToolParser(), text)
        assert content is None
        assert [c["function"]["name"] for c in calls] == ["searchTool", "getOpenIncidentsTool", "searchTool"]
        assert calls[1]["function"]["arguments"] == "{}" and args(calls[2]) == {"query": "test2"}


@pytest.mark.parametrize("separator", ["},{", "}; {", "};{", "},\n{", "}\n{"])
def test_llama3_json_two_calls_joined_by_a_comma_a_semicolon_or_a_newline_are_two_calls(separator):
    """vLLM's parser reads every object in the output (`{` after the last one's end), so a comma or a
    newline separates two calls as a semicolon does; none of them is content."""
    text = '{"name": "searchTool", "parameters": {"query": "a"}' + separator + '"name": "lookup", "parameters": {}}'
    content, calls = check_stream_equals_whole(Llama3JsonToolParser(), text)
    assert content is None and [c["function"]["name"] for c in calls] == ["searchTool", "lookup"]
    assert args(calls[0]) == {"query": "a"} and args(calls[1]) == {}


def test_llama3_json_after_the_python_tag_and_with_the_arguments_key():
    text = '<|python_tag|>{"name": "searchTool", "arguments": {"query": "test"}}'
    content, calls = check_stream_equals_whole(Llama3JsonToolParser(), text)
    assert content is None and args(calls[0]) == {"query": "test"}


def test_llama3_json_nested_objects_brackets_and_escaped_quotes_in_strings():
    text = ('{"name": "parserTool", "parameters": {"text": "He said \\"Hello {world}\\"", '
            '"config": {"database": {"connection": {"pool": {"size": 10}}}}, "q": "test {value} [complex]"}}')
    _, calls = check_stream_equals_whole(Llama3JsonToolParser(), text)
    assert args(calls[0])["text"] == 'He said "Hello {world}"'
    assert args(calls[0])["config"]["database"]["connection"]["pool"]["size"] == 10


@pytest.mark.parametrize("text", [
    "This is just some text without any tool calls",
    '{"name": "invalidTool", "parameters": {invalid json}',
    '{"parameters": {}}',                                        # no name
    '{"name": "toolWithoutParams"}',                             # no arguments
    '{"name": "searchTool", "parameters": {"query": "test1"}} and then some words',
])
def test_llama3_json_text_that_is_no_call_is_the_content(text):
    """Whole. (Streamed, a call whose name was sent before its JSON broke stays sent, as in vLLM.)"""
    assert extract_tool_calls(Llama3JsonToolParser(), text) == (text, [])


def test_llama3_json_streams_text_as_content_once_it_cannot_be_a_call():
    content, calls, deltas = streamed(Llama3JsonToolParser(), "  <|python is not the tag")
    assert (content, calls) == ("  <|python is not the tag", [])
    assert deltas[0] == {"content": "  <|python "}         # held back while it could still be the tag


# ---- hermes ------------------------------------------------------------------------------------------
HERMES_TWO = ('<tool_call>\n{"name": "get_current_weather", "arguments": {"city": "Dallas", "state": "TX", '
              '"unit": "fahrenheit"}}\n</tool_call>\n<tool_call>\n{"name": "get_current_weather", "arguments": '
              '{"city": "Orlando", "state": "FL", "unit": "fahrenheit"}}\n</tool_call>')


def test_hermes_several_calls_and_no_content():
    content, calls = check_stream_equals_whole(HermesToolParser(), HERMES_TWO)
    assert content is None and len(calls) == 2
    assert args(calls[0]) == {"city": "Dallas", "state": "TX", "unit": "fahrenheit"}
    assert args(calls[1])["city"] == "Orlando"


def test_hermes_the_text_before_the_first_call_is_the_content():
    text = "I'll check the weather for you.\n\n" + HERMES_TWO
    content, calls = check_stream_equals_whole(HermesToolParser(), text)
    assert content == "I'll check the weather for you.\n\n" and len(calls) == 2


def test_hermes_a_call_cut_before_its_closing_tag_still_counts():
    text = '<tool_call>\n{"name": "get_time", "arguments": {}}'
    content, calls = check_stream_equals_whole(HermesToolParser(), text)
    assert content is None and calls[0]["function"] == {"name": "get_time", "arguments": "{}"}


@pytest.mark.parametrize("text", ["Hello! How can I help you today?", "a < b, and <tool is not a tag <tool_"])
def test_hermes_text_without_a_call_is_the_content(text):
    assert check_stream_equals_whole(HermesToolParser(), text) == (text, [])


@pytest.mark.parametrize("text", [
    '<tool_call>\n{"name": "get_time", "arguments": {broken}}\n</tool_call>',
    '<tool_call>\n{"name": "get_time", "arguments": {"a": 1}',     # max_tokens cut the object
    '<tool_call>\n["get_time"]\n</tool_call>',
])
def test_hermes_a_call_that_does_not_parse_leaves_the_text_as_content(text):
    assert extract_tool_calls(HermesToolParser(), text) == (text, [])


def test_hermes_holds_back_what_may_be_the_start_of_a_tag():
    """Streamed, `<tool_` is not sent as content while it may still become `<tool_call>`."""
    stream = ToolCallStream(HermesToolParser())
    assert stream.delta("Sure<tool_", False) == {"content": "Sure"}
    assert stream.delta("Sure<tool_call>{", False) == {}
    delta = stream.delta('Sure<tool_call>{"name": "f", "arg', False)
    assert delta["tool_calls"][0]["function"] == {"name": "f", "arguments": ""}
    assert stream.delta('Sure<tool_call>{"name": "f", "arguments": {"x": 1}}', False) == {
        "tool_calls": [{"index": 0, "function": {"arguments": '{"x": 1}'}}]}
    assert stream.called


# ---- required and named: what the grammar made ---------------------------------------------------------
def test_required_reads_the_array_vllm_constrains_to():
    text = '[{"name": "a", "parameters": {"x": 1}}, {"name": "b", "parameters": {}}]'
    content, calls = check_stream_equals_whole(RequiredToolCalls(), text)
    assert content is None and [(c["function"]["name"], args(c)) for c in calls] == [("a", {"x": 1}), ("b", {})]
    assert extract_tool_calls(RequiredToolCalls(), '[{"name": "a", "parameters": {"x"') == (
        '[{"name": "a", "parameters": {"x"', [])                  # cut by max_tokens: text, no calls


def test_named_streams_the_arguments_as_they_come():
    content, calls, deltas = streamed(NamedToolCall("f"), '{"x": 12}', step=2)
    assert content is None and calls[0]["function"] == {"name": "f", "arguments": '{"x": 12}'}
    assert len(deltas) == 5 and deltas[0]["tool_calls"][0]["function"] == {"name": "f", "arguments": '{"'}
    assert deltas[1] == {"tool_calls": [{"index": 0, "function": {"arguments": 'x"'}}]}     # as vLLM: first the name


# ---- tools and tool_choice ---------------------------------------------------------------------------
WEATHER = {"type": "function", "function": {"name": "get_weather", "description": "The weather in a city",
           "parameters": {"type": "object", "properties": {"city": {"type": "string", "enum": ["Paris", "Rome"]}},
                          "required": ["city"]}}}
CLOCK = {"type": "function", "function": {"name": "get_time"}}


def function_with(parameters) -> list[dict]:
    return [{"type": "function", "function": {"name": "f", "parameters": parameters}}]


def test_tool_choice_as_vllm_reads_it():
    assert check_tool_choice([WEATHER], None, "hermes").choice == "auto"     # tools without a choice: auto
    assert check_tool_choice([], None, None).choice == "none"
    assert check_tool_choice([], "required", None).choice == "none"         # nothing to require
    assert check_tool_choice(None, "none", None) is None
    named = check_tool_choice([WEATHER, CLOCK], {"type": "function", "function": {"name": "get_time"}}, None)
    assert (named.choice, named.function) == ("named", "get_time")
    assert constraint(named) == {"type": "object", "properties": {}}        # no parameters: an empty object
    required = constraint(check_tool_choice([WEATHER, CLOCK], "required", None))
    assert required["type"] == "array" and required["minItems"] == 1
    assert [o["properties"]["name"]["enum"] for o in required["items"]["anyOf"]] == [["get_weather"], ["get_time"]]


@pytest.mark.parametrize("tools, tool_choice, match", [
    ("get_weather", None, r"^tools must be a list"),
    ([{"type": "retrieval"}], "none", r"^tools\[0\] must be"),
    ([{"type": "function", "function": {"description": "x"}}], "none", r"^tools\[0\]\.function\.name"),
    ([WEATHER, WEATHER], "none", r"names two tools"),
    (function_with("x"), "none", r"parameters must be a JSON Schema object"),
    (function_with({"type": "string"}), "none", r"schema of an object"),
    (function_with({"type": "objet"}), "none", r"\.type must be one of"),
    (function_with({"properties": {"a": 3}}), "none", r"properties\.a must be a JSON Schema"),
    (function_with({"required": "a"}), "none", r"required must be"),
    ([WEATHER], "auto", r'^tool_choice: "auto" tool choice requires --enable-auto-tool-choice'),
    ([WEATHER], {"type": "function", "function": {"name": "get_time"}}, r"^tool_choice names the function"),
    ([WEATHER], "sometimes", r"^tool_choice must be"),
    ([WEATHER], {"function": {"name": "get_weather"}}, r"^tool_choice must be"),
    (None, "required", r"^tool_choice needs tools"),
])
def test_bad_tools_and_tool_choices_are_named(tools, tool_choice, match):
    with pytest.raises(ValueError, match=match):
        check_tool_choice(tools, tool_choice, None)


def test_an_assistants_tool_calls_are_rendered_with_objects_as_arguments():
    call = {"id": "chatcmpl-tool-1", "type": "function", "function": {"name": "get_weather",
                                                                       "arguments": '{"city": "Paris"}'}}
    (message,) = chat_messages([{"role": "assistant", "content": None, "tool_calls": [call]}])
    assert message["content"] == "" and message["tool_calls"][0]["function"]["arguments"] == {"city": "Paris"}
    with pytest.raises(ValueError, match=r"messages\[0\]\.tool_calls\[0\]\.function\.arguments must be JSON"):
        chat_messages([{"role": "assistant", "tool_calls": [{**call, "function": {"name": "f", "arguments": "{"}}]}])
    with pytest.raises(ValueError, match=r"messages\[1\]\.tool_calls must be a list"):
        chat_messages([{"role": "user", "content": "x"}, {"role": "assistant", "tool_calls": "f()"}])
