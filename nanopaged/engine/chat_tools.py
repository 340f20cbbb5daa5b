"""A conversation's tools, as chat templates read them: checked, and an assistant's calls as objects.

`LLM.chat(messages, tools=...)` and the server's chat route (entrypoints/openai/tools.py) both render
tools through the model's chat template (input_processor.py: render_chat, which takes
{"messages", "tools"}); this is the part they share, with no server in it. OpenAI's function tools
are checked (a ValueError naming the first thing wrong), and an assistant message's `tool_calls`
have their arguments turned from JSON text into objects, as templates expect (vLLM does the same).
docs/08_server.md, "Tool calling".
"""
from __future__ import annotations

import json

# JSON Schema's type names: a property's "type" must be one of them (or a list of them).
SCHEMA_TYPES = ("object", "array", "string", "number", "integer", "boolean", "null")


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
