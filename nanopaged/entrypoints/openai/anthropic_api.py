"""`POST /v1/messages`: Anthropic's Messages API, as a translation of the chat route.

A Claude-style client sends `system`, `messages` of content blocks (text, image, tool_use, tool_result),
`max_tokens`, `stop_sequences`, sampling fields and `tools`; it reads back a message of content
blocks with a `stop_reason`, or, streamed, Anthropic's events (message_start, content_block_start,
content_block_delta, content_block_stop, message_delta, message_stop). nanopaged has one chat
path: the request is rewritten as an OpenAI chat body (`to_chat_body`), runs through the same
parsing, engine and ResponseBuilder as `/v1/chat/completions`, and the answer is rewritten back
(`to_message`, `EventWriter`). So tools, structured outputs, limits and the key behave the same on
both routes. vLLM: vllm/entrypoints/anthropic/. docs/08_server.md, "The Anthropic Messages API".
"""
from __future__ import annotations

import json

from nanopaged.entrypoints.openai.protocol import OpenAIError, only_fields, shown
from nanopaged.multimodal.media import image_bytes_from_url, open_image

FIELDS = {"model", "messages", "system", "max_tokens", "stop_sequences", "temperature", "top_p", "top_k",
          "stream", "tools", "tool_choice", "metadata"}
STOP_REASONS = {"length": "max_tokens", "tool_calls": "tool_use"}     # else end_turn or stop_sequence
ERROR_TYPES = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
               404: "not_found_error", 408: "request_too_large", 413: "request_too_large",
               429: "rate_limit_error", 503: "overloaded_error"}


# ---- the request ------------------------------------------------------------------------------
def to_chat_body(body: dict) -> dict:
    """The OpenAI chat body that asks for the same thing; OpenAIError (400) naming the field if not."""
    only_fields(body, FIELDS)
    max_tokens = body.get("max_tokens")
    if not isinstance(max_tokens, int) or isinstance(max_tokens, bool) or max_tokens < 1:
        raise OpenAIError(f"max_tokens is required, a positive integer; got {shown(max_tokens)}", param="max_tokens")
    chat = {"messages": _system(body.get("system")) + _messages(body.get("messages")), "max_tokens": max_tokens,
            "stream": body.get("stream", False)}
    if body.get("stream") is True:
        chat["stream_options"] = {"include_usage": True}
    if "model" in body:
        chat["model"] = body["model"]
    for ours, theirs in (("temperature", "temperature"), ("top_p", "top_p"), ("top_k", "top_k")):
        if theirs in body:
            chat[ours] = body[theirs]
    if "stop_sequences" in body:
        stops = body["stop_sequences"]
        if not isinstance(stops, list) or not all(isinstance(s, str) and s for s in stops):
            raise OpenAIError(f"stop_sequences must be a list of non-empty strings, got {shown(stops)}",
                              param="stop_sequences")
        chat["stop"] = stops
    if "tools" in body:
        chat["tools"] = _tools(body["tools"])
    if "tool_choice" in body:
        chat["tool_choice"] = _tool_choice(body["tool_choice"])
    elif "tools" in body:
        chat["tool_choice"] = "auto"           # Anthropic's default when tools are given
    return chat


def _system(system) -> list[dict]:
    if system is None:
        return []
    if isinstance(system, list):
        system = _text_of(system, "system")
    if not isinstance(system, str):
        raise OpenAIError(f"system must be a string or a list of text blocks, got {shown(system)}", param="system")
    return [{"role": "system", "content": system}]


def _messages(messages) -> list[dict]:
    if not isinstance(messages, list) or not messages:
        raise OpenAIError("messages must be a non-empty list", param="messages")
    out = []
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or m.get("role") not in ("user", "assistant") or "content" not in m:
            raise OpenAIError(f"messages[{i}] must be {{'role': 'user' or 'assistant', 'content': ...}}, got "
                              f"{shown(m)}", param="messages")
        content = m["content"]
        if isinstance(content, str):
            out.append({"role": m["role"], "content": content})
        elif isinstance(content, list):
            out += _blocks(m["role"], content, i)
        else:
            raise OpenAIError(f"messages[{i}].content must be a string or a list of blocks", param="messages")
    return out


