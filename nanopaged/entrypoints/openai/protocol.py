"""The OpenAI request bodies the server accepts, parsed into prompts and SamplingParams.

A request is checked here, in the HTTP handler, before the engine sees it: every field
must be one the server honours (an unknown or unsupported field is a 400 that names it,
never silently ignored), of the right JSON type; SamplingParams then checks each range
with the engine's one range check. What needs the tokenizer (a prompt too long for the
context, a chat message without a role) is checked by the engine loop's input threads
(engine_loop.py) and comes back as the same error. An error names the value it refuses but
never echoes more than a few hundred characters of it. vLLM: vllm/entrypoints/openai/protocol.py.
"""
from __future__ import annotations

import json
import re
from collections.abc import Mapping
from dataclasses import dataclass
from nanopaged.engine.chat_tools import chat_messages
from nanopaged.entrypoints.openai.tools import ToolCalling, check_tool_choice, constraint
from nanopaged.lora.request import LoRARequest
from nanopaged.sampling_params import SamplingParams
from nanopaged.structured_output.params import StructuredOutputsParams
from nanopaged.validation import INT_RANGE, encodes_as_utf8

# ---- the fields -----------------------------------------------------------------------------
# OpenAI's sampling fields, and vLLM's extra ones, with their SamplingParams names.
SAMPLING_FIELDS = {"n": "n", "temperature": "temperature", "top_p": "top_p", "stop": "stop",
                   "seed": "seed", "presence_penalty": "presence_penalty",
                   "frequency_penalty": "frequency_penalty",
                   # vLLM's extra fields (the openai client sends them through `extra_body`)
                   "top_k": "top_k", "min_p": "min_p", "min_tokens": "min_tokens",
                   "repetition_penalty": "repetition_penalty", "ignore_eos": "ignore_eos",
                   "stop_token_ids": "stop_token_ids",
                   "include_stop_str_in_output": "include_stop_str_in_output",
                   "skip_special_tokens": "skip_special_tokens"}
# `user` is OpenAI's end-user tag for abuse monitoring: it changes no output, so it is accepted.
# A constraint on the output: OpenAI's `response_format`, or vLLM's extra field `structured_outputs`.
# vLLM's `return_token_ids`: each choice carries its token ids (and the prompt's), for clients that
# need the tokens, not only the text (a Ray Data processor's rows: nanopaged/extras/ray_data/).
COMMON_FIELDS = {"model", "stream", "stream_options", "user", "max_tokens", "logprobs", "response_format",
                 "structured_outputs", "return_token_ids", *SAMPLING_FIELDS}
COMPLETION_FIELDS = COMMON_FIELDS | {"prompt"}
CHAT_FIELDS = COMMON_FIELDS | {"messages", "max_completion_tokens", "top_logprobs", "tools", "tool_choice"}
STREAM_OPTIONS = {"include_usage"}
RESPONSE_FORMATS = ("text", "json_object", "json_schema")
JSON_SCHEMA_FIELDS = {"name", "description", "schema", "strict"}     # OpenAI's response_format.json_schema
# vLLM's StructuredOutputsParams fields, as the extra field `structured_outputs` takes them
STRUCTURED_OUTPUTS_FIELDS = {"json", "regex", "choice", "grammar", "json_object", "disable_any_whitespace",
                             "disable_additional_properties", "whitespace_pattern", "structural_tag"}
# OpenAI's defaults: a completion stops after 16 tokens; a chat answer may fill the context.
DEFAULT_MAX_TOKENS = {"completion": 16, "chat": None}
# OpenAI's deepest body (a chat message's content parts) nests 6 levels; a deeper one is an attack,
# or a mistake that would only fail later, deep in some recursive code.
MAX_JSON_DEPTH = 32
# An error names the value it refuses; echoing a 1 MB data URL back would make every refusal
# a megabyte (and every log line that quotes it).
MAX_ERROR_CHARS = 500


class OpenAIError(Exception):
    """An error the client caused (or, with status 500, one it did not), as OpenAI's body.
    The message and the param are cut to a few hundred characters, whatever produced them."""

    def __init__(self, message: str, param: str | None = None, status: int = 400,
                 type: str = "invalid_request_error", code: str | int | None = None,
                 headers: dict[str, str] | None = None) -> None:
        message = cut(message)
        super().__init__(message)
        self.message, self.status, self.type, self.code = message, status, type, code
        self.param = None if param is None else cut(param, 100)
        self.headers = headers                 # e.g. Connection: close, when the body was left unread

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


