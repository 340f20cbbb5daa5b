"""Tool parsers: the tool calls a model wrote in its text, found whole or as they stream.

A model trained for tools writes a call in its own format; `tool_choice: "auto"` leaves it free to
write one or not, so the server reads the text after it (`--tool-call-parser NAME`):

    hermes         Qwen's and Hermes' `<tool_call>{"name": ..., "arguments": {...}}</tool_call>`, any number;
                   the text before the first one is the message's content
    llama3_json    Llama 3.1's `{"name": ..., "parameters": {...}}`, maybe after `<|python_tag|>`,
                   several separated by `;`; the whole output is calls, or none is

Each parser has one function, `scan(text, final)`, that reads a text so far: where its content
ends, and each call's name and arguments once they are known. The whole response is the scan of
the final text, and a stream sends what each scan adds to the last (ToolCallStream), so the two
always agree. A call's arguments are JSON text, `json.dumps` of what the model wrote (vLLM's), known
when the call's object closes. vLLM: vllm/entrypoints/openai/tool_parsers/. docs/08_server.md.
"""
from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass, field

DECODER = json.JSONDecoder()
# The name, once its string is complete, of an object still being written: {"name": "get_weather", ...
NAME_FIRST = re.compile(r'\s*\{\s*"name"\s*:\s*"((?:[^"\\]|\\.)*)"')


@dataclass
class Call:
    """One tool call as far as the text shows it; None: not written yet."""
    name: str | None = None
    arguments: str | None = None         # JSON text


@dataclass
class Scan:
    content_end: int                     # text[:content_end] is content, safe to send
    calls: list[Call] = field(default_factory=list)
    valid: bool = True                   # False: what looked like a call is not one (the text is content)


def tool_call_id() -> str:
    return f"chatcmpl-tool-{uuid.uuid4().hex}"     # vLLM's ids


def read_call(text: str, start: int, arguments_keys: tuple[str, ...]) -> tuple[Call, int | None]:
    """The call whose JSON object starts at text[start:] (after whitespace), and where it ends (None:
    not closed yet). A closed object without a string name or with no arguments key is no call."""
    try:
        obj, end = DECODER.raw_decode(text, len(text) - len(text[start:].lstrip()))
    except ValueError:                  # not closed yet (or never will be: `final` decides)
        named = NAME_FIRST.match(text, start)
        return Call(json.loads(f'"{named.group(1)}"') if named else None), None
    key = next((k for k in arguments_keys if isinstance(obj, dict) and k in obj), None)
    if key is None or not isinstance(obj.get("name"), str):
        raise ValueError(f"not a tool call: {text[start:end]!r}")
    return Call(obj["name"], json.dumps(obj[key], ensure_ascii=False)), end


def held_back(text: str, marker: str) -> int:
    """Where content must stop while the text may be ending in the start of `marker`."""
    for n in range(min(len(marker) - 1, len(text)), 0, -1):
        if marker.startswith(text[-n:]):
            return len(text) - n
    return len(text)


class HermesToolParser:
    START, END = "<tool_call>", "</tool_call>"

    def scan(self, text: str, final: bool) -> Scan:
        first = text.find(self.START)
        if first < 0:
            return Scan(len(text) if final else held_back(text, self.START))
        calls, at = [], first
        try:
            while at >= 0:
                call, end = read_call(text, at + len(self.START), ("arguments",))
                calls.append(call)
                if end is None:
                    return Scan(first, calls, valid=not final)
                at = text.find(self.START, end)
        except ValueError:
            return Scan(len(text), valid=False)
        return Scan(first, calls)


