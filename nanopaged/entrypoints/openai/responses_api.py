"""`POST /v1/responses`: OpenAI's Responses API, as a translation of the chat route.

A Responses client sends `input` (a string, or a list of messages and items: function calls and their
outputs), `instructions`, `max_output_tokens`, sampling fields, `tools` (flat function tools) and maybe
`previous_response_id`; it reads back a response whose `output` is a list of items (reasoning, a
message of output_text, function_call), or, streamed, the events response.created, ...,
response.completed. As with /v1/messages (anthropic_api.py), the request is rewritten as a chat body
(`Turn.chat_body`) and runs through the chat route's parsing, engine and ResponseBuilder; the answer
is rewritten back (`Turn.response`, `EventWriter`). So tools, reasoning, limits and the key behave as
on the chat route.

`previous_response_id` continues a conversation the server remembers: each stored response keeps its
conversation (input and output, without its instructions, as OpenAI's), in a store bounded by count
and by bytes that forgets the least recently used first; a forgotten or unknown id is a 404. Each API
server process has its own store. vLLM: vllm/entrypoints/openai/serving_responses.py.
docs/08_server.md, "The Responses API".
"""
from __future__ import annotations

import json
import threading
import time
import uuid
from collections import OrderedDict
from dataclasses import dataclass, field

from nanopaged.entrypoints.openai.protocol import OpenAIError, only_fields, shown

# vLLM's extra fields (the openai client sends them through `extra_body`), passed on to the chat route as they are
EXTRA_FIELDS = {"top_k", "min_p", "repetition_penalty", "seed", "structured_outputs"}
FIELDS = {"model", "input", "instructions", "max_output_tokens", "temperature", "top_p", "stream", "store",
          "previous_response_id", "tools", "tool_choice", "parallel_tool_calls", "text", "metadata", "user",
          *EXTRA_FIELDS}
ROLES = {"user": "user", "assistant": "assistant", "system": "system", "developer": "system"}
TEXT_PARTS = ("input_text", "output_text")
# The chat route's names for what this route calls otherwise, for its errors
PARAMS = {"messages": "input", "max_tokens": "max_output_tokens", "response_format": "text"}


# ---- the store ---------------------------------------------------------------------------------
@dataclass
class Stored:
    response: dict               # the response body, as GET /v1/responses/{id} returns it
    conversation: list[dict]     # its chat messages, its answer included, without its instructions
    size: int = 0                # bytes of both, as JSON


class ResponseStore:
    """The responses a later `previous_response_id` may name: at most `max_entries`, and `max_bytes` of
    JSON in all; past either, the least recently used go first. One lock: handlers' threads share it."""

    def __init__(self, max_entries: int, max_bytes: int) -> None:
        self.max_entries, self.max_bytes = max_entries, max_bytes
        self.entries: OrderedDict[str, Stored] = OrderedDict()
        self.bytes = 0
        self.lock = threading.Lock()

    def put(self, response: dict, conversation: list[dict]) -> None:
        stored = Stored(response, conversation, len(json.dumps([response, conversation], ensure_ascii=False)))
        if stored.size > self.max_bytes:
            return                                     # larger than the whole store: not kept
        with self.lock:
            self.entries[response["id"]] = stored
            self.bytes += stored.size
            while len(self.entries) > self.max_entries or self.bytes > self.max_bytes:
                self.bytes -= self.entries.popitem(last=False)[1].size

    def get(self, response_id) -> Stored:
        with self.lock:
            stored = self.entries.get(response_id) if isinstance(response_id, str) else None
            if stored is not None:
                self.entries.move_to_end(response_id)
        if stored is None:
            raise OpenAIError(f"Response with id {shown(response_id)} not found (never stored, or forgotten: the "
                              f"server keeps the last {self.max_entries} responses, {self.max_bytes} bytes at most)",
                              param="previous_response_id", status=404)
        return stored


