"""The HTTP side: FastAPI routes, OpenAI's error bodies, Server-Sent Events.

A handler reads its body within the server's limits (limits.py), parses it (protocol.py) off
the event loop, hands it to the engine loop (engine_loop.py), and waits on the request's
output queue; it never touches the engine. A streamed request
sends one `data: {...}` event per chunk as the steps come (responses.py), then
`data: [DONE]`. A client that goes away mid-request aborts it: its blocks go back to the
pool at once, for the clients still there. A request's `model` may name a LoRA adapter
(served_models.py), which two more routes load and unload while the server runs, when it was
started to allow that. `/v1/messages` is Anthropic's Messages API over the same path
(anthropic_api.py), `/v1/responses` OpenAI's Responses API (responses_api.py). vLLM:
vllm/entrypoints/openai/api_server.py. docs/08_server.md.
"""
from __future__ import annotations

import asyncio
import json
import logging
import uuid

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse

from nanopaged.entrypoints.openai import anthropic_api, responses_api
from nanopaged.entrypoints.openai.classify import register_classify
from nanopaged.entrypoints.openai.embeddings import register_embeddings
from nanopaged.entrypoints.openai.engine_loop import EngineLoop, Submission
from nanopaged.entrypoints.openai.frontend import PAGE_PATHS, register_frontend
from nanopaged.entrypoints.openai.limits import BodyLimits, ClientLeft, RequireApiKey, log_client_left, read_body
from nanopaged.entrypoints.openai.limits import OPEN_PATHS
from nanopaged.entrypoints.openai.metrics import ServerMetrics
from nanopaged.entrypoints.openai.protocol import (OpenAIError, ParsedRequest, parse_body, parse_lora_update,
                                                   parse_request, requested_model)
from nanopaged.entrypoints.openai.score import register_score
from nanopaged.entrypoints.openai.responses import ResponseBuilder
from nanopaged.entrypoints.openai.served_models import ServedModels
from nanopaged.entrypoints.openai.tokenize import detokenize, tokenize

logger = logging.getLogger("nanopaged.entrypoints.serve")
ID_PREFIX = {"completion": "cmpl-", "chat": "chatcmpl-"}


