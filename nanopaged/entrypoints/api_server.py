"""An API-server process: HTTP, JSON, chat templates, tokenizing and detokenizing, no model.

Each of `--api-server-count` such processes serves the one listening socket the supervisor
opened (processes.py; the kernel hands each new connection to one of them) with the same
FastAPI app as the one-process server (openai/app.py), whose engine is here a CoreClient
(openai/core_client.py): a socket to the engine-core process. `uvicorn_server` is shared by both
layouts, and so is `served_models`, the names it answers to. docs/08_server.md, "Processes".
"""
from __future__ import annotations

import signal
import threading
from multiprocessing import reduction
from multiprocessing.connection import Connection

import uvicorn

from nanopaged.entrypoints.openai.app import build_app
from nanopaged.entrypoints.openai.limits import BodyLimits, with_head_timeout
from nanopaged.entrypoints.openai.protocol import OpenAIError
from nanopaged.entrypoints.openai.served_models import ServedModels
from nanopaged.models.demo_model import DEMO_MODEL


class Server(uvicorn.Server):
    """uvicorn's server, telling `on_started(host, port)` once its socket listens. SIGINT is the
    supervisor's to act on (a terminal's Ctrl-C reaches every process of the group): ignored here."""
    on_started = None
    ignore_sigint = False

    async def startup(self, sockets=None) -> None:
        await super().startup(sockets)
        if self.started and self.on_started is not None:
            self.on_started(*self.servers[0].sockets[0].getsockname()[:2])

    def handle_exit(self, sig, frame) -> None:
        if sig == signal.SIGINT and self.ignore_sigint:
            return
        super().handle_exit(sig, frame)


def uvicorn_server(args, app, on_started, host: str | None = None, port: int | None = None) -> Server:
    """The app under uvicorn with the server's limits (the flags of serve.py's add_limits)."""
    server = Server(uvicorn.Config(
        app, host=host or args.host, port=args.port if port is None else port, log_level=args.uvicorn_log_level,
        lifespan="off",                     # no startup hooks; "on" logs a traceback on Ctrl-C
        http=with_head_timeout(args.timeout_request_header),   # always h11, with a header deadline
        timeout_keep_alive=args.timeout_keep_alive, limit_concurrency=args.limit_concurrency,
        h11_max_incomplete_event_size=args.h11_max_incomplete_event_size, timeout_graceful_shutdown=5))
    server.on_started = on_started
    return server


def run_api_server(name: str, args, sock, addresses: list[str], lifelines: list, core: tuple, started,
                   key: str | None, updating: bool, control=None) -> None:
    """The process's body. `addresses`, `lifelines`: each engine core's socket and life line (one, or one per
    data-parallel rank); `core`: (EngineConfig, num_kv_blocks, serves adapters) from the engine core;
    `started` hears ("started", name) once the socket is served, or ("error", text); `key`: the API key
    (or None), `updating`: whether the LoRA load and unload routes exist; `control`: with several engine
    cores, the supervisor's pipe that hands over the life line of a core started in a dead one's place."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)       # SIGTERM exits at once until the server exists
    from nanopaged.engine.input_processor import load_tokenizer
    from nanopaged.entrypoints.dp_router import Router
    from nanopaged.entrypoints.openai.core_client import CoreClient
    from nanopaged.entrypoints.openai.dp_client import DataParallelClient
    from nanopaged.entrypoints.openai.metrics import ServerMetrics

    config, num_kv_blocks, serves_adapters = core
    metrics = ServerMetrics()
    tokenizer = load_tokenizer(config.tokenizer)

    def connect(i: int, lifeline) -> CoreClient:
        return CoreClient(name, addresses[i], config, tokenizer, num_kv_blocks, lifeline, metrics, str(i))
    clients = [connect(i, lifeline) for i, lifeline in enumerate(lifelines)]
    client = clients[0] if len(clients) == 1 else DataParallelClient(
        clients, Router(args.dp_routing, len(clients), config.block_size, config.prefix_hash), connect)
    client.start()
    if control is not None:
        threading.Thread(target=take_replacements, args=(control, client), name="nanopaged-control",
                         daemon=True).start()
    try:
        models = served_models(args, client if serves_adapters else None, config.max_model_len)
    except ValueError as e:
        started.send(("error", str(e)))
        client.stop()
        raise SystemExit(1) from None
    app = build_app(client, metrics, models, BodyLimits(args.max_request_body_bytes, args.timeout_request_body),
                    api_key=key, runtime_lora_updating=updating,
                    tool_parser=args.tool_call_parser if args.enable_auto_tool_choice else None,
                    reasoning_parser=config.reasoning_parser,
                    stored_responses=(args.max_stored_responses, args.max_stored_response_bytes),
                    frontend=not args.disable_frontend)
    server = uvicorn_server(args, app, lambda host, port: started.send(("started", name)))
    server.ignore_sigint = True
    # From here SIGTERM shuts the server down (before uvicorn takes the signal, it starts and stops at once);
    # uvicorn raises it again after its shutdown, when this handler is back: harmless then.
    signal.signal(signal.SIGTERM, lambda sig, frame: setattr(server, "should_exit", True))
    try:
        server.run(sockets=[sock])
    finally:
        client.stop()


def take_replacements(control, client) -> None:
    """The supervisor started engine core i again: ("core", i), then its life line's file descriptor
    (passed over the pipe: multiprocessing.reduction.send_handle). Until the supervisor is gone."""
    while True:
        try:
            _, i = control.recv()
            fd = reduction.recv_handle(control)
        except (EOFError, OSError):
            return
        client.replace(i, Connection(fd, writable=False))


def served_models(args, lora_manager, max_model_len: int):
    """The base model, and --lora-modules' adapters (lora_int_id 1, 2, ... in order), each read now: a
    folder that cannot be served stops the start, with the reason. `lora_manager`: None without LoRA."""
    name, path = served_name(args), args.model or DEMO_MODEL
    models = ServedModels(name, path, max_model_len, lora_manager)
    for module in args.lora_modules or ():
        if module.base_model_name not in (None, name):
            raise ValueError(f"--lora-modules {module.name!r}: base_model_name {module.base_model_name!r} is not "
                             f"the served model, {name!r}")
        try:
            models.load(module.name, module.path)
        except OpenAIError as e:
            raise ValueError(f"--lora-modules {module.name!r}: {e.message}") from None
    return models


def served_name(args) -> str:
    return args.served_model_name or args.model or DEMO_MODEL
