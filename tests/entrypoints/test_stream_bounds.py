"""What a stream costs the API server, counted in work and in what it holds, without a model: tool-call
parsers read each character once (tool_parsers.py), a client that stops reading holds one pending output
per request (engine_loop.py: Submission), and what the model writes (half a UTF-16 pair in a call's JSON,
a named call cut by max_tokens) is always answered. docs/08_server.md, "Faults".
"""
import asyncio
import json

import pytest

from nanopaged.entrypoints.openai import anthropic_api, tool_parsers
from nanopaged.entrypoints.openai.engine_loop import Submission
from nanopaged.entrypoints.openai.protocol import parse_request
from nanopaged.entrypoints.openai.responses import ResponseBuilder
from nanopaged.entrypoints.openai.tool_parsers import (HermesToolParser, Llama3JsonToolParser, NamedToolCall,
                                                       RequiredToolCalls, ToolCallStream, extract_tool_calls)
from nanopaged.outputs import CompletionOutput, RequestOutput

CALLS = 200


def many_calls(kind: str) -> str:
    one = '{"name": "get_weather", "arguments": {"city": "Paris", "days": [1, 2, 3]}}'
    if kind == "hermes":
        return "Let me look.\n" + "".join(f"<tool_call>\n{one}\n</tool_call>\n" for _ in range(CALLS))
    if kind == "llama3_json":
        return "; ".join(one.replace('"arguments"', '"parameters"') for _ in range(CALLS))
    return "[" + ", ".join(one.replace('"arguments"', '"parameters"') for _ in range(CALLS)) + "]"


@pytest.mark.parametrize("parser", [HermesToolParser, Llama3JsonToolParser, RequiredToolCalls])
def test_a_streamed_tool_call_parser_decodes_each_call_once_and_reads_no_text_twice(monkeypatch, parser):
    """Work counted: JSON decodes (one per call, not one per call per chunk) and the characters the
    name pattern is tried on (bounded per call, not growing with the text)."""
    text = many_calls({HermesToolParser: "hermes", Llama3JsonToolParser: "llama3_json"}.get(parser, "required"))
    decodes, pattern_chars = [], []

    class Counting:
        def raw_decode(self, s, idx=0):
            decodes.append(idx)
            return json.JSONDecoder().raw_decode(s, idx)

    class CountingPattern:
        def match(self, s, pos=0, endpos=None):
            pattern_chars.append((endpos if endpos is not None else len(s)) - pos)
            return REAL.match(s, pos, endpos if endpos is not None else len(s))

    REAL = tool_parsers.NAME_FIRST
    monkeypatch.setattr(tool_parsers, "DECODER", Counting())
    monkeypatch.setattr(tool_parsers, "NAME_FIRST", CountingPattern())
    stream, calls = ToolCallStream(parser()), 0
    for end in range(8, len(text) + 8, 8):                 # 8 characters a chunk
        delta = stream.delta(text[:min(end, len(text))], end >= len(text))
        calls += sum("id" in c for c in delta.get("tool_calls", []))
    assert calls == CALLS
    assert len(decodes) <= CALLS
    assert sum(pattern_chars) <= CALLS * 2 * tool_parsers.NAME_WINDOW


def test_a_named_call_streams_its_arguments_without_copying_the_text_each_chunk():
    stream, sent = ToolCallStream(NamedToolCall("f")), ""
    text = '{"city": "' + "x" * 5000 + '"}'
    for end in range(1, len(text) + 1):
        for piece in stream.delta(text, end == len(text), end).get("tool_calls", []):
            assert len(piece["function"]["arguments"]) <= 1      # only what is new
            sent += piece["function"]["arguments"]
    assert sent == text