def cut(text: str, limit: int = MAX_ERROR_CHARS) -> str:
    """`text` if it is short, else its start and its end with its length said; always writable as UTF-8."""
    text = text.encode("utf-8", "backslashreplace").decode("utf-8")
    if len(text) <= limit:
        return text
    return f"{text[:limit * 3 // 4]} ... {text[-(limit // 8):]} [cut: {len(text)} characters]"


def shown(value) -> str:
    """A JSON value as an error message quotes it: at most about 200 characters of it."""
    return cut(json.dumps(value, ensure_ascii=False), 200)


@dataclass
class ParsedRequest:
    """One OpenAI request, ready for the engine loop."""
    kind: str                        # "completion" | "chat"
    prompts: list                    # completion: engine prompts; chat: one conversation
    params: SamplingParams
    max_tokens_given: bool           # an explicit max_tokens past the context is refused, as vLLM does
    stream: bool
    include_usage: bool              # stream_options.include_usage: a last chunk with the usage
    top_logprobs: int | None         # alternatives shown per token; None: no logprobs
    constraint_field: str | None = None   # "response_format", "structured_outputs" or "tools": what compile errors name
    lora_request: LoRARequest | None = None   # the LoRA adapter `model` named; None: the base model
    tool_calling: ToolCalling | None = None   # chat with tools: how to read the output (tools.py)
    return_token_ids: bool = False   # vLLM's extra field: token ids beside the text


# ---- parsing --------------------------------------------------------------------------------
def parse_body(raw: bytes) -> dict:
    """The JSON object of a request body, or a 400 that says what is wrong with it."""
    try:
        body = json.loads(raw)
    except RecursionError:             # the C parser recurses once per level: ~1,000 levels stop it
        raise OpenAIError(f"the request body nests too deep; at most {MAX_JSON_DEPTH} levels "
                          "are allowed") from None
    except (ValueError, UnicodeDecodeError) as e:
        raise OpenAIError(f"the request body is not valid JSON: {e}") from e
    if not isinstance(body, dict):
        raise OpenAIError(f"the request body must be a JSON object, got {type(body).__name__}")
    if _nests_deeper_than(body, MAX_JSON_DEPTH):
        raise OpenAIError(f"the request body nests more than {MAX_JSON_DEPTH} levels deep; at most "
                          f"{MAX_JSON_DEPTH} are allowed")
    _check_values(body)
    return body


def _check_values(body: dict | list, root: str = "") -> None:
    """A 400 naming the first key or string with half a UTF-16 pair, which JSON's escapes allow and
    UTF-8 cannot write (every answer quoting it, and the socket to the engine core, would fail), or the
    first integer outside INT_RANGE (MessagePack, on the socket, carries none; nor does torch's int64),
    wherever it is: a sampling field, a JSON schema's bound, a logit bias."""
    stack = [(body, root)]
    while stack:
        value, path = stack.pop()
        items = value.items() if isinstance(value, dict) else enumerate(value)
        for key, child in items:
            here = f"{path}.{key}" if isinstance(key, str) else f"{path}[{key}]"
            if isinstance(key, str) and not encodes_as_utf8(key):
                _refuse_surrogate(path.lstrip(".") or "body")
            if isinstance(child, str) and not encodes_as_utf8(child):
                _refuse_surrogate(here.lstrip("."))
            if _is_int(child) and not INT_RANGE[0] <= child <= INT_RANGE[1]:
                raise OpenAIError(f"{here.lstrip('.')} is {cut(str(child), 60)}, outside the integers the server "
                                  f"carries: at most {INT_RANGE[1]} (2**64 - 1), at least {INT_RANGE[0]} (-2**63)",
                                  param=here.lstrip("."))
            if isinstance(child, (dict, list)):
                stack.append((child, here))


def _refuse_surrogate(where: str) -> None:
    raise OpenAIError(f"{where} holds a lone UTF-16 surrogate (an escape like \\ud800 without its pair): "
                      "not a character; send the pair, or the character itself", param=where)


def _nests_deeper_than(value, limit: int) -> bool:
    """Whether lists and objects nest more than `limit` levels; a loop, not a recursion."""
    stack = [(value, 1)]
    while stack:
        value, depth = stack.pop()
        if depth > limit:
            return True
        children = value.values() if isinstance(value, dict) else value
        stack.extend((c, depth + 1) for c in children if isinstance(c, (dict, list)))
    return False