# ---- the request -----------------------------------------------------------------------------
@dataclass
class Turn:
    """One Responses request: the chat body that asks the same, and what its answer echoes and stores."""
    chat_body: dict
    conversation: list[dict]                     # the messages before this answer, without the instructions
    echo: dict = field(default_factory=dict)     # the request's settings, as the response repeats them
    store: bool = True
    id: str = field(default_factory=lambda: "resp_" + uuid.uuid4().hex)
    created_at: int = field(default_factory=lambda: int(time.time()))

    def skeleton(self, model: str, status: str) -> dict:
        return {"id": self.id, "object": "response", "created_at": self.created_at, "status": status,
                "model": model, "output": [], "error": None, "incomplete_details": None, **self.echo, "usage": None}

    def response(self, completion: dict) -> dict:
        """A chat completion (one choice) as the response; stored if asked."""
        choice, usage = completion["choices"][0], completion["usage"]
        return self.finish(completion["model"], output_items(choice["message"]), choice["finish_reason"],
                           usage["prompt_tokens"], usage["completion_tokens"])

    def finish(self, model: str, items: list[dict], finish_reason: str | None, input_tokens: int,
               output_tokens: int) -> dict:
        response = self.skeleton(model, "incomplete" if finish_reason == "length" else "completed")
        if finish_reason == "length":
            response["incomplete_details"] = {"reason": "max_output_tokens"}
        response["output"] = items
        response["usage"] = {"input_tokens": input_tokens, "input_tokens_details": {"cached_tokens": 0},
                             "output_tokens": output_tokens, "output_tokens_details": {"reasoning_tokens": 0},
                             "total_tokens": input_tokens + output_tokens}
        return response

    def remember(self, store: ResponseStore, response: dict) -> None:
        if self.store:
            store.put(response, self.conversation + answer_messages(response["output"]))


def parse(body: dict, store: ResponseStore) -> Turn:
    """The Turn of a Responses body; OpenAIError (400, or 404 for an unknown previous_response_id)."""
    only_fields(body, FIELDS)
    earlier = []
    if body.get("previous_response_id") is not None:
        earlier = store.get(body["previous_response_id"]).conversation
    conversation = earlier + input_messages(body.get("input"))
    instructions = body.get("instructions")
    if instructions is not None and not isinstance(instructions, str):
        raise OpenAIError(f"instructions must be a string, got {shown(instructions)}", param="instructions")
    chat = {"messages": ([{"role": "system", "content": instructions}] if instructions else []) + conversation,
            "stream": body.get("stream", False)}
    for ours, theirs in (("model", "model"), ("max_tokens", "max_output_tokens"), ("temperature", "temperature"),
                         ("top_p", "top_p"), ("user", "user"), *((f, f) for f in EXTRA_FIELDS)):
        if body.get(theirs) is not None:
            chat[ours] = body[theirs]
    tools = body.get("tools")
    if tools:
        chat["tools"] = [chat_tool(t, i) for i, t in enumerate(tools)] if isinstance(tools, list) else tools
    if body.get("tool_choice") is not None:
        chat["tool_choice"] = chat_tool_choice(body["tool_choice"])
    if body.get("parallel_tool_calls") is False:
        raise OpenAIError("parallel_tool_calls=false is not supported: the model may call several tools at once",
                          param="parallel_tool_calls")
    response_format = text_format(body.get("text"))
    if response_format is not None:
        chat["response_format"] = response_format
    store_it = body.get("store", True)
    if not isinstance(store_it, bool) and store_it is not None:
        raise OpenAIError(f"store must be true or false, got {shown(store_it)}", param="store")
    metadata = body.get("metadata")
    if metadata is not None and not (isinstance(metadata, dict) and all(isinstance(v, str) for v in metadata.values())):
        raise OpenAIError(f"metadata must be an object of strings, got {shown(metadata)}", param="metadata")
    echo = {"instructions": instructions, "max_output_tokens": body.get("max_output_tokens"),
            "temperature": body.get("temperature"), "top_p": body.get("top_p"), "tools": tools or [],
            "tool_choice": body.get("tool_choice") or "auto", "parallel_tool_calls": True,
            "previous_response_id": body.get("previous_response_id"), "store": store_it is not False,
            "text": body.get("text") or {"format": {"type": "text"}}, "truncation": "disabled",
            "metadata": metadata or {}, "user": body.get("user"), "reasoning": None}
    return Turn(chat, conversation, echo, store_it is not False)