def _blocks(role: str, blocks: list, i: int) -> list[dict]:
    """A message's content blocks as OpenAI messages: text joined (with a user's images, the parts in order);
    an assistant's tool_use blocks as its tool_calls; a user's tool_result blocks as `tool` messages, before
    the user's own text."""
    texts, calls, results, parts = [], [], [], []
    for j, block in enumerate(blocks):
        kind = block.get("type") if isinstance(block, dict) else None
        if kind == "text" and isinstance(block.get("text"), str):
            texts.append(block["text"])
            parts.append({"type": "text", "text": block["text"]})
        elif kind == "image" and role == "user":
            parts.append(_image(block, f"messages[{i}].content[{j}]"))
        elif kind == "tool_use" and role == "assistant" and isinstance(block.get("name"), str):
            calls.append({"id": str(block.get("id", "")), "type": "function",
                          "function": {"name": block["name"], "arguments": json.dumps(block.get("input", {}))}})
        elif kind == "tool_result" and role == "user" and isinstance(block.get("tool_use_id"), str):
            content = block.get("content", "")
            content = _text_of(content, f"messages[{i}]") if isinstance(content, list) else content
            if not isinstance(content, str):
                raise OpenAIError(f"messages[{i}]: a tool_result's content is a string or text blocks", param="messages")
            results.append({"role": "tool", "tool_call_id": block["tool_use_id"], "content": content})
        else:
            raise OpenAIError(f"messages[{i}]: a {role} message takes text"
                              f"{', tool_use' if role == 'assistant' else ', image, tool_result'} blocks; got "
                              f"{shown(block)}", param="messages")
    text = "\n".join(texts)
    if role == "assistant":
        return [{"role": "assistant", "content": text or None, **({"tool_calls": calls} if calls else {})}]
    if len(parts) > len(texts):                  # images: the parts, in order (multimodal/chat_parts.py)
        return results + [{"role": "user", "content": parts}]
    return results + ([{"role": "user", "content": text}] if texts or not results else [])


def _image(block: dict, where: str) -> dict:
    """An image block's base64 source as an {"type": "image", "image": ...} part: its media type, base64 and header
    checked here, so that an error names this request's field; its pixels are decoded with the prompt's other
    images (multimodal/chat_parts.py)."""
    source = block.get("source")
    kind = source.get("type") if isinstance(source, dict) else None
    if kind == "url":
        raise OpenAIError(f"{where}.source: a url source is refused; this engine never fetches: send the image "
                          "as {'type': 'base64', 'media_type': 'image/png', 'data': ...}", param="messages")
    if kind != "base64" or not isinstance(source.get("media_type"), str) or not isinstance(source.get("data"), str):
        raise OpenAIError(f"{where}.source must be {{'type': 'base64', 'media_type': 'image/...', 'data': ...}}, "
                          f"got {shown(source)}", param="messages")
    try:
        data = image_bytes_from_url(f"data:{source['media_type']};base64,{source['data']}", None, f"{where}.source")
        image = open_image(data, f"{where}.source")
    except ValueError as e:
        raise OpenAIError(str(e), param="messages") from None
    return {"type": "image", "image": image}


def _text_of(blocks: list, where: str) -> str:
    if not all(isinstance(b, dict) and b.get("type") == "text" and isinstance(b.get("text"), str) for b in blocks):
        raise OpenAIError(f"{where}: only text blocks are taken here, got {shown(blocks)}", param=where.split("[")[0])
    return "\n".join(b["text"] for b in blocks)


def _tools(tools) -> list[dict]:
    if not isinstance(tools, list):
        raise OpenAIError(f"tools must be a list, got {shown(tools)}", param="tools")
    out = []
    for t in tools:
        if not isinstance(t, dict) or not isinstance(t.get("name"), str) or not isinstance(t.get("input_schema"), dict):
            raise OpenAIError(f"a tool is {{'name', 'description', 'input_schema'}}, got {shown(t)}", param="tools")
        out.append({"type": "function", "function": {"name": t["name"], "description": t.get("description", ""),
                                                     "parameters": t["input_schema"]}})
    return out


def _tool_choice(choice):
    kind = choice.get("type") if isinstance(choice, dict) else None
    if kind in ("auto", "none"):
        return kind
    if kind == "any":
        return "required"
    if kind == "tool" and isinstance(choice.get("name"), str):
        return {"type": "function", "function": {"name": choice["name"]}}
    raise OpenAIError(f"tool_choice is {{'type': 'auto' | 'any' | 'tool' | 'none'}} (with 'name' for 'tool'), got "
                      f"{shown(choice)}", param="tool_choice")


# ---- the answer -------------------------------------------------------------------------------
def stop_reason(finish_reason: str | None, stop: int | str | None) -> tuple[str | None, str | None]:
    """Anthropic's (stop_reason, stop_sequence) for a chat choice's finish_reason and vLLM's stop_reason."""
    if finish_reason is None:
        return None, None
    if finish_reason == "stop" and isinstance(stop, str):
        return "stop_sequence", stop
    return STOP_REASONS.get(finish_reason, "end_turn"), None