def build_app(engine_loop: EngineLoop, metrics: ServerMetrics, models: ServedModels, body_limits: BodyLimits,
              api_key: str | None = None, runtime_lora_updating: bool = False,
              tool_parser: str | None = None, reasoning_parser: str | None = None,
              stored_responses: tuple[int, int] = (1000, 64 << 20), frontend: bool = True) -> FastAPI:
    """The routes; with `api_key`, every one but /health and /metrics needs it (limits.py). The LoRA
    load and unload routes exist only with `runtime_lora_updating` on a server that serves adapters.
    `tool_parser`: the parser of tool_choice "auto" (--enable-auto-tool-choice), or None (refused);
    `reasoning_parser`: the engine's (nanopaged/reasoning.py), or None; `stored_responses`: the
    Responses API's store, at most (responses, bytes); `frontend`: the page at / and its feed
    (frontend.py), whose static files need no key."""
    app = FastAPI(title="nanopaged", description="an OpenAI-compatible server on nanopaged's engine")
    response_store = responses_api.ResponseStore(*stored_responses)
    if api_key is not None:
        app.add_middleware(RequireApiKey, api_key=api_key, open_paths=OPEN_PATHS + (PAGE_PATHS if frontend else ()))
    if frontend:
        register_frontend(app, metrics)                                 # GET /, its files, /dashboard.json

    @app.exception_handler(OpenAIError)
    async def openai_error(_request: Request, e: OpenAIError) -> JSONResponse:
        return JSONResponse(e.body(), status_code=e.status, headers=e.headers)

    @app.exception_handler(ClientLeft)
    async def client_left(_request: Request, e: ClientLeft) -> Response:
        log_client_left(e)
        return Response(status_code=499)             # nobody reads it; nginx's "client closed"

    @app.exception_handler(Exception)
    async def unexpected(_request: Request, e: Exception) -> JSONResponse:   # a bug: say so, stay up
        logger.exception("unexpected error in a handler")
        return JSONResponse(OpenAIError(f"internal error: {type(e).__name__}: {e}", status=500,
                                        type="internal_server_error").body(), status_code=500)

    @app.get("/health")
    async def health() -> Response:
        status, detail = engine_loop.health()        # data parallelism: "degraded" while a core is down
        return Response(detail, status_code=status, media_type="text/plain")

    @app.get("/v1/models")
    async def list_models() -> dict:
        return {"object": "list", "data": list(models.table.cards)}

    @app.get("/metrics")
    async def prometheus() -> Response:
        return Response(metrics.exposition(), media_type="text/plain; version=0.0.4; charset=utf-8")

    @app.get("/engine_stats")
    async def engine_stats() -> dict:
        """/metrics' engine figures as JSON, per engine core (data parallelism) and in total."""
        return metrics.engine_stats()

    @app.post("/tokenize")
    async def tokenize_route(request: Request) -> dict:
        body = await asyncio.to_thread(parse_body, await read_body(request, body_limits))
        requested_model(body.get("model"), models.name, models.adapters)        # a wrong name: vLLM's 404
        return await asyncio.to_thread(tokenize, body, engine_loop.tokenizer, models.max_model_len)

    @app.post("/detokenize")
    async def detokenize_route(request: Request) -> dict:
        body = await asyncio.to_thread(parse_body, await read_body(request, body_limits))
        requested_model(body.get("model"), models.name, models.adapters)
        return await asyncio.to_thread(detokenize, body, engine_loop.tokenizer)

    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        return await serve(request, "completion")

    register_embeddings(app, engine_loop, models, body_limits)          # POST /v1/embeddings (embeddings.py)
    register_classify(app, engine_loop, models, body_limits)            # POST /classify, /pooling (classify.py)
    register_score(app, engine_loop, models, body_limits)               # /score, /rerank and aliases (score.py)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request) -> Response:
        return await serve(request, "chat")

    async def serve(request: Request, kind: str) -> Response:
        raw = await read_body(request, body_limits)
        # Off the event loop: parsing a few megabytes of JSON takes tens of milliseconds.
        parsed = await asyncio.to_thread(parse, raw, kind)
        return await run(request, parsed, kind)

    @app.post("/v1/messages")
    async def anthropic_messages(request: Request) -> Response:
        """Anthropic's Messages API: rewritten as a chat request, answered in Anthropic's shapes."""
        try:
            raw = await read_body(request, body_limits)
            parsed = await asyncio.to_thread(lambda: parse_request(
                anthropic_api.to_chat_body(parse_body(raw)), "chat", models.name, models.adapters, tool_parser))
            return await run(request, parsed, "chat", anthropic=True)
        except OpenAIError as e:
            return JSONResponse(anthropic_api.error_body(e), status_code=e.status, headers=e.headers)
        except ClientLeft:
            raise
        except Exception as e:                       # a bug: said in Anthropic's shape, as this route's clients read it
            logger.exception("unexpected error in a handler")
            error = OpenAIError(f"internal error: {type(e).__name__}: {e}", status=500, type="internal_server_error")
            return JSONResponse(anthropic_api.error_body(error), status_code=500)

    @app.post("/v1/responses")
    async def responses(request: Request) -> Response:
        """OpenAI's Responses API: rewritten as a chat request, answered as a response (responses_api.py)."""
        try:
            raw = await read_body(request, body_limits)
            turn, parsed = await asyncio.to_thread(parse_turn, raw)
            return await run(request, parsed, "chat", turn=turn)
        except OpenAIError as e:
            raise responses_api.in_responses_terms(e) from None

    def parse_turn(raw: bytes) -> tuple[responses_api.Turn, ParsedRequest]:
        turn = responses_api.parse(parse_body(raw), response_store)
        return turn, parse_request(turn.chat_body, "chat", models.name, models.adapters, tool_parser)

    @app.get("/v1/responses/{response_id}")
    async def stored_response(response_id: str) -> dict:
        try:
            return response_store.get(response_id).response
        except OpenAIError as e:
            e.param = "response_id"
            raise

    def answer(turn: responses_api.Turn, completion: dict) -> dict:
        response = turn.response(completion)
        turn.remember(response_store, response)
        return response

    async def run(request: Request, parsed: ParsedRequest, kind: str, anthropic: bool = False,
                  turn: responses_api.Turn | None = None) -> Response:
        """A parsed request through the engine: streamed, or whole once every output is in."""
        response_id = ID_PREFIX[kind] + uuid.uuid4().hex
        request_ids = [f"{response_id}-{i}" for i in range(len(parsed.prompts))]
        submission = Submission(parsed, request_ids, asyncio.get_running_loop())
        answered_as = parsed.lora_request.lora_name if parsed.lora_request else models.name
        builder = ResponseBuilder(parsed, response_id, answered_as, request_ids, reasoning_parser)
        try:
            await engine_loop.submit(submission)
        except BaseException:
            engine_loop.abort(request_ids)          # cancelled while queueing: nothing may linger
            raise
        if parsed.stream:
            events = (anthropic_events(engine_loop, submission, builder) if anthropic
                      else responses_events(engine_loop, submission, builder, turn, response_store) if turn
                      else sse_events(engine_loop, submission, builder))
            return StreamingResponse(events, media_type="text/event-stream")
        shape = anthropic_api.to_message if anthropic else (lambda c: answer(turn, c)) if turn else None
        return await whole_response(request, engine_loop, submission, builder, shape)

    def parse(raw: bytes, kind: str) -> ParsedRequest:
        return parse_request(parse_body(raw), kind, models.name, models.adapters, tool_parser)

    if models.serves_adapters and runtime_lora_updating:
        # vLLM's routes and answers; off the event loop, like parsing: reading a folder takes a while,
        # and another load may hold the table's lock meanwhile.
        @app.post("/v1/load_lora_adapter")
        async def load_lora_adapter(request: Request) -> Response:
            name = await asyncio.to_thread(load, await read_body(request, body_limits))
            return PlainTextResponse(f"Success: LoRA adapter '{name}' added successfully.")

        @app.post("/v1/unload_lora_adapter")
        async def unload_lora_adapter(request: Request) -> Response:
            name = await asyncio.to_thread(unload, await read_body(request, body_limits))
            return PlainTextResponse(f"Success: LoRA adapter '{name}' removed successfully.")

    def load(raw: bytes) -> str:
        name, path = parse_lora_update(parse_body(raw), "load")
        models.load(name, path)
        logger.info("loaded LoRA adapter %r from %r", name, path)
        return name

    def unload(raw: bytes) -> str:
        name, _ = parse_lora_update(parse_body(raw), "unload")
        models.unload(name)
        logger.info("unloaded LoRA adapter %r", name)
        return name

    return app


