"""Tool calling: a request's `tools` and `tool_choice`, checked, and what each choice asks of the engine.

The tools reach the model through its chat template (transformers' `apply_chat_template(tools=...)`);
the engine knows nothing of them. What `tool_choice` changes is the output:

    "none"                   the model writes text; nothing is parsed
    "auto"                   the model may write calls in its own format; the server's parser finds them
                             (--enable-auto-tool-choice --tool-call-parser NAME; tool_parsers.py)
    "required"               the output is constrained, by the structured-output backend, to a JSON array
                             of {"name": one of the tools, "parameters": that tool's schema} (vLLM's shape)
    {"type": "function",     the output is constrained to that function's parameters schema
     "function": {"name"}}

So a required or named call's arguments always parse (unless max_tokens cuts them). vLLM:
vllm/entrypoints/openai/protocol.py (check_tool_usage) and serving_chat.py. docs/08_server.md,
"Tool calling".
"""
from __future__ import annotations

import json
from dataclasses import dataclass

from nanopaged.entrypoints.openai.tool_parsers import (TOOL_PARSERS, NamedToolCall, RequiredToolCalls,
                                                       ToolCallStream, extract_tool_calls)

# JSON Schema's type names: a property's "type" must be one of them (or a list of them).
SCHEMA_TYPES = ("object", "array", "string", "number", "integer", "boolean", "null")
NO_PARAMETERS = {"type": "object", "properties": {}}     # a function declared without parameters takes none
AUTO_NEEDS_FLAGS = '"auto" tool choice requires --enable-auto-tool-choice and --tool-call-parser to be set'


@dataclass
class ToolCalling:
    """What a chat request asked of tools, for the response: how to read its output."""
    tools: list[dict]
    choice: str                     # "none" | "auto" | "required" | "named"
    function: str | None = None     # the named function
    parser: str | None = None       # "auto": the server's --tool-call-parser

    def reader(self):
        """The parser that reads this request's output, or None ("none": text only)."""
        if self.choice == "auto":
            return TOOL_PARSERS[self.parser]()
        if self.choice == "required":
            return RequiredToolCalls()
        return NamedToolCall(self.function) if self.choice == "named" else None

    def extract(self, text: str) -> tuple[str | None, list[dict]]:
        reader = self.reader()
        return (text, []) if reader is None else extract_tool_calls(reader, text)

    def stream(self) -> ToolCallStream | None:
        reader = self.reader()
        return None if reader is None else ToolCallStream(reader)


def check_tools(tools) -> list[dict]:
    """OpenAI's function tools, or a ValueError naming the first thing wrong (`tools[i]...`)."""
    if not isinstance(tools, list):
        raise ValueError(f"tools must be a list of function tools, got {type(tools).__name__}")
    names = set()
    for i, tool in enumerate(tools):
        where = f"tools[{i}]"
        if not isinstance(tool, dict) or tool.get("type") != "function" or not isinstance(tool.get("function"), dict):
            raise ValueError(f'{where} must be {{"type": "function", "function": {{"name", "description", '
                             f'"parameters"}}}}, got {tool!r:.200}')
        function = tool["function"]
        unknown = sorted(set(function) - {"name", "description", "parameters", "strict"})
        if unknown:
            raise ValueError(f"{where}.function has an unsupported field {unknown[0]!r}")
        name = function.get("name")
        if not isinstance(name, str) or not name:
            raise ValueError(f"{where}.function.name must be a non-empty string, got {name!r:.100}")
        if name in names:
            raise ValueError(f"{where}.function.name {name!r} names two tools; each name once")
        names.add(name)
        if not isinstance(function.get("description", ""), str):
            raise ValueError(f"{where}.function.description must be a string")
        if function.get("parameters") is not None:
            check_schema(function["parameters"], f"{where}.function.parameters", top=True)
    return tools


def check_schema(schema, where: str, top: bool = False) -> None:
    """The shape of a JSON Schema, as far as a mistake is common: an object, known type names, properties
    that are schemas, `required` a list of names. OpenAI asks a function's parameters to be an object's."""
    if not isinstance(schema, dict):
        raise ValueError(f"{where} must be a JSON Schema object, got {schema!r:.200}")
    kind = schema.get("type")
    kinds = kind if isinstance(kind, list) else [kind] if kind is not None else []
    if not all(k in SCHEMA_TYPES for k in kinds):
        raise ValueError(f"{where}.type must be one of {list(SCHEMA_TYPES)} (or a list of them), got {kind!r:.100}")
    if top and kind not in (None, "object"):
        raise ValueError(f'{where} must be the schema of an object ("type": "object"), got type {kind!r}')
    properties = schema.get("properties", {})
    if not isinstance(properties, dict):
        raise ValueError(f"{where}.properties must be an object of schemas, got {properties!r:.200}")
    for key, value in properties.items():
        check_schema(value, f"{where}.properties.{key}")
    required = schema.get("required", [])
    if not isinstance(required, list) or not all(isinstance(r, str) for r in required):
        raise ValueError(f"{where}.required must be a list of property names, got {required!r:.200}")


