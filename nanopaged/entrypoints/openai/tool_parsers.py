"""Tool parsers: the tool calls a model wrote in its text, found whole or as they stream.

A model trained for tools writes a call in its own format; `tool_choice: "auto"` leaves it free to
write one or not, so the server reads the text after it (`--tool-call-parser NAME`):

    hermes         Qwen's and Hermes' `<tool_call>{"name": ..., "arguments": {...}}</tool_call>`, any number;
                   the text before the first one is the message's content
    llama3_json    Llama 3.1's `{"name": ..., "parameters": {...}}`, maybe after `<|python_tag|>`,
                   several separated by `;`, `,` or whitespace; the whole output is calls, or none is

Each parser reads a growing text (`feed(text, end, final)`: the text so far, of which text[:end] may be
read) and keeps where it got to, so every character is read once however many chunks a stream has:
a closed call is never parsed again, and the open one is followed by `JsonEnd` until its object closes,
then decoded once. The whole response is one feed of the final text, and a stream sends what each
feed adds to the last (ToolCallStream), so the two always agree. A call's arguments are JSON text,
`json.dumps` of what the model wrote (vLLM's), known when the call's object closes.
vLLM: vllm/entrypoints/openai/tool_parsers/. docs/08_server.md.
"""
from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass, field

from nanopaged.reasoning import partial_tag_at_end
from nanopaged.validation import encodes_as_utf8

DECODER = json.JSONDecoder()
# The name, once its string is complete, of an object still being written: {"name": "get_weather", ...
NAME_FIRST = re.compile(r'\{\s*"name"\s*:\s*"((?:[^"\\]|\\.)*)"')
# How far into an open call its name is looked for (a name is short); past it, the name comes when
# the call closes. Bounds the work of each chunk while a long call is being written.
NAME_WINDOW = 512
WHITESPACE = " \t\n\r"
# What may stand between two llama3_json calls besides whitespace: vLLM's parser reads every object in
# the text, so `};{`, `},{` and `}\n{` are all two calls there
CALL_SEPARATORS = ";,"


@dataclass
class Call:
    """One tool call as far as the text shows it; None: not written yet. Its arguments are
    source[:length]: JSON text, or a named call's output so far (the stream's text, not copied)."""
    name: str | None = None
    source: str | None = None
    length: int = 0

    @property
    def arguments(self) -> str | None:
        return None if self.source is None else self.source[:self.length]


@dataclass
class Scan:
    content_end: int                     # text[:content_end] is content, safe to send
    calls: list[Call] = field(default_factory=list)
    valid: bool = True                   # False: what looked like a call is not one (the text is content)


def tool_call_id() -> str:
    return f"chatcmpl-tool-{uuid.uuid4().hex}"     # vLLM's ids


def skip_space(text: str, at: int, end: int) -> int:
    while at < end and text[at] in WHITESPACE:
        at += 1
    return at


class JsonEnd:
    """Where a JSON object that starts at text[start] == "{" ends, found as the text grows: brackets
    counted outside strings, each character looked at once."""

    def __init__(self, start: int) -> None:
        self.at, self.depth, self.in_string, self.escaped = start + 1, 1, False, False

    def feed(self, text: str, end: int) -> int | None:
        """The index after the closing brace, or None while it is not in text[:end]."""
        at, depth, in_string, escaped = self.at, self.depth, self.in_string, self.escaped
        while at < end and depth:
            ch = text[at]
            if in_string:
                escaped, in_string = (False, True) if escaped else (ch == "\\", ch != '"')
            elif ch == '"':
                in_string = True
            elif ch in "{[":
                depth += 1
            elif ch in "}]":
                depth -= 1
            at += 1
        self.at, self.depth, self.in_string, self.escaped = at, depth, in_string, escaped
        return at if depth == 0 else None


def _text(value) -> str:
    """JSON text of a decoded value; escaped where it holds half a UTF-16 pair (which the model may
    write as an escape, and UTF-8 cannot carry)."""
    dumped = json.dumps(value, ensure_ascii=False)
    try:
        dumped.encode("utf-8")
    except UnicodeEncodeError:
        return json.dumps(value)
    return dumped


