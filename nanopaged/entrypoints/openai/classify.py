"""POST /classify and POST /pooling on a `--runner pooling` server (vLLM's routes, requests and answers).

    /classify   a classifier's class probabilities per input: {"data": [{"index", "label", "probs",
                "num_classes"}]}, the label id2label's name of the likeliest class (config.json)
    /pooling    any task the model runs, by `task` (vLLM's default: the token task, token_embed for an
                embedding model, token_classify for a classifier): {"data": [{"index", "object": "pooling",
                "data"}]}, a token task's data one list per prompt token; floats, or base64 (float32,
                little-endian, flat) with encoding_format "base64"

`input` takes OpenAI's four prompt forms, as /v1/embeddings. The tasks: nanopaged/pooling/.
"""
from __future__ import annotations

import asyncio
import time
import uuid

from fastapi import FastAPI, Request

from nanopaged.entrypoints.openai.embeddings import ENCODING_FORMATS, encode
from nanopaged.entrypoints.openai.limits import BodyLimits, read_body
from nanopaged.entrypoints.openai.pooling_requests import check_user, pool, pooling_config, task_params, usage
from nanopaged.entrypoints.openai.protocol import (OpenAIError, only_fields, parse_body, prompt_forms,
                                                   requested_model, shown)
from nanopaged.pooling.config import model_tasks
from nanopaged.pooling_params import TASK_PARAMETERS, TOKEN_TASKS

CLASSIFY_FIELDS = {"input", "model", "user", "truncate_prompt_tokens", "use_activation"}
POOLING_FIELDS = {"input", "model", "user", "truncate_prompt_tokens", "task", "encoding_format", "dimensions",
                  "normalize", "use_activation"}


def register_classify(app: FastAPI, engine_loop, models, body_limits: BodyLimits) -> None:
    """Add /classify and /pooling to the app (app.py: build_app); `engine_loop` as for /v1/embeddings."""

    @app.post("/classify")
    async def classify_route(request: Request) -> dict:
        body = await asyncio.to_thread(parse_body, await read_body(request, body_limits))
        config = pooling_config(engine_loop, "/classify")
        only_fields(body, CLASSIFY_FIELDS)
        lora_request = requested_model(body.get("model"), models.name, models.adapters)
        check_user(body)
        params = task_params(config, "classify", body, "model", use_activation=body.get("use_activation"))
        outputs = await pool(engine_loop, prompt_forms(body.get("input"), "input", non_empty_text=True), params,
                             lora_request, "input")
        labels = config.model_config.id2label
        data = [{"index": i, "label": labels.get(max(range(len(probs)), key=probs.__getitem__)), "probs": probs,
                 "num_classes": len(probs)} for i, probs in enumerate(o.pooled.tolist() for o in outputs)]
        return {"id": "classify-" + uuid.uuid4().hex, "object": "list", "created": int(time.time()),
                "model": body.get("model") or models.name, "data": data, "usage": usage(outputs)}

    @app.post("/pooling")
    async def pooling_route(request: Request) -> dict:
        body = await asyncio.to_thread(parse_body, await read_body(request, body_limits))
        config = pooling_config(engine_loop, "/pooling")
        only_fields(body, POOLING_FIELDS)
        lora_request = requested_model(body.get("model"), models.name, models.adapters)
        check_user(body)
        tasks = model_tasks(config.model_config)
        task = body.get("task") or next(t for t in tasks if t in TOKEN_TASKS)
        if task not in TASK_PARAMETERS:
            raise OpenAIError(f"task must be one of {list(TASK_PARAMETERS)}, got {shown(task)}", param="task")
        encoding = body.get("encoding_format") or "float"
        if encoding not in ENCODING_FORMATS:
            raise OpenAIError(f"encoding_format must be one of {list(ENCODING_FORMATS)}, got {shown(encoding)}",
                              param="encoding_format")
        given = {name: body.get(name) for name in TASK_PARAMETERS[task]}
        others = [name for name in ("dimensions", "normalize", "use_activation")
                  if body.get(name) is not None and name not in given]
        if others:
            raise OpenAIError(f"task={task!r} takes {list(TASK_PARAMETERS[task])} only, not {others}",
                              param=others[0])
        params = task_params(config, task, body, **given)
        try:
            params.verify(config.model_config.hidden_size, config.pooler_config.matryoshka_dimensions)
        except ValueError as e:
            raise OpenAIError(str(e), param="dimensions") from None
        outputs = await pool(engine_loop, prompt_forms(body.get("input"), "input", non_empty_text=True), params,
                             lora_request, "input")
        data = [{"index": i, "object": "pooling", "data": pooled_data(o, task in TOKEN_TASKS, encoding)}
                for i, o in enumerate(outputs)]
        return {"id": "pool-" + uuid.uuid4().hex, "object": "list", "created": int(time.time()),
                "model": body.get("model") or models.name, "data": data, "usage": usage(outputs)}


def pooled_data(output, per_token: bool, encoding: str) -> list | str:
    """A task's vector, or a token task's rows (one per prompt token); base64: the flat float32 bytes."""
    flat = output.pooled.tolist()
    if encoding == "base64" or not per_token:
        return encode(flat, encoding)
    return output.pooled.view(len(output.prompt_token_ids), -1).tolist()
