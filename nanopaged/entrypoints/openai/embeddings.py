"""POST /v1/embeddings: OpenAI's embeddings API on a `--runner pooling` server (vLLM's route and answers).

A body's `input` (a string, strings, token ids, lists of token ids) becomes one pooling request per
prompt, with PoolingParams; they go through the engine loop as completions do (engine_loop.py), and
the answer is OpenAI's list of embeddings, each a list of floats or, with `encoding_format: "base64"`,
the base64 of its little-endian float32 bytes. `dimensions` is honoured for a Matryoshka model and
refused by name for any other, as vLLM does. In the default layout the engine core sends each vector
with its request's last delta (core_messages.py: RequestDelta.embedding).
The pooling itself: nanopaged/pooling/, docs/08_server.md "Embeddings".
"""
from __future__ import annotations

import asyncio
import base64
import struct
import time
import uuid

from fastapi import FastAPI, Request

from nanopaged.entrypoints.openai.limits import BodyLimits, read_body
from nanopaged.entrypoints.openai.pooling_requests import finished, pooling_config
from nanopaged.entrypoints.openai.protocol import (OpenAIError, ParsedRequest, only_fields, parse_body,
                                                   prompt_forms, requested_model, shown)
from nanopaged.pooling.config import check_task
from nanopaged.pooling_params import PoolingParams

EMBEDDING_FIELDS = {"input", "model", "encoding_format", "dimensions", "user"}
ENCODING_FORMATS = ("float", "base64")


def register_embeddings(app: FastAPI, engine_loop, models, body_limits: BodyLimits) -> None:
    """Add the route to the app (app.py: build_app); `engine_loop` is the in-process EngineLoop, or the
    default layout's CoreClient (openai/core_client.py)."""

    @app.post("/v1/embeddings")
    async def embeddings(request: Request) -> dict:
        body = await asyncio.to_thread(parse_body, await read_body(request, body_limits))
        config = pooling_config(engine_loop, "/v1/embeddings")
        parsed, encoding = parse_embedding_request(body, models, config)
        response_id = "embd-" + uuid.uuid4().hex
        outputs = await finished(engine_loop, parsed, response_id, "input")   # the engine loop's prompt: input
        return embedding_response(outputs, encoding, response_id, body.get("model") or models.name)


def parse_embedding_request(body: dict, models, config) -> tuple[ParsedRequest, str]:
    """(the requests' prompts and PoolingParams, the encoding format); OpenAIError naming the field."""
    only_fields(body, EMBEDDING_FIELDS)
    try:
        check_task("embed", config.model_config)          # a classifier embeds nothing (vLLM refuses it too)
    except ValueError as e:
        raise OpenAIError(str(e), param="model") from None
    lora_request = requested_model(body.get("model"), models.name, models.adapters)
    prompts = prompt_forms(body.get("input"), "input", non_empty_text=True)
    encoding = body.get("encoding_format") or "float"
    if encoding not in ENCODING_FORMATS:
        raise OpenAIError(f"encoding_format must be one of {list(ENCODING_FORMATS)}, got {shown(encoding)}",
                          param="encoding_format")
    if body.get("user") is not None and not isinstance(body["user"], str):
        raise OpenAIError(f"user must be a string, got {shown(body['user'])}", param="user")
    try:
        params = PoolingParams(dimensions=body.get("dimensions"), task="embed")
        params.verify(config.model_config.hidden_size, config.pooler_config.matryoshka_dimensions)
    except ValueError as e:
        raise OpenAIError(str(e), param="dimensions") from None
    return ParsedRequest(kind="embedding", prompts=prompts, params=params, max_tokens_given=False, stream=False,
                         include_usage=False, top_logprobs=None, lora_request=lora_request), encoding


def embedding_response(outputs: list, encoding: str, response_id: str, model: str) -> dict:
    """OpenAI's answer: {"object": "list", "data": [{"object": "embedding", "index", "embedding"}], ...}."""
    if any(getattr(o, "pooled", None) is None for o in outputs):
        raise OpenAIError("a request ended without its embedding (aborted)", status=500, type="internal_server_error")
    num_tokens = sum(len(o.prompt_token_ids) for o in outputs)
    return {"id": response_id, "object": "list", "created": int(time.time()), "model": model,
            "data": [{"object": "embedding", "index": i, "embedding": encode(o.pooled.tolist(), encoding)}
                     for i, o in enumerate(outputs)],
            "usage": {"prompt_tokens": num_tokens, "total_tokens": num_tokens}}


def encode(vector: list[float], encoding: str) -> list[float] | str:
    """"float": the list itself; "base64": its little-endian float32 bytes, as OpenAI sends them."""
    if encoding == "float":
        return vector
    return base64.b64encode(struct.pack(f"<{len(vector)}f", *vector)).decode("ascii")