class CallReader:
    """One call's JSON object from text[start:] (after whitespace): its name once written, all of it once
    closed. A ValueError: it is no call (not an object, or closed without a string name or arguments)."""

    def __init__(self, start: int, arguments_keys: tuple[str, ...]) -> None:
        self.start, self.keys, self.call = start, arguments_keys, Call()
        self.brace: int | None = None
        self.json_end: JsonEnd | None = None
        self.end: int | None = None          # where the object ended
        self.broken = False                  # closed, but not JSON: stays open (the final text says no call)
        self.name_upto = 0                   # the name was looked for in text[brace:name_upto]

    def feed(self, text: str, end: int) -> bool:
        """True once the call is closed and read."""
        if self.brace is None:
            self.start = skip_space(text, self.start, end)
            if self.start == end:
                return False
            if text[self.start] != "{":
                raise ValueError(f"not a tool call: {text[self.start:self.start + 20]!r}")
            self.brace, self.json_end = self.start, JsonEnd(self.start)
        if self.broken:
            return False
        closed = self.json_end.feed(text, end)
        if closed is None:
            self._name(text, end)
            return False
        try:
            obj, _ = DECODER.raw_decode(text, self.brace)
        except (ValueError, RecursionError):
            self.broken = True
            return False
        key = next((k for k in self.keys if k in obj), None)
        if key is None or not isinstance(obj.get("name"), str) or not encodes_as_utf8(obj["name"]):
            raise ValueError(f"not a tool call: {text[self.brace:closed][:200]!r}")
        try:
            arguments = _text(obj[key])
        except RecursionError:
            raise ValueError("not a tool call: its arguments nest too deep") from None
        self.call.name, self.call.source, self.call.length, self.end = obj["name"], arguments, len(arguments), closed
        return True

    def _name(self, text: str, end: int) -> None:
        limit = min(end, self.brace + NAME_WINDOW)
        if self.call.name is not None or limit == self.name_upto:
            return
        self.name_upto = limit
        named = NAME_FIRST.match(text, self.brace, limit)
        if named:
            name = json.loads(f'"{named.group(1)}"')
            if not encodes_as_utf8(name):
                raise ValueError("not a tool call: its name holds half a UTF-16 pair")
            self.call.name = name


class HermesToolParser:
    START, END = "<tool_call>", "</tool_call>"

    def __init__(self) -> None:
        self.first: int | None = None        # where the first call's tag starts: the content ends there
        self.searched = 0                    # no tag starts in text[searched_from:searched]
        self.calls: list[Call] = []
        self.reader: CallReader | None = None
        self.invalid = False

    def fresh(self) -> HermesToolParser:
        return HermesToolParser()

    def feed(self, text: str, end: int, final: bool) -> Scan:
        if self.invalid:
            return Scan(end, valid=False)
        while True:
            if self.reader is None:
                at = text.find(self.START, self.searched, end)
                if at < 0:
                    self.searched = max(self.searched, end - len(self.START) + 1)
                    if self.first is None:
                        return Scan(end if final else partial_tag_at_end(text, 0, end, self.START))
                    return Scan(self.first, self.calls)
                self.first = at if self.first is None else self.first
                self.reader = CallReader(at + len(self.START), ("arguments",))
                self.calls.append(self.reader.call)
            try:
                if not self.reader.feed(text, end):
                    return Scan(self.first, self.calls, valid=not final)
            except ValueError:
                self.invalid = True
                return Scan(end, valid=False)
            self.searched, self.reader = self.reader.end, None


class Llama3JsonToolParser:
    TAG = "<|python_tag|>"

    def __init__(self) -> None:
        self.body: int = 0                   # where the text after its leading whitespace starts
        self.calls: list[Call] = []
        self.reader: CallReader | None = None
        self.after: int | None = None        # where the last closed call ended
        self.content = False                 # the text is no call: all of it is content
        self.invalid = False

    def fresh(self) -> Llama3JsonToolParser:
        return Llama3JsonToolParser()

    def feed(self, text: str, end: int, final: bool) -> Scan:
        if self.content or self.invalid:
            return Scan(end, valid=not self.invalid)
        if not self.calls:
            self.body = skip_space(text, self.body, end)
            opening = text[self.body:min(end, self.body + len(self.TAG))]
            if not final and (self.body == end or self.TAG.startswith(opening) and len(opening) < len(self.TAG)):
                return Scan(0)                          # not yet known whether this is a call
            if opening == self.TAG:
                self._open(self.body + len(self.TAG))
            elif opening.startswith("{"):
                self._open(self.body)
            else:
                self.content = True
                return Scan(end)
        try:
            while True:
                if self.reader is not None:
                    if not self.reader.feed(text, end):
                        return Scan(0, self.calls, valid=not final)
                    self.after, self.reader = self.reader.end, None
                self.after = skip_space(text, self.after, end)
                if self.after == end:
                    return Scan(0, self.calls)
                if text[self.after] not in CALL_SEPARATORS + "{":
                    raise ValueError(f"expected ';' or ',' between tool calls, got {text[self.after:self.after + 20]!r}")
                self._open(self.after + (text[self.after] in CALL_SEPARATORS))
        except ValueError:
            self.invalid = True
            return Scan(end, valid=False)

    def _open(self, at: int) -> None:
        self.reader = CallReader(at, ("parameters", "arguments"))
        self.calls.append(self.reader.call)


