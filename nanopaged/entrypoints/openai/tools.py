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

from dataclasses import dataclass

from nanopaged.engine.chat_tools import check_tools
from nanopaged.entrypoints.openai.tool_parsers import (TOOL_PARSERS, NamedToolCall, RequiredToolCalls,
                                                       ToolCallStream, extract_tool_calls)

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