def message_id(response_id: str) -> str:
    return "msg_" + response_id.removeprefix("chatcmpl-")


def to_message(response: dict) -> dict:
    """An OpenAI chat completion (one choice) as Anthropic's message."""
    choice = response["choices"][0]
    message = choice["message"]
    content = [{"type": "text", "text": message["content"]}] if message.get("content") else []
    content += [_tool_use(c) for c in message.get("tool_calls", [])]
    reason, sequence = stop_reason(choice["finish_reason"], choice.get("stop_reason"))
    usage = response["usage"]
    return {"id": message_id(response["id"]), "type": "message", "role": "assistant", "model": response["model"],
            "content": content, "stop_reason": reason, "stop_sequence": sequence,
            "usage": {"input_tokens": usage["prompt_tokens"], "output_tokens": usage["completion_tokens"]}}


def _tool_use(call: dict) -> dict:
    """A tool call as a tool_use block; arguments that are no JSON object (max_tokens cut a named call's
    output) stay the text they are, as a text block: Anthropic's `input` must be an object."""
    arguments = call["function"]["arguments"] or "{}"
    try:
        given = json.loads(arguments)
    except (ValueError, RecursionError):
        given = None
    if not isinstance(given, dict):
        return {"type": "text", "text": arguments}
    return {"type": "tool_use", "id": call["id"], "name": call["function"]["name"], "input": given}


def error_body(e: OpenAIError) -> dict:
    return {"type": "error", "error": {"type": ERROR_TYPES.get(e.status, "api_error"), "message": e.message}}


class EventWriter:
    """OpenAI chat chunks in, Anthropic's stream events out (as `event: NAME\\ndata: {...}` texts)."""

    def __init__(self, model: str, response_id: str) -> None:
        self.model, self.id = model, message_id(response_id)
        self.block = None            # (index, "text" | tool call index) of the open content block
        self.blocks = 0
        self.finish = (None, None)

    def start(self, input_tokens: int) -> list[str]:
        message = {"id": self.id, "type": "message", "role": "assistant", "model": self.model, "content": [],
                   "stop_reason": None, "stop_sequence": None, "usage": {"input_tokens": input_tokens, "output_tokens": 0}}
        return [event("message_start", {"type": "message_start", "message": message}), event("ping", {"type": "ping"})]

    def chunk(self, chunk: dict, stop: int | str | None) -> list[str]:
        """One chat chunk's text and tool calls; `stop`: the output's stop_reason, once it finished."""
        out = []
        for choice in chunk["choices"]:
            delta = choice.get("delta", {})
            if delta.get("content"):
                out += self._open("text", {"type": "text", "text": ""})
                out.append(self._delta({"type": "text_delta", "text": delta["content"]}))
            for call in delta.get("tool_calls") or []:
                function = call.get("function", {})
                if call.get("id"):           # a new call: its own tool_use block
                    out += self._open(call.get("index", 0), {"type": "tool_use", "id": call["id"],
                                                             "name": function.get("name", ""), "input": {}})
                if function.get("arguments"):
                    out.append(self._delta({"type": "input_json_delta", "partial_json": function["arguments"]}))
            if choice.get("finish_reason"):
                self.finish = stop_reason(choice["finish_reason"], stop)
        return out

    def end(self, output_tokens: int) -> list[str]:
        reason, sequence = self.finish
        return self._close() + [
            event("message_delta", {"type": "message_delta", "delta": {"stop_reason": reason, "stop_sequence": sequence},
                                    "usage": {"output_tokens": output_tokens}}),
            event("message_stop", {"type": "message_stop"})]

    def _open(self, key, block: dict) -> list[str]:
        if self.block is not None and self.block[1] == key:
            return []
        out = self._close()
        self.block = (self.blocks, key)
        self.blocks += 1
        return out + [event("content_block_start", {"type": "content_block_start", "index": self.block[0],
                                                    "content_block": block})]

    def _delta(self, delta: dict) -> str:
        return event("content_block_delta", {"type": "content_block_delta", "index": self.block[0], "delta": delta})

    def _close(self) -> list[str]:
        if self.block is None:
            return []
        index, self.block = self.block[0], None
        return [event("content_block_stop", {"type": "content_block_stop", "index": index})]


def event(name: str, payload: dict) -> str:
    return f"event: {name}\ndata: {json.dumps(payload, ensure_ascii=False)}\n\n"