def input_messages(given) -> list[dict]:
    """`input` as chat messages: a string is the user's; a list holds messages (with text, or text and
    image parts), function_call items (the assistant's tool calls) and function_call_output items."""
    if isinstance(given, str):
        return [{"role": "user", "content": given}]
    if not isinstance(given, list) or not given:
        raise OpenAIError(f"input must be a string or a non-empty list of items, got {shown(given)}", param="input")
    messages = []
    for i, item in enumerate(given):
        kind = item.get("type", "message") if isinstance(item, dict) else None
        if kind == "message" and item.get("role") in ROLES:
            messages.append({"role": ROLES[item["role"]], "content": _content(item.get("content"), i)})
        elif kind == "function_call" and all(isinstance(item.get(k), str) for k in ("call_id", "name", "arguments")):
            call = {"id": item["call_id"], "type": "function",
                    "function": {"name": item["name"], "arguments": item["arguments"]}}
            if messages and messages[-1]["role"] == "assistant" and "tool_calls" in messages[-1]:
                messages[-1]["tool_calls"].append(call)
            else:
                messages.append({"role": "assistant", "content": None, "tool_calls": [call]})
        elif kind == "function_call_output" and isinstance(item.get("call_id"), str) \
                and isinstance(item.get("output"), str):
            messages.append({"role": "tool", "tool_call_id": item["call_id"], "content": item["output"]})
        elif kind != "reasoning":          # earlier thinking is not shown to the model again (as chat templates do)
            raise OpenAIError(f"input[{i}] must be a message {{'role', 'content'}}, a function_call {{'call_id', "
                              f"'name', 'arguments'}}, a function_call_output {{'call_id', 'output'}} or a reasoning "
                              f"item; got {shown(item)}", param="input")
    return messages


def _content(content, i: int):
    """A message's content: a string, or parts (input_text / output_text, input_image with an image_url)."""
    if isinstance(content, str):
        return content
    if not isinstance(content, list) or not content:
        raise OpenAIError(f"input[{i}].content must be a string or a non-empty list of parts, got {shown(content)}",
                          param="input")
    parts = []
    for part in content:
        kind = part.get("type") if isinstance(part, dict) else None
        if kind in TEXT_PARTS and isinstance(part.get("text"), str):
            parts.append({"type": "text", "text": part["text"]})
        elif kind == "input_image" and isinstance(part.get("image_url"), str):
            parts.append({"type": "image_url", "image_url": {"url": part["image_url"]}})
        else:
            raise OpenAIError(f"input[{i}].content: a part is input_text, output_text or input_image (with an "
                              f"image_url), got {shown(part)}", param="input")
    if all(p["type"] == "text" for p in parts):
        return "".join(p["text"] for p in parts)
    return parts


def chat_tool(tool, i: int) -> dict:
    """A Responses function tool ({"type": "function", "name", "parameters", ...}) as the chat route's."""
    if not isinstance(tool, dict) or tool.get("type") != "function" or not isinstance(tool.get("name"), str):
        raise OpenAIError(f"tools[{i}] must be a function tool {{'type': 'function', 'name', 'parameters'}} (this "
                          f"server runs no built-in tools), got {shown(tool)}", param="tools")
    function = {k: tool[k] for k in ("name", "description", "parameters") if tool.get(k) is not None}
    return {"type": "function", "function": function}