class RequiredToolCalls:
    """`tool_choice: "required"`: the grammar made the output `[{"name": ..., "parameters": {...}}, ...]`
    (vLLM's shape; tools.py), so every call parses; no content."""

    def __init__(self) -> None:
        self.at: int | None = None           # where the next call (or the array's end) may start
        self.searched = 0
        self.comma = False                   # a ',' may come before the next call
        self.calls: list[Call] = []
        self.reader: CallReader | None = None
        self.done = self.invalid = False

    def fresh(self) -> RequiredToolCalls:
        return RequiredToolCalls()

    def feed(self, text: str, end: int, final: bool) -> Scan:
        if self.invalid:
            return Scan(0, valid=False)
        if self.at is None:
            bracket = text.find("[", self.searched, end)
            self.searched = end
            if bracket < 0:
                return Scan(0, valid=not final)
            self.at = bracket + 1
        try:
            self._read(text, end)
        except ValueError:
            self.invalid = True
            return Scan(0, valid=False)
        return Scan(0, self.calls, valid=bool(self.calls) and self.calls[-1].arguments is not None or not final)

    def _read(self, text: str, end: int) -> None:
        while not self.done:
            if self.reader is None:
                self.at = skip_space(text, self.at, end)
                if self.comma and self.at < end and text[self.at] == ",":
                    self.at, self.comma = skip_space(text, self.at + 1, end), False
                if self.at == end:
                    return
                if text[self.at] == "]":
                    self.done = True
                    return
                self.reader = CallReader(self.at, ("parameters",))
                self.calls.append(self.reader.call)
            if not self.reader.feed(text, end):
                return
            self.at, self.comma, self.reader = self.reader.end, True, None


class NamedToolCall:
    """`tool_choice: {"type": "function", "function": {"name": ...}}`: the grammar made the whole output
    that function's arguments; they stream as they come (vLLM's)."""

    def __init__(self, name: str) -> None:
        self.name = name

    def fresh(self) -> NamedToolCall:
        return NamedToolCall(self.name)

    def feed(self, text: str, end: int, final: bool) -> Scan:
        return Scan(0, [Call(self.name, text, end)])


TOOL_PARSERS = {"hermes": HermesToolParser, "llama3_json": Llama3JsonToolParser}


def extract_tool_calls(parser, text: str) -> tuple[str | None, list[dict]]:
    """(content, tool_calls) of a whole output, in OpenAI's shapes; no calls: (text, [])."""
    scan = parser.fresh().feed(text, len(text), final=True)
    if not scan.valid or not scan.calls:
        return text, []
    calls = [{"id": tool_call_id(), "type": "function", "function": {"name": c.name, "arguments": c.arguments}}
             for c in scan.calls]
    return text[:scan.content_end] or None, calls


class ToolCallStream:
    """One choice's stream: each new text becomes a delta of new content and of tool calls, OpenAI's
    `delta.tool_calls`: a call's first delta has its index, id, type and name, later ones its arguments.
    Only the last call sent and the ones after it can change, so only they are looked at."""

    def __init__(self, parser) -> None:
        self.parser = parser.fresh()
        self.content_sent = 0
        self.sent: list[int] = []           # per call: the characters of its arguments sent
        self.called = False                 # a call was sent: finish_reason "tool_calls"

    def delta(self, text: str, final: bool, end: int | None = None) -> dict:
        """What text[:end] (all of it by default) adds to what was sent."""
        end = len(text) if end is None else end
        scan = self.parser.feed(text, end, final)
        if not scan.valid:                  # a call that broke off: its text is content, as in the whole response
            scan = Scan(end) if not self.sent else Scan(self.content_sent)
        delta = {}
        if scan.content_end > self.content_sent:
            delta["content"] = text[self.content_sent:scan.content_end]
            self.content_sent = scan.content_end
        tool_calls = [d for i in range(max(0, len(self.sent) - 1), len(scan.calls))
                      if (d := self._call_delta(i, scan.calls[i]))]
        if tool_calls:
            delta["tool_calls"] = tool_calls
            self.called = True
        return delta

    def _call_delta(self, index: int, call: Call) -> dict | None:
        if call.name is None:
            return None
        if index == len(self.sent):
            self.sent.append(0)
            delta = {"index": index, "id": tool_call_id(), "type": "function",
                     "function": {"name": call.name, "arguments": ""}}
        else:
            delta = {"index": index, "function": {"arguments": ""}}
        if call.source is not None and call.length > self.sent[index]:
            delta["function"]["arguments"] = call.source[self.sent[index]:call.length]
            self.sent[index] = call.length
        elif "id" not in delta:
            return None
        return delta