def parse_request(body: dict, kind: str, served_model_name: str,
                  adapters: Mapping[str, LoRARequest] | None = None, tool_parser: str | None = None) -> ParsedRequest:
    """A completion or chat body as prompts and SamplingParams; OpenAIError (400) if it is wrong.
    `adapters`: the LoRA adapters a server started with --enable-lora serves, by name (served_models.py);
    `tool_parser`: the parser of tool_choice "auto" (--enable-auto-tool-choice --tool-call-parser), or None."""
    only_fields(body, COMPLETION_FIELDS if kind == "completion" else CHAT_FIELDS)
    lora_request = requested_model(body.get("model"), served_model_name, adapters)
    fields = {k: v for k, v in body.items() if v is not None}   # JSON null means "the default"
    stream = _bool(fields, "stream", False)
    include_usage = _stream_options(fields, stream)
    tool_calling = None
    if kind == "completion":
        prompts = prompt_forms(body.get("prompt"), "prompt")
        max_tokens_field = "max_tokens"
        top_logprobs = _int(fields, "logprobs")
    else:
        tool_calling = _tool_calling(fields, tool_parser)
        prompts = [_conversation(body.get("messages"), tool_calling)]
        max_tokens_field = "max_completion_tokens" if "max_completion_tokens" in fields else "max_tokens"
        top_logprobs = _chat_logprobs(fields)
    max_tokens_given = max_tokens_field in fields
    max_tokens = fields.get(max_tokens_field, DEFAULT_MAX_TOKENS[kind])
    kwargs = {name: fields[field] for field, name in SAMPLING_FIELDS.items() if field in fields}
    constraint_field, kwargs["structured_outputs"] = _constraint(fields)
    if constraint(tool_calling) is not None:
        constraint_field, kwargs["structured_outputs"] = _tool_constraint(tool_calling, kwargs["structured_outputs"])
    try:
        params = SamplingParams(**kwargs, max_tokens=max_tokens, logprobs=top_logprobs)
    except ValueError as e:
        raise OpenAIError(str(e), param=field_named(str(e), max_tokens_field, constraint_field)) from e
    return ParsedRequest(kind, prompts, params, max_tokens_given, stream, include_usage, top_logprobs,
                         constraint_field, lora_request, tool_calling, _bool(fields, "return_token_ids", False))


def requested_model(model, served_model_name: str, adapters: Mapping[str, LoRARequest] | None) -> LoRARequest | None:
    """The LoRA adapter `model` names, or None for the base model (its served name, or no `model`
    at all, as vLLM). Another name is a 404, as in vLLM."""
    if model is None or model == served_model_name:
        return None
    if not isinstance(model, str):
        raise OpenAIError(f"model must be a string, got {shown(model)}", param="model")
    if model not in (adapters or {}):
        raise OpenAIError(f"The model `{model}` does not exist.", param="model", status=404,
                          type="NotFoundError", code=404)
    return adapters[model]


def only_fields(body: dict, allowed) -> None:
    """A 400 naming the first field of `body` this route does not honour, before anything else is read."""
    unknown = sorted(set(body) - set(allowed))
    if unknown:
        raise OpenAIError(f"unsupported field {shown(unknown[0])}: this route honours only {sorted(allowed)}",
                          param=unknown[0])


def parse_lora_update(body: dict, route: str) -> tuple[str, str | None]:
    """(lora_name, lora_path) of a body for /v1/load_lora_adapter (both needed, as vLLM) or
    /v1/unload_lora_adapter (lora_name only: lora_path None)."""
    allowed = ("lora_name", "lora_path") if route == "load" else ("lora_name",)
    only_fields(body, allowed)
    for name in allowed:
        if not isinstance(body.get(name), str) or not body[name]:
            raise OpenAIError(f"{' and '.join(repr(a) for a in allowed)} must be given, as non-empty strings; "
                              f"{name} is {shown(body.get(name))}", param=name)
    return body["lora_name"], body.get("lora_path")