def chat_tool_choice(choice):
    if choice in ("auto", "none", "required"):
        return choice
    if isinstance(choice, dict) and choice.get("type") == "function" and isinstance(choice.get("name"), str):
        return {"type": "function", "function": {"name": choice["name"]}}
    raise OpenAIError(f'tool_choice must be "auto", "none", "required" or {{"type": "function", "name": ...}}, got '
                      f"{shown(choice)}", param="tool_choice")


def text_format(text) -> dict | None:
    """`text.format` as the chat route's response_format (text, json_object, json_schema), or None."""
    if text is None:
        return None
    spec = text.get("format") if isinstance(text, dict) and set(text) <= {"format"} else None
    kind = spec.get("type") if isinstance(spec, dict) else None
    if kind == "text":
        return None
    if kind == "json_object":
        return {"type": "json_object"}
    if kind == "json_schema":
        return {"type": "json_schema", "json_schema": {k: v for k, v in spec.items() if k != "type"}}
    raise OpenAIError(f"text must be {{'format': {{'type': 'text' | 'json_object' | 'json_schema', ...}}}}, got "
                      f"{shown(text)}", param="text")


def in_responses_terms(e: OpenAIError) -> OpenAIError:
    """An error of the chat route's parsing, naming this route's field instead."""
    if e.param is not None:
        name = e.param.split(".")[0].split("[")[0]
        if name in PARAMS:
            e.param = PARAMS[name]
            e.message = e.message.replace(name, PARAMS[name], 1) if e.message.startswith(name) else e.message
    return e


# ---- the answer --------------------------------------------------------------------------------
def output_items(message: dict) -> list[dict]:
    """A chat message as output items: its reasoning, its text (a message), its tool calls."""
    items = []
    if message.get("reasoning_content"):
        items.append(reasoning_item(item_id("rs"), message["reasoning_content"]))
    if message.get("content"):
        items.append(message_item(item_id("msg"), message["content"]))
    for call in message.get("tool_calls") or []:
        items.append(call_item(item_id("fc"), call["id"], call["function"]["name"], call["function"]["arguments"]))
    return items


def item_id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


def reasoning_item(rid: str, text: str | None, status: str = "completed") -> dict:
    content = [] if text is None else [{"type": "reasoning_text", "text": text}]
    return {"type": "reasoning", "id": rid, "summary": [], "content": content, "status": status}


def text_part(text: str) -> dict:
    return {"type": "output_text", "text": text, "annotations": [], "logprobs": []}


def message_item(mid: str, text: str | None, status: str = "completed") -> dict:
    return {"type": "message", "id": mid, "role": "assistant", "status": status,
            "content": [] if text is None else [text_part(text)]}


def call_item(fid: str, call_id: str, name: str, arguments: str, status: str = "completed") -> dict:
    return {"type": "function_call", "id": fid, "call_id": call_id, "name": name, "arguments": arguments,
            "status": status}


def answer_messages(items: list[dict]) -> list[dict]:
    """The output items as the assistant's chat message, for the next turn (its reasoning left out)."""
    text = "".join(p["text"] for item in items if item["type"] == "message" for p in item["content"])
    calls = [{"id": item["call_id"], "type": "function", "function": {"name": item["name"],
                                                                       "arguments": item["arguments"]}}
             for item in items if item["type"] == "function_call"]
    return [{"role": "assistant", "content": text or None, **({"tool_calls": calls} if calls else {})}]


