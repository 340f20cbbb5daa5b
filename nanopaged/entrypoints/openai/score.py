"""POST /score (and /v1/score) and POST /rerank (and /v1/rerank, /v2/rerank): vLLM's scoring routes on a
`--runner pooling` server, with vLLM's requests and answers.

    /score    text_1 and text_2, 1 -> 1, 1 -> N or N -> N: {"data": [{"index", "object": "score", "score"}]}
    /rerank   a query and documents: {"results": [{"index", "document": {"text"}, "relevance_score"}]},
              best first, the first top_n (0: all)

A cross-encoder (a classifier of one label) scores each pair joined as its tokenizer joins a pair; an
embedding model, by the cosine of the two texts' embeddings (pooling/score.py, as LLM.score).
"""
from __future__ import annotations

import asyncio
import time
import uuid

from fastapi import FastAPI, Request

from nanopaged.entrypoints.openai.limits import BodyLimits, read_body
from nanopaged.entrypoints.openai.pooling_requests import check_user, pool, pooling_config, task_params, usage
from nanopaged.entrypoints.openai.protocol import (OpenAIError, only_fields, parse_body, requested_model,
                                                   shown)
from nanopaged.pooling.score import cosine, pair_prompt, pairs

SCORE_FIELDS = {"model", "text_1", "text_2", "truncate_prompt_tokens", "use_activation", "user"}
RERANK_FIELDS = {"model", "query", "documents", "top_n", "truncate_prompt_tokens", "use_activation", "user"}


def register_score(app: FastAPI, engine_loop, models, body_limits: BodyLimits) -> None:
    """Add the scoring routes to the app (app.py: build_app); `engine_loop` as for /v1/embeddings."""

    async def read(request: Request, route: str, allowed: set) -> tuple[dict, object]:
        body = await asyncio.to_thread(parse_body, await read_body(request, body_limits))
        config = pooling_config(engine_loop, route)
        only_fields(body, allowed)
        check_user(body)
        return body, config

    @app.post("/score")
    @app.post("/v1/score")
    async def score_route(request: Request) -> dict:
        body, config = await read(request, "/score", SCORE_FIELDS)
        lora_request = requested_model(body.get("model"), models.name, models.adapters)
        text_1, text_2 = checked_pairs(body.get("text_1"), body.get("text_2"), ("text_1", "text_2"))
        scores, outputs = await score_pairs(engine_loop, config, body, text_1, text_2, lora_request)
        return {"id": "score-" + uuid.uuid4().hex, "object": "list", "created": int(time.time()),
                "model": body.get("model") or models.name,
                "data": [{"index": i, "object": "score", "score": s} for i, s in enumerate(scores)],
                "usage": usage(outputs)}

    @app.post("/rerank")
    @app.post("/v1/rerank")
    @app.post("/v2/rerank")
    async def rerank_route(request: Request) -> dict:
        body, config = await read(request, "/rerank", RERANK_FIELDS)
        lora_request = requested_model(body.get("model"), models.name, models.adapters)
        query, documents = body.get("query"), body.get("documents")
        if not isinstance(query, str):
            raise OpenAIError(f"query must be a string, got {shown(query)}", param="query")
        if not isinstance(documents, list) or not documents:
            raise OpenAIError(f"documents must be a non-empty list of strings, got {shown(documents)}",
                              param="documents")
        top_n = body.get("top_n", 0)
        if not isinstance(top_n, int) or isinstance(top_n, bool):
            raise OpenAIError(f"top_n must be an integer, got {shown(top_n)}", param="top_n")
        _, documents = checked_pairs(query, documents, ("query", "documents"))
        scores, outputs = await score_pairs(engine_loop, config, body, [query], documents, lora_request)
        ranked = sorted(range(len(documents)), key=lambda i: -scores[i])[:top_n if top_n > 0 else None]
        counts = usage(outputs)
        return {"id": "rerank-" + uuid.uuid4().hex, "model": body.get("model") or models.name,
                "usage": {"prompt_tokens": counts["prompt_tokens"], "total_tokens": counts["total_tokens"]},
                "results": [{"index": i, "document": {"text": documents[i]}, "relevance_score": scores[i]}
                            for i in ranked]}


def checked_pairs(first, second, names: tuple[str, str]) -> tuple[list[str], list[str]]:
    try:
        return pairs(first, second, names)
    except ValueError as e:
        raise OpenAIError(str(e), param=names[1] if str(e).startswith(names[1]) else names[0]) from None


async def score_pairs(engine_loop, config, body: dict, first: list[str], second: list[str], lora_request
                      ) -> tuple[list[float], list]:
    """One score per pair (first's one text paired with each of second's, or pair by pair), and the
    outputs whose prompt tokens the usage counts."""
    if config.model_config.num_labels is None:                   # an embedding model: cosine
        if body.get("use_activation") is not None:
            raise OpenAIError("use_activation is a cross-encoder's; this model scores by cosine similarity",
                              param="use_activation")
        params = task_params(config, "embed", body, "model")
        outputs = await pool(engine_loop, first + second, params, lora_request, "text_2")
        firsts, seconds = outputs[:len(first)], outputs[len(first):]
        firsts = firsts * len(seconds) if len(firsts) == 1 else firsts
        return [cosine(a.pooled, b.pooled) for a, b in zip(firsts, seconds)], outputs
    params = task_params(config, "score", body, "model", use_activation=body.get("use_activation"))
    first = first * len(second) if len(first) == 1 else first
    prompts = await asyncio.to_thread(lambda: [pair_prompt(engine_loop.tokenizer, a, b) for a, b in zip(first, second)])
    outputs = await pool(engine_loop, prompts, params, lora_request, "text_2")
    return [o.pooled.item() for o in outputs], outputs