def field_named(message: str, max_tokens_field: str = "max_tokens",
                constraint_field: str | None = "structured_outputs") -> str | None:
    """The request field an engine error is about (its messages start with the field's name)."""
    if message.startswith(("LoRA adapter", "lora_request", "lora_int_id")):   # the adapter `model` named
        return "model"
    part = re.match(r"messages\[\d+\]\.content\[\d+\](\.\w+)?", message)   # an image or a content part
    if part:
        return part.group()
    first = re.match(r"[a-z_]*", message).group()
    if first == "max_tokens":
        return max_tokens_field
    if first == "logprobs":
        return "logprobs"
    if first == "structured_outputs":
        return constraint_field
    return next((f for f, name in SAMPLING_FIELDS.items() if name == first), None)


def in_request_terms(message: str, constraint_field: str | None) -> str:
    """An engine error about the schema, in the words of the request that gave it through response_format."""
    if constraint_field == "response_format":
        return message.replace("structured_outputs.json ", "response_format.json_schema.schema ", 1)
    if constraint_field == "tools":
        return message.replace("structured_outputs.json ", "the tools' parameters schema (tool_choice) ", 1)
    return message


def _constraint(fields: dict):
    """(the field that gave it, StructuredOutputsParams) for `response_format` or `structured_outputs`,
    or (None, None). Only the shape is checked here; whether it compiles, on the input threads."""
    if "response_format" in fields and "structured_outputs" in fields:
        raise OpenAIError("give response_format or structured_outputs, not both", param="structured_outputs")
    if "response_format" in fields:
        return "response_format", _response_format(fields["response_format"])
    if "structured_outputs" not in fields:
        return None, None
    given = fields["structured_outputs"]
    if not isinstance(given, dict):
        raise OpenAIError(f"structured_outputs must be an object, got {shown(given)}", param="structured_outputs")
    unknown = sorted(set(given) - STRUCTURED_OUTPUTS_FIELDS)
    if unknown:
        raise OpenAIError(f"unsupported field {shown('structured_outputs.' + unknown[0])}; supported: "
                          f"{sorted(STRUCTURED_OUTPUTS_FIELDS)}", param="structured_outputs")
    return "structured_outputs", _structured_outputs({k: v for k, v in given.items() if v is not None},
                                                     "structured_outputs")


def _tool_calling(fields: dict, tool_parser: str | None) -> ToolCalling | None:
    try:
        return check_tool_choice(fields.get("tools"), fields.get("tool_choice"), tool_parser)
    except ValueError as e:
        raise OpenAIError(str(e), param="tool_choice" if str(e).startswith("tool_choice") else "tools") from None


def _tool_constraint(calling: ToolCalling, given):
    """("tools", the constraint) of tool_choice "required" or a named function: the tools' schemas, in
    compact JSON (a program reads the arguments; and no run of whitespace can fill max_tokens)."""
    if given is not None:
        raise OpenAIError(f"tool_choice {calling.choice!r} constrains the output itself: give it or "
                          "response_format / structured_outputs, not both", param="tool_choice")
    return "tools", _structured_outputs({"json": constraint(calling), "disable_any_whitespace": True}, "tools")


def _response_format(value):
    """OpenAI's response_format: {"type": "text"} (no constraint), {"type": "json_object"}, or
    {"type": "json_schema", "json_schema": {"name", "schema", "strict", "description"}}."""
    if not isinstance(value, dict) or value.get("type") not in RESPONSE_FORMATS:
        raise OpenAIError(f"response_format must be an object whose type is one of {list(RESPONSE_FORMATS)}, "
                          f"got {shown(value)}", param="response_format")
    if value["type"] == "text":
        return None
    if value["type"] == "json_object":
        return _structured_outputs({"json_object": True}, "response_format")
    spec = value.get("json_schema")
    if not isinstance(spec, dict) or not isinstance(spec.get("schema"), dict):
        raise OpenAIError("response_format.json_schema must be an object with a 'schema' (a JSON schema object), "
                          f"got {shown(spec)}", param="response_format")
    unknown = sorted(set(spec) - JSON_SCHEMA_FIELDS)
    if unknown:
        raise OpenAIError(f"unsupported field {shown('response_format.json_schema.' + unknown[0])}; supported: "
                          f"{sorted(JSON_SCHEMA_FIELDS)}", param="response_format")
    if spec.get("strict") is not None and not isinstance(spec["strict"], bool):
        raise OpenAIError(f"response_format.json_schema.strict must be true or false, got {shown(spec['strict'])}",
                          param="response_format")
    return _structured_outputs({"json": spec["schema"]}, "response_format")   # strict or not: always followed