@pytest.mark.parametrize("parser, text", [
    (HermesToolParser(), '<tool_call>{"name": "f", "arguments": {"a": "\\ud800"}}</tool_call>'),
    (Llama3JsonToolParser(), '{"name": "f", "parameters": {"a": "x\\udfff"}}'),
    (HermesToolParser(), '<tool_call>{"name": "f\\ud800", "arguments": {}}</tool_call>'),
])
def test_half_a_utf16_pair_the_model_wrote_in_a_call_is_answered_as_utf8(parser, text):
    content, calls = extract_tool_calls(parser, text)
    json.dumps({"content": content, "calls": calls}, ensure_ascii=False).encode("utf-8")   # no UnicodeEncodeError
    stream = ToolCallStream(parser)
    for end in range(1, len(text) + 1):
        json.dumps(stream.delta(text[:end], end == len(text)), ensure_ascii=False).encode("utf-8")


def test_a_named_call_cut_by_max_tokens_is_an_anthropic_message_not_an_error():
    cut = {"id": "t", "type": "function", "function": {"name": "f", "arguments": '{"a": "xy'}}
    response = {"id": "chatcmpl-1", "model": "m", "usage": {"prompt_tokens": 3, "completion_tokens": 4},
                "choices": [{"index": 0, "finish_reason": "length", "stop_reason": None,
                             "message": {"role": "assistant", "content": None, "tool_calls": [cut]}}]}
    message = anthropic_api.to_message(response)
    assert message["stop_reason"] == "max_tokens"
    assert message["content"] == [{"type": "text", "text": '{"a": "xy'}]


def output(rid: str, tokens: int, finished: bool = False) -> RequestOutput:
    return RequestOutput(request_id=rid, prompt="p", prompt_token_ids=[1, 2],
                         outputs=[CompletionOutput(index=0, text="x" * tokens, token_ids=list(range(tokens)),
                                                   cumulative_logprob=None, logprobs=None,
                                                   finish_reason="length" if finished else None)],
                         finished=finished)


def test_a_client_that_stops_reading_holds_one_pending_output_per_request():
    async def run():
        body = {"prompt": ["a", "b"], "max_tokens": 3000, "stream": True}
        submission = Submission(parse_request(body, "completion", "m"), ["r0", "r1"], asyncio.get_running_loop())
        for step in range(1, 3001):                  # the engine runs on; nobody reads
            submission.put([output("r0", step, step == 3000), output("r1", step, step == 3000)])
        assert len(submission.pending) == 2          # one per request, the newest
        builder = ResponseBuilder(submission.request, "cmpl-1", "m", submission.request_ids)
        seen = [o async for o in submission.results()]
        chunks = [chunk for o in seen for chunk in builder.chunks(o)]
        return seen, "".join(choice["text"] for chunk in chunks for choice in chunk["choices"])
    seen, text = asyncio.run(run())
    assert [o.request_id for o in seen] == ["r0", "r1"] and all(o.finished for o in seen)
    assert text == "x" * 6000                        # nothing was lost by merging


def test_a_bug_met_building_one_stream_ends_it_with_an_error_and_done_and_aborts_it():
    pytest.importorskip("fastapi", reason="the serve extra: pip install -e '.[serve]'")
    from nanopaged.entrypoints.openai.app import sse_events

    class Loop:
        aborted = []

        def abort(self, ids):
            self.aborted += ids

    class Broken(ResponseBuilder):
        def chunks(self, output):
            raise RuntimeError("a bug in building chunks")

    async def run():
        body = {"prompt": "a", "max_tokens": 3, "stream": True}
        submission = Submission(parse_request(body, "completion", "m"), ["r0"], asyncio.get_running_loop())
        submission.put([output("r0", 1)])
        builder = Broken(submission.request, "cmpl-1", "m", submission.request_ids)
        return [e async for e in sse_events(Loop(), submission, builder)]
    events = asyncio.run(run())
    assert "a bug in building chunks" in events[-2] and '"internal_server_error"' in events[-2]
    assert events[-1] == "data: [DONE]\n\n" and Loop.aborted == ["r0"]