def check_tool_choice(tools: list[dict] | None, tool_choice, parser: str | None) -> ToolCalling | None:
    """The request's tool calling, as vLLM reads it: tools without tool_choice mean "auto"; "auto" needs
    the server's flags; "required" with no tools is "none"; a named function must be one of the tools.
    None: no tools at all. A ValueError names `tools` or `tool_choice`."""
    if tools is None:
        if tool_choice not in (None, "none"):
            raise ValueError("tool_choice needs tools: when using `tool_choice`, `tools` must be set")
        return None
    tools = check_tools(tools)
    if tool_choice is None:
        tool_choice = "auto" if tools else "none"
    if tool_choice == "required" and not tools:
        tool_choice = "none"                                   # OpenAI's answer, and vLLM's
    if tool_choice == "auto" and parser is None:
        raise ValueError(f"tool_choice: {AUTO_NEEDS_FLAGS}")
    if tool_choice in ("none", "auto", "required"):
        return ToolCalling(tools, tool_choice, parser=parser)
    named = (isinstance(tool_choice, dict) and tool_choice.get("type") == "function"
             and isinstance(tool_choice.get("function"), dict))
    name = tool_choice["function"].get("name") if named else None
    if not isinstance(name, str):
        raise ValueError(f'tool_choice must be "none", "auto", "required" or {{"type": "function", "function": '
                         f'{{"name": ...}}}}, got {tool_choice!r:.200}')
    if name not in {t["function"]["name"] for t in tools}:
        raise ValueError(f"tool_choice names the function {name!r:.100}, which is not one of the tools "
                         f"{sorted(t['function']['name'] for t in tools)!r:.300}")
    return ToolCalling(tools, "named", function=name)


def chat_messages(messages: list) -> list:
    """The messages as chat templates read them: an assistant's tool calls with their arguments as objects
    (OpenAI sends them as JSON text; vLLM parses them too) and its null content as "". Anything else is
    left to render_chat's checks (engine/input_processor.py)."""
    return [_with_tool_calls(m, i) if isinstance(m, dict) and m.get("tool_calls") is not None else m
            for i, m in enumerate(messages)]


def _with_tool_calls(message: dict, i: int) -> dict:
    calls, where = message["tool_calls"], f"messages[{i}].tool_calls"
    if not isinstance(calls, list) or not all(isinstance(c, dict) and isinstance(c.get("function"), dict)
                                              and isinstance(c["function"].get("name"), str) for c in calls):
        raise ValueError(f'{where} must be a list of {{"id", "type": "function", "function": {{"name", '
                         f'"arguments"}}}}, got {calls!r:.200}')
    parsed = []
    for j, call in enumerate(calls):
        arguments = call["function"].get("arguments", "{}")
        try:
            arguments = json.loads(arguments) if isinstance(arguments, str) else arguments
        except ValueError:
            raise ValueError(f"{where}[{j}].function.arguments must be JSON text, got {arguments!r:.200}") from None
        parsed.append({**call, "function": {**call["function"], "arguments": arguments}})
    return {**message, "content": message.get("content") or "", "tool_calls": parsed}


def chat_with_tools(messages: list, tools: list) -> dict:
    """A conversation with its tools, as render_chat takes it: `LLM.chat(messages, tools=...)`'s."""
    return {"messages": chat_messages(messages), "tools": check_tools(tools)}


def constraint(calling: ToolCalling | None) -> dict | None:
    """The JSON schema "required" or a named function holds the output to (structured outputs), else None."""
    if calling is None or calling.choice not in ("required", "named"):
        return None
    parameters = {t["function"]["name"]: t["function"].get("parameters") or NO_PARAMETERS for t in calling.tools}
    if calling.choice == "named":
        return parameters[calling.function]
    return {"type": "array", "minItems": 1,
            "items": {"anyOf": [{"type": "object", "required": ["name", "parameters"],
                                 "properties": {"name": {"type": "string", "enum": [name]}, "parameters": schema}}
                                for name, schema in parameters.items()]}}