class Llama3JsonToolParser:
    TAG = "<|python_tag|>"

    def scan(self, text: str, final: bool) -> Scan:
        body = text.lstrip()
        if not final and (not body or self.TAG.startswith(body)):
            return Scan(0)                          # not yet known whether this is a call
        at = len(text) - len(body) + (len(self.TAG) if body.startswith(self.TAG) else 0)
        if not body.startswith((self.TAG, "{")):
            return Scan(len(text))
        calls = []
        try:
            while True:
                call, end = read_call(text, at, ("parameters", "arguments"))
                calls.append(call)
                if end is None:
                    return Scan(0, calls, valid=not final)
                rest = text[end:].lstrip()
                if not rest:
                    return Scan(0, calls)
                if not rest.startswith(";"):
                    raise ValueError(f"expected ';' between tool calls, got {rest[:20]!r}")
                at = len(text) - len(rest) + 1
        except ValueError:
            return Scan(len(text), valid=False)


class RequiredToolCalls:
    """`tool_choice: "required"`: the grammar made the output `[{"name": ..., "parameters": {...}}, ...]`
    (vLLM's shape; tools.py), so every call parses; no content."""

    def scan(self, text: str, final: bool) -> Scan:
        calls, at = [], text.find("[") + 1
        if at == 0:
            return Scan(0, valid=not final)
        try:
            while text[at:].lstrip()[:1] not in ("]", ""):
                call, end = read_call(text, at, ("parameters",))
                calls.append(call)
                if end is None:
                    break
                rest = text[end:].lstrip()
                at = len(text) - len(rest) + rest.startswith(",")
        except ValueError:
            return Scan(0, valid=False)
        return Scan(0, calls, valid=bool(calls) and calls[-1].arguments is not None or not final)


class NamedToolCall:
    """`tool_choice: {"type": "function", "function": {"name": ...}}`: the grammar made the whole output
    that function's arguments; they stream as they come (vLLM's)."""

    def __init__(self, name: str) -> None:
        self.name = name

    def scan(self, text: str, final: bool) -> Scan:
        return Scan(0, [Call(self.name, text)])


TOOL_PARSERS = {"hermes": HermesToolParser, "llama3_json": Llama3JsonToolParser}


def extract_tool_calls(parser, text: str) -> tuple[str | None, list[dict]]:
    """(content, tool_calls) of a whole output, in OpenAI's shapes; no calls: (text, [])."""
    scan = parser.scan(text, final=True)
    if not scan.valid or not scan.calls:
        return text, []
    calls = [{"id": tool_call_id(), "type": "function", "function": {"name": c.name, "arguments": c.arguments}}
             for c in scan.calls]
    return text[:scan.content_end] or None, calls


class ToolCallStream:
    """One choice's stream: each new text becomes a delta of new content and of tool calls, OpenAI's
    `delta.tool_calls`: a call's first delta has its index, id, type and name, later ones its arguments."""

    def __init__(self, parser) -> None:
        self.parser = parser
        self.content_sent = 0
        self.sent: list[list] = []          # per call: [name sent, arguments sent]
        self.called = False                 # a call was sent: finish_reason "tool_calls"

    def delta(self, text: str, final: bool) -> dict:
        scan = self.parser.scan(text, final)
        if not scan.valid:                  # a call that broke off: its text is content, as in the whole response
            scan = Scan(len(text)) if not self.sent else Scan(self.content_sent)
        delta = {}
        if scan.content_end > self.content_sent:
            delta["content"] = text[self.content_sent:scan.content_end]
            self.content_sent = scan.content_end
        tool_calls = [d for i, call in enumerate(scan.calls) if (d := self._call_delta(i, call))]
        if tool_calls:
            delta["tool_calls"] = tool_calls
            self.called = True
        return delta

    def _call_delta(self, index: int, call: Call) -> dict | None:
        if call.name is None:
            return None
        if index == len(self.sent):
            self.sent.append([call.name, ""])
            delta = {"index": index, "id": tool_call_id(), "type": "function",
                     "function": {"name": call.name, "arguments": ""}}
        else:
            delta = {"index": index, "function": {"arguments": ""}}
        sent = self.sent[index][1]
        if call.arguments is not None and call.arguments.startswith(sent) and len(call.arguments) > len(sent):
            delta["function"]["arguments"] = call.arguments[len(sent):]
            self.sent[index][1] = call.arguments
        elif "id" not in delta:
            return None
        return delta
