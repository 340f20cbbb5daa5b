"""What vLLM's pooling routes share (/classify and /pooling: classify.py; /score and /rerank: score.py):
the runner's check, the common fields, and one submission of pooling requests through the engine loop
(in-process, or the default layout's CoreClient, where each vector crosses the socket with its
request's last delta, flat: pooling/processors.py). The task itself: nanopaged/pooling/.
"""
from __future__ import annotations

import asyncio
import uuid

from nanopaged.entrypoints.openai.engine_loop import EngineLoop, Submission
from nanopaged.entrypoints.openai.protocol import OpenAIError, ParsedRequest, shown
from nanopaged.pooling.config import check_task
from nanopaged.pooling_params import PoolingParams


def pooling_config(engine_loop, route: str):
    """The engine's config; a 400 naming the runner where the server does not pool."""
    config = engine_loop.engine.config if isinstance(engine_loop, EngineLoop) else engine_loop.config
    if config.runner != "pooling":
        raise OpenAIError(f"this server runs runner={config.runner!r}: {route} needs a model served with "
                          "--runner pooling (vLLM: the model does not support this API)")
    return config


def task_params(config, task: str, body: dict, field: str = "task", **given) -> PoolingParams:
    """PoolingParams for `task` with the body's truncate_prompt_tokens and `given`; a 400 naming the field
    (the task's, where this model does not run it: pooling/config.py)."""
    try:
        check_task(task, config.model_config)
    except ValueError as e:
        raise OpenAIError(str(e), param=field) from None
    fields = {"truncate_prompt_tokens": body.get("truncate_prompt_tokens"), **given}
    try:
        return PoolingParams(**{k: v for k, v in fields.items() if v is not None}, task=task)
    except ValueError as e:
        raise OpenAIError(str(e), param=next((k for k in fields if k in str(e)), None)) from None


def check_user(body: dict) -> None:
    if body.get("user") is not None and not isinstance(body["user"], str):
        raise OpenAIError(f"user must be a string, got {shown(body['user'])}", param="user")


async def pool(engine_loop, prompts: list, params: PoolingParams, lora_request, field: str) -> list:
    """Each prompt pooled, in order: the engine's PooledRequestOutputs. A refusal names `field` (where the
    engine loop says prompt); nothing of the requests lingers after a refusal, a failure or a cancel."""
    parsed = ParsedRequest(kind="pooling", prompts=prompts, params=params, max_tokens_given=False, stream=False,
                           include_usage=False, top_logprobs=None, lora_request=lora_request)
    outputs = await finished(engine_loop, parsed, "pool-" + uuid.uuid4().hex, field)
    if any(getattr(o, "pooled", None) is None for o in outputs):
        raise OpenAIError("a request ended without its result (aborted)", status=500, type="internal_server_error")
    return outputs


async def finished(engine_loop, parsed: ParsedRequest, prefix: str, field: str) -> list:
    """Each of the parsed prompts' final outputs, in order (request ids `prefix`-i); a refusal names `field`
    (where the engine loop says prompt); nothing of the requests lingers after a refusal, a failure or a cancel."""
    request_ids = [f"{prefix}-{i}" for i in range(len(parsed.prompts))]
    submission = Submission(parsed, request_ids, asyncio.get_running_loop())
    finals = {}
    try:
        await engine_loop.submit(submission)
        async for output in submission.results():
            if output.finished:
                finals[output.request_id] = output
    except OpenAIError as e:
        if e.param == "prompt":
            e.param = field
        raise
    finally:
        if len(finals) < len(request_ids):
            engine_loop.abort(request_ids)
    return [finals[rid] for rid in request_ids]


def usage(outputs: list) -> dict:
    """vLLM's UsageInfo for a pooling answer: prompt tokens only."""
    num_tokens = sum(len(o.prompt_token_ids) for o in outputs)
    return {"prompt_tokens": num_tokens, "total_tokens": num_tokens, "completion_tokens": 0}