async def whole_response(request: Request, engine_loop: EngineLoop, submission: Submission,
                         builder: ResponseBuilder, shape=None) -> JSONResponse:
    """Wait for every output, watching for the client leaving meanwhile (then abort)."""
    async def collect() -> list:
        finals = {}
        async for output in submission.results():
            if output.finished:
                finals[output.request_id] = output
        return [finals[rid] for rid in submission.request_ids]

    collecting = asyncio.ensure_future(collect())
    leaving = asyncio.ensure_future(wait_for_disconnect(request))
    try:
        await asyncio.wait({collecting, leaving}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        leaving.cancel()
        if not collecting.done():                    # the client left (or this task was cancelled)
            collecting.cancel()
            engine_loop.abort(submission.request_ids)
    if not collecting.done() or collecting.cancelled():
        return JSONResponse({}, status_code=499)     # nobody is listening; nginx's "client closed"
    response = builder.response(collecting.result())
    return JSONResponse(response if shape is None else shape(response))


async def wait_for_disconnect(request: Request) -> None:
    """Returns when the client closes its connection (the body has been read already)."""
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            return


async def sse_events(engine_loop: EngineLoop, submission: Submission, builder: ResponseBuilder):
    """The stream's events. If the client leaves, the server cancels this generator at its
    await; `finally` then aborts the requests still running, which frees their blocks."""
    done = False
    try:
        for chunk in builder.first_chunks():
            yield event(chunk)
        try:
            async for output in submission.results():
                for chunk in builder.chunks(output):
                    yield event(chunk)
        except OpenAIError as e:                     # the engine failed: say so in the stream
            yield event(e.body())
        except Exception as e:                       # a bug met building this stream: its error, then [DONE]
            engine_loop.abort(submission.request_ids)
            yield event(stream_failed(e).body())
        if submission.request.include_usage:
            yield event(builder.usage_chunk())
        yield "data: [DONE]\n\n"
        done = True
    finally:
        if not done:
            engine_loop.abort(submission.request_ids)


def stream_failed(e: Exception) -> OpenAIError:
    logger.exception("a stream failed")
    return OpenAIError(f"internal error: {type(e).__name__}: {e}", status=500, type="internal_server_error")


def event(payload: dict) -> str:
    return f"data: {json.dumps(payload, ensure_ascii=False)}\n\n"


async def anthropic_events(engine_loop: EngineLoop, submission: Submission, builder: ResponseBuilder):
    """Anthropic's stream: the chat chunks of sse_events, rewritten as its events (anthropic_api.py)."""
    writer, done, started = anthropic_api.EventWriter(builder.model, builder.id), False, False
    try:
        try:
            async for output in submission.results():
                if not started:
                    started = True
                    for text in writer.start(len(output.prompt_token_ids)):
                        yield text
                stop = output.outputs[0].stop_reason if output.finished else None
                for chunk in builder.chunks(output):
                    for text in writer.chunk(chunk, stop):
                        yield text
        except Exception as e:                       # the engine failed, or a bug met here: Anthropic's error event
            engine_loop.abort(submission.request_ids)
            error = e if isinstance(e, OpenAIError) else stream_failed(e)
            yield anthropic_api.event("error", anthropic_api.error_body(error))
            done = True
            return
        for text in writer.end(builder.usage()["completion_tokens"]):
            yield text
        done = True
    finally:
        if not done:
            engine_loop.abort(submission.request_ids)


async def responses_events(engine_loop: EngineLoop, submission: Submission, builder: ResponseBuilder,
                           turn: responses_api.Turn, store: responses_api.ResponseStore):
    """The Responses API's stream: the chat chunks of sse_events, rewritten as its events (responses_api.py);
    the response is stored once complete."""
    writer, done = responses_api.EventWriter(turn, builder.model), False
    try:
        for text in writer.start():
            yield text
        try:
            async for output in submission.results():
                for chunk in builder.chunks(output):
                    for text in writer.chunk(chunk):
                        yield text
        except Exception as e:                       # the engine failed, or a bug met here: an error event
            engine_loop.abort(submission.request_ids)
            for text in writer.error(e if isinstance(e, OpenAIError) else stream_failed(e)):
                yield text
            done = True
            return
        for text in writer.end(builder.usage()):
            yield text
        turn.remember(store, writer.response)
        done = True
    finally:
        if not done:
            engine_loop.abort(submission.request_ids)