class EventWriter:
    """Chat chunks in (the chat route's stream of one choice), the Responses API's events out."""

    def __init__(self, turn: Turn, model: str) -> None:
        self.turn, self.model = turn, model
        self.sequence = 0
        self.items: list[dict] = []          # every item opened so far, as it stands
        self.open: str | None = None         # the open item's kind: "reasoning", "message", or a call's index
        self.finish_reason: str | None = None

    def start(self) -> list[str]:
        response = self.turn.skeleton(self.model, "in_progress")
        return [self._event("response.created", response=response),
                self._event("response.in_progress", response=response)]

    def chunk(self, chunk: dict) -> list[str]:
        out = []
        for choice in chunk["choices"]:
            delta = choice.get("delta", {})
            if delta.get("reasoning_content"):
                out += self._text("reasoning", delta["reasoning_content"])
            if delta.get("content"):
                out += self._text("message", delta["content"])
            for call in delta.get("tool_calls") or []:
                out += self._call(call)
            self.finish_reason = choice.get("finish_reason") or self.finish_reason
        return out

    def end(self, usage: dict) -> list[str]:
        out = self._close()
        response = self.turn.finish(self.model, self.items, self.finish_reason, usage["prompt_tokens"],
                                    usage["completion_tokens"])
        self.response = response
        return out + [self._event("response.completed", response=response)]

    def error(self, e: OpenAIError) -> list[str]:
        return [self._event("error", code=e.code or e.type, message=e.message, param=e.param)]

    # ---- the items --------------------------------------------------------------------------
    def _text(self, kind: str, text: str) -> list[str]:
        out = [] if self.open == kind else self._close() + self._open_text(kind)
        item, index = self.items[-1], len(self.items) - 1
        item["content"][0]["text"] += text
        name = "response.reasoning_text.delta" if kind == "reasoning" else "response.output_text.delta"
        extra = {} if kind == "reasoning" else {"logprobs": []}
        return out + [self._event(name, item_id=item["id"], output_index=index, content_index=0, delta=text, **extra)]

    def _open_text(self, kind: str) -> list[str]:
        item = reasoning_item(item_id("rs"), None, "in_progress") if kind == "reasoning" else \
            message_item(item_id("msg"), None, "in_progress")
        part = {"type": "reasoning_text", "text": ""} if kind == "reasoning" else text_part("")
        out = self._added(item, kind)
        item["content"].append(dict(part))
        return out + [self._event("response.content_part.added", item_id=item["id"], output_index=len(self.items) - 1,
                                  content_index=0, part=part)]

    def _call(self, call: dict) -> list[str]:
        function, out = call.get("function", {}), []
        if call.get("id"):                               # a new call: its own item
            out += self._close() + self._added(call_item(item_id("fc"), call["id"], function.get("name", ""), "",
                                                         "in_progress"), call.get("index", 0))
        if function.get("arguments") and self.open is not None:
            item = self.items[-1]
            item["arguments"] += function["arguments"]
            out.append(self._event("response.function_call_arguments.delta", item_id=item["id"],
                                   output_index=len(self.items) - 1, delta=function["arguments"]))
        return out

    def _added(self, item: dict, kind) -> list[str]:
        self.items.append(item)
        self.open = kind
        return [self._event("response.output_item.added", output_index=len(self.items) - 1, item=_copy(item))]

    def _close(self) -> list[str]:
        if self.open is None:
            return []
        item, index, kind = self.items[-1], len(self.items) - 1, self.open
        self.open = None
        item["status"] = "completed"
        out = []
        if kind in ("reasoning", "message"):
            part = item["content"][0]
            done = "response.reasoning_text.done" if kind == "reasoning" else "response.output_text.done"
            extra = {} if kind == "reasoning" else {"logprobs": []}
            out += [self._event(done, item_id=item["id"], output_index=index, content_index=0, text=part["text"],
                                **extra),
                    self._event("response.content_part.done", item_id=item["id"], output_index=index, content_index=0,
                                part=dict(part))]
        else:
            out.append(self._event("response.function_call_arguments.done", item_id=item["id"], output_index=index,
                                   name=item["name"], arguments=item["arguments"]))
        return out + [self._event("response.output_item.done", output_index=index, item=_copy(item))]

    def _event(self, kind: str, **payload) -> str:
        data = {"type": kind, "sequence_number": self.sequence, **payload}
        self.sequence += 1
        return f"event: {kind}\ndata: {json.dumps(data, ensure_ascii=False)}\n\n"


def _copy(item: dict) -> dict:
    return json.loads(json.dumps(item))