def _structured_outputs(kwargs: dict, field: str):
    try:
        return StructuredOutputsParams(**kwargs)
    except ValueError as e:
        raise OpenAIError(str(e), param=field) from None


def prompt_forms(value, field: str, non_empty_text: bool = False) -> list:
    """OpenAI's four prompt forms (a string, strings, token ids, lists of token ids) as prompts; `field`
    names it in the 400 (completions' `prompt`, embeddings' `input`, which takes no empty text)."""
    def text(v) -> bool:
        return isinstance(v, str) and (bool(v) or not non_empty_text)
    if text(value):
        return [value]
    if isinstance(value, list) and value:
        if all(text(v) for v in value):
            return list(value)
        if all(_is_int(t) for t in value):
            return [{"prompt_token_ids": list(value)}]
        if all(isinstance(v, list) and v and all(_is_int(t) for t in v) for v in value):
            return [{"prompt_token_ids": list(v)} for v in value]
    if value is None:
        raise OpenAIError(f"the field {field!r} is required", param=field)
    some = "non-empty " if non_empty_text else ""
    raise OpenAIError(f"{field} must be a {some}string, a non-empty list of {some}strings, a non-empty list of "
                      f"token ids or a list of such lists, got {shown(value)}", param=field)


def _conversation(messages, tool_calling: ToolCalling | None) -> list | dict:
    """The messages, with the tools for the template if there are any (input_processor.py: render_chat)."""
    if messages is None:
        raise OpenAIError("the field 'messages' is required", param="messages")
    if not isinstance(messages, list) or not messages:
        raise OpenAIError(f"messages must be a non-empty list of messages, got {shown(messages)}",
                          param="messages")
    try:
        messages = chat_messages(messages)          # an assistant's tool calls, as templates read them
    except RecursionError:                          # arguments' JSON text nesting past the parser's stack
        raise OpenAIError(f"a tool call's arguments nest too deep; at most {MAX_JSON_DEPTH} levels are allowed",
                          param="messages") from None
    except ValueError as e:
        raise OpenAIError(str(e), param="messages") from None
    # The arguments were JSON text inside a string: their values are checked as the body's are
    if _nests_deeper_than(messages, MAX_JSON_DEPTH):
        raise OpenAIError(f"a tool call's arguments nest too deep; at most {MAX_JSON_DEPTH} levels are allowed",
                          param="messages")
    _check_values(messages, "messages")
    if tool_calling is not None and tool_calling.tools:
        return {"messages": messages, "tools": tool_calling.tools}
    return messages            # each message is checked with the chat template (engine thread)


def _chat_logprobs(fields: dict) -> int | None:
    """Chat asks with `logprobs: true` and `top_logprobs: k` (0..20); top_logprobs needs logprobs."""
    wanted = _bool(fields, "logprobs", False)
    k = _int(fields, "top_logprobs")
    if k is not None and not wanted:
        raise OpenAIError("top_logprobs needs logprobs set to true", param="top_logprobs")
    if wanted and k is not None and not 0 <= k <= 20:
        raise OpenAIError(f"top_logprobs must be in [0, 20], got {k}", param="top_logprobs")
    return (k or 0) if wanted else None


def _stream_options(fields: dict, stream: bool) -> bool:
    options = fields.get("stream_options")
    if options is None:
        return False
    if not stream:
        raise OpenAIError("stream_options is only allowed when stream is true", param="stream_options")
    if not isinstance(options, dict):
        raise OpenAIError(f"stream_options must be an object, got {shown(options)}",
                          param="stream_options")
    unknown = sorted(set(options) - STREAM_OPTIONS)
    if unknown:
        raise OpenAIError(f"unsupported field {shown('stream_options.' + unknown[0])}; supported: "
                          f"{sorted(STREAM_OPTIONS)}", param=f"stream_options.{unknown[0]}")
    return _bool(options, "include_usage", False, prefix="stream_options.")


def _bool(fields: dict, name: str, default: bool, prefix: str = "") -> bool:
    value = fields.get(name, default)
    if value is None:
        return default
    if not isinstance(value, bool):
        raise OpenAIError(f"{prefix}{name} must be true or false, got {shown(value)}", param=prefix + name)
    return value


def _int(fields: dict, name: str) -> int | None:
    value = fields.get(name)
    if value is not None and not _is_int(value):
        raise OpenAIError(f"{name} must be an integer, got {shown(value)}", param=name)
    return value


def _is_int(x) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)
