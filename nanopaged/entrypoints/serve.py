"""`nanopaged serve [MODEL]`: an OpenAI-compatible server, like `vllm serve MODEL`.

    nanopaged serve                                   # the demo model on 127.0.0.1:8000
    nanopaged serve /path/to/hf/folder --port 9000 --max-num-seqs 64 --block-size 16
    python -m nanopaged.entrypoints.serve ...                     # the same

Every engine setting (docs/settings.md) is a flag in kebab case; `--port 0` takes a
free port, and the line printed when the server is ready names it. `--api-key KEY` (or
NANOPAGED_API_KEY) locks every route but /health and /metrics; the server's other limits
(body size, timeouts, concurrency) are flags with defaults, listed by `--help`. LoRA adapters,
as vLLM's: `--enable-lora --lora-modules name=path ...`, each then a `model` name clients may ask
for; `--allow-runtime-lora-updating` adds routes that load and unload adapters. Tool calling, as vLLM's:
`--enable-auto-tool-choice --tool-call-parser hermes` lets a request's tool_choice be "auto". The server
itself is nanopaged/entrypoints/openai/ (docs/08_server.md); it needs `pip install -e '.[serve]'`.

It runs as vLLM V1 lays it out (processes.py): an engine-core process and `--api-server-count`
API-server processes over ZeroMQ; `--engine-in-process` runs the engine on a thread of the one
HTTP process instead (the layout before, kept to measure the difference).
"""
from __future__ import annotations

import argparse
import importlib.util
import ipaddress
import json
import os
import sys
from dataclasses import dataclass, fields

from nanopaged.config import EngineConfig
from nanopaged.entrypoints.dp_router import RULES

SETTINGS_OFF_IS_NONE = {"cpu_threads"}          # "auto" or None, spelled "none" on the command line
API_KEY_ENV = "NANOPAGED_API_KEY"               # vLLM's is VLLM_API_KEY
RUNTIME_LORA_ENV = "VLLM_ALLOW_RUNTIME_LORA_UPDATING"
SERVE_PACKAGES = ("fastapi", "uvicorn", "prometheus_client", "zmq", "msgspec")   # the serve extra's imports   # vLLM's switch for the same routes, honoured here


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["serve"]:                   # `nanopaged serve ...`; the package has one command
        argv = argv[1:]
    p = argparse.ArgumentParser(prog="nanopaged serve", description=__doc__.split("\n\n")[0])
    p.add_argument("model", nargs="?", help="a local Hugging Face folder (default: the demo model)")
    p.add_argument("--host", default="127.0.0.1", help="default: %(default)s, this machine only; another "
                   "address (0.0.0.0: every network) serves whoever reaches it: give --api-key too")
    p.add_argument("--port", type=int, default=8000, help="0: any free port (the ready line names it)")
    p.add_argument("--served-model-name", help="the name clients ask for (default: MODEL as given)")
    p.add_argument("--api-server-count", type=_positive(int), default=1, metavar="N",
                   help="API-server processes (HTTP, tokenizing, detokenizing) in front of the one engine-core "
                        "process (default: %(default)s)")
    p.add_argument("--data-parallel-size", type=_positive(int), default=1, metavar="D",
                   help="engine-core processes, each with its own copy of the model, scheduler and KV cache; every "
                        "API server routes each new request to one of them (default: %(default)s)")
    p.add_argument("--dp-routing", choices=RULES, default="prefix-aware",
                   help="with --data-parallel-size > 1: which engine core a request goes to: the one holding its "
                        "prefix unless overloaded (default), the least loaded, or each in turn")
    p.add_argument("--engine-core-threads", type=_positive(int), metavar="T",
                   help="torch's CPU threads in each engine core (default: torch's own count; with "
                        "--data-parallel-size D, the host's cores / D)")
    p.add_argument("--engine-in-process", action="store_true",
                   help="run the engine on a thread of the one HTTP process, no engine-core process (the old "
                        "layout; with --api-server-count 1 only)")
    p.add_argument("--uvicorn-log-level", default="warning",
                   choices=["critical", "error", "warning", "info", "debug", "trace"])
    p.add_argument("--disable-frontend", action="store_true",
                   help="no page at / (the playground and dashboard, docs/08_server.md: The page) and no "
                        "/dashboard.json: a 404 there")
    add_limits(p.add_argument_group("access and limits (docs/08_server.md: Limits and access control)"))
    add_lora(p.add_argument_group("LoRA adapters, with --enable-lora (docs/08_server.md: LoRA adapters)"))
    add_tool_calling(p.add_argument_group("tool calling (docs/08_server.md: Tool calling)"))
    engine = p.add_argument_group("engine settings (docs/settings.md)")
    for f in fields(EngineConfig):
        if f.init and f.name != "model":
            add_setting(engine, f.name, str(f.type), f.default)
    args = p.parse_args(argv)
    for flag in ("lora_modules", "allow_runtime_lora_updating"):
        if getattr(args, flag) and not getattr(args, "enable_lora", False):
            p.error(f"--{flag.replace('_', '-')} needs --enable-lora (the engine applies adapters only then)")
    check_tool_calling(p, args)
    if args.engine_in_process and args.api_server_count != 1:
        p.error("--engine-in-process runs one HTTP process: --api-server-count must be 1")
    if args.engine_in_process and (args.data_parallel_size != 1 or args.engine_core_threads):
        p.error("--engine-in-process runs the engine on a thread: --data-parallel-size must be 1, without "
                "--engine-core-threads")
    if args.api_server_count > 1 and runtime_lora_updating(args):      # the flag or vLLM's variable
        p.error(f"--allow-runtime-lora-updating (or {RUNTIME_LORA_ENV}) needs --api-server-count 1 (each API "
                "server keeps its own table of adapter names)")
    return args


@dataclass(frozen=True)
class LoRAModule:
    """One adapter of --lora-modules (vLLM's LoRAModulePath): the name clients ask for, its PEFT folder."""
    name: str
    path: str
    base_model_name: str | None = None          # if given, the served model's name


def add_lora(group) -> None:
    group.add_argument("--lora-modules", nargs="+", type=_lora_module, metavar="NAME=PATH",
                       help="adapters to serve, each read at start-up and asked for by its name in a request's "
                            "`model`: name=path, or vLLM's JSON object "
                            "'{\"name\": ..., \"path\": ..., \"base_model_name\": ...}'")
    group.add_argument("--allow-runtime-lora-updating", action="store_true",
                       help="add the routes POST /v1/load_lora_adapter and /v1/unload_lora_adapter, which "
                            f"make the server read any folder a client names (also: {RUNTIME_LORA_ENV}=True, "
                            "as vLLM); without it they are 404s")


def _lora_module(text: str) -> LoRAModule:
    if text.lstrip().startswith("{"):
        given = _json_object(text)
        unknown = sorted(set(given) - {"name", "path", "base_model_name"})
        if unknown or not all(isinstance(given.get(k), str) and given[k] for k in ("name", "path")):
            raise argparse.ArgumentTypeError(f"expected {{\"name\": ..., \"path\": ..., \"base_model_name\": ...}} "
                                             f"with a non-empty name and path, got {text!r}")
        return LoRAModule(**given)
    name, _, path = text.partition("=")
    if not name or not path:
        raise argparse.ArgumentTypeError(f"expected name=path or a JSON object, got {text!r}")
    return LoRAModule(name, path)


def add_tool_calling(group) -> None:
    from nanopaged.entrypoints.openai.tool_parsers import TOOL_PARSERS
    group.add_argument("--enable-auto-tool-choice", action="store_true",
                       help='allow tool_choice "auto" (the default of a request with tools): the model may call '
                            "a tool in its own format, which --tool-call-parser reads; without it, such a request "
                            "is a 400")
    group.add_argument("--tool-call-parser", metavar="NAME",
                       help=f"how the model writes its tool calls: {', '.join(TOOL_PARSERS)}")


def check_tool_calling(p: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """vLLM's rules: a parser this server has, and --enable-auto-tool-choice only with one."""
    from nanopaged.entrypoints.openai.tool_parsers import TOOL_PARSERS
    if args.tool_call_parser is not None and args.tool_call_parser not in TOOL_PARSERS:
        p.error(f"--tool-call-parser {args.tool_call_parser!r} is not a tool parser; choose from {list(TOOL_PARSERS)}")
    if args.enable_auto_tool_choice and args.tool_call_parser is None:
        p.error("--enable-auto-tool-choice requires --tool-call-parser")


def runtime_lora_updating(args: argparse.Namespace) -> bool:
    """--allow-runtime-lora-updating, or vLLM's environment variable; only where adapters are served."""
    allowed = args.allow_runtime_lora_updating or os.environ.get(RUNTIME_LORA_ENV, "").strip().lower() in ("1", "true")
    return allowed and getattr(args, "enable_lora", False)


def add_limits(group) -> None:
    """What a client may do: who may ask, how much one request may send, how long it may take."""
    group.add_argument("--api-key", help="require 'Authorization: Bearer API_KEY' on every route but /health, "
                       f"/metrics and the page's static files (default: ${API_KEY_ENV} if set, else no key)")
    limit = dict(metavar="N", type=_positive(int))
    group.add_argument("--max-request-body-bytes", default=8 * 1024 * 1024, **limit,
                       help="a longer body is a 413, refused before it is read (default: %(default)s, 8 MiB)")
    seconds = dict(metavar="S", type=_positive(float))
    group.add_argument("--timeout-request-header", default=10.0, **seconds,
                       help="seconds a client has to send a request's line and headers; then its "
                            "connection is closed (default: %(default)s)")
    group.add_argument("--timeout-request-body", default=60.0, **seconds,
                       help="seconds a client has to send a request's body; then a 408 (default: %(default)s)")
    group.add_argument("--timeout-keep-alive", default=5.0, **seconds,
                       help="seconds an idle connection stays open after a response (uvicorn's; "
                            "default: %(default)s)")
    group.add_argument("--h11-max-incomplete-event-size", default=16 * 1024, **limit,
                       help="bytes of a request's line and headers; more is a 400 (h11's; default: %(default)s)")
    group.add_argument("--limit-concurrency", default=512, **limit,
                       help="open connections or requests in flight past which a request is a 503 "
                            "(uvicorn's; keep it below `ulimit -n`; default: %(default)s)")
    group.add_argument("--max-stored-responses", default=1000, **limit,
                       help="responses /v1/responses keeps for previous_response_id, per API server; the least "
                            "recently used go first (default: %(default)s)")
    group.add_argument("--max-stored-response-bytes", default=64 * 1024 * 1024, **limit,
                       help="bytes of JSON those responses may hold in all (default: %(default)s, 64 MiB)")


def _positive(convert):
    def positive(text: str):
        value = convert(text)
        if not value > 0:
            raise argparse.ArgumentTypeError(f"must be more than 0, got {text}")
        return value
    return positive


def api_key(args: argparse.Namespace) -> str | None:
    """--api-key, else the environment's; an empty key would lock nothing, so it is refused."""
    key = args.api_key if args.api_key is not None else os.environ.get(API_KEY_ENV)
    if key is not None and not key.strip():
        raise ValueError(f"the API key (--api-key or {API_KEY_ENV}) is empty; give a key, or none at all")
    return key


def access_warning(host: str, port: int, api_key: str | None) -> str | None:
    """What to say at start when a server anyone on the network can reach has no key."""
    if api_key is not None or host == "localhost":
        return None
    try:
        if ipaddress.ip_address(host).is_loopback:
            return None
    except ValueError:                          # a host name: it may resolve to any address
        pass
    return (f"nanopaged: warning: serving on {host} with no API key: anyone who can reach port {port} "
            f"can use the model; give --api-key KEY (or set {API_KEY_ENV})")


def add_setting(group, name: str, type_name: str, default) -> None:
    """One EngineConfig field as a flag; unset flags keep the engine's own default."""
    flag = "--" + name.replace("_", "-")
    kw = dict(dest=name, default=argparse.SUPPRESS, help=f"default: {default}")
    if type_name in ("bool", "bool | None"):         # --batch-invariant / --no-batch-invariant; unset: auto
        group.add_argument(flag, action=argparse.BooleanOptionalAction, **kw)
    elif name in SETTINGS_OFF_IS_NONE:
        group.add_argument(flag, type=_auto_or_none, metavar="{auto,none}", **kw)
    elif type_name.startswith("dict"):         # --speculative-config '{"method": "ngram", ...}', as vLLM's
        group.add_argument(flag, type=_json_object, metavar="JSON", **kw)
    else:
        convert = int if type_name.startswith("int") else float if type_name.startswith("float") else str
        group.add_argument(flag, type=convert, **kw)


def _json_object(text: str) -> dict:
    try:
        value = json.loads(text)
    except json.JSONDecodeError as e:
        raise argparse.ArgumentTypeError(f"expected a JSON object, got {text!r} ({e})") from None
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError(f"expected a JSON object, got {text!r}")
    return value


def _auto_or_none(text: str) -> str | None:
    if text not in ("auto", "none"):
        raise argparse.ArgumentTypeError(f"expected auto or none, got {text!r}")
    return None if text == "none" else text


def engine_settings(args: argparse.Namespace) -> dict:
    names = {f.name for f in fields(EngineConfig) if f.init} - {"model"}
    return {n: getattr(args, n) for n in names if hasattr(args, n)}


def describe(args: argparse.Namespace, key: str | None):
    """The ready line's (name, details), from the engine's resolved config and its KV blocks."""
    from nanopaged.entrypoints.api_server import served_name

    def details(config, num_kv_blocks: int) -> tuple[str, str]:
        adapters = len(args.lora_modules or ())
        return served_name(args), (f"{num_kv_blocks} KV blocks of {config.block_size} tokens, max_model_len "
                                   f"{config.max_model_len}{f', {adapters} LoRA adapter(s)' if adapters else ''}"
                                   f"{', API key required' if key else ''}")
    return details


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    missing = [name for name in SERVE_PACKAGES if importlib.util.find_spec(name) is None]
    if missing:
        sys.exit(f"nanopaged serve needs the serve extra ({', '.join(missing)} missing): pip install -e '.[serve]'")
    try:
        key = api_key(args)
    except ValueError as e:
        sys.exit(f"nanopaged serve: {e}")
    warning = access_warning(args.host, args.port, key)
    if warning:
        print(warning, file=sys.stderr, flush=True)
    if runtime_lora_updating(args):
        print("nanopaged: runtime LoRA updating is on: any client (with the API key, if one is set) may make "
              "the server read a folder of this machine as an adapter", file=sys.stderr, flush=True)
    if args.engine_in_process:
        serve_in_process(args, key)
        status = 0
    else:
        from nanopaged.entrypoints.processes import serve_processes
        try:
            status = serve_processes(args, engine_settings(args), describe(args, key), key,
                                     runtime_lora_updating(args))
        except ValueError as e:                 # a bad setting, model or adapter folder: say which, no traceback
            sys.exit(f"nanopaged serve: {e}")
    print("nanopaged: stopped", flush=True)
    sys.exit(status)


def serve_in_process(args: argparse.Namespace, key: str | None) -> None:
    """The one-process layout: the engine loop on a thread beside uvicorn's event loop."""
    from nanopaged.entrypoints.api_server import served_models, uvicorn_server
    from nanopaged.entrypoints.openai.app import build_app
    from nanopaged.entrypoints.openai.engine_loop import EngineLoop
    from nanopaged.entrypoints.openai.limits import BodyLimits
    from nanopaged.entrypoints.openai.metrics import ServerMetrics
    from nanopaged.llm import LLM
    from nanopaged.lora.extension import LoRA

    try:
        llm = LLM(args.model, **engine_settings(args))
        lora = llm.llm_engine.find(LoRA)
        models = served_models(args, lora and lora.manager, llm.llm_engine.config.max_model_len)
    except ValueError as e:                     # a bad setting, model or adapter folder: say which, no traceback
        sys.exit(f"nanopaged serve: {e}")
    engine, metrics = llm.llm_engine, ServerMetrics()
    # The loop holds the LLM for its whole life: its lock, and its CPU thread governor.
    engine_loop = EngineLoop(engine, metrics, hold=llm.one_call_at_a_time, stats=llm.stats)
    app = build_app(engine_loop, metrics, models, BodyLimits(args.max_request_body_bytes, args.timeout_request_body),
                    api_key=key, runtime_lora_updating=runtime_lora_updating(args),
                    tool_parser=args.tool_call_parser if args.enable_auto_tool_choice else None,
                    reasoning_parser=engine.config.reasoning_parser,
                    stored_responses=(args.max_stored_responses, args.max_stored_response_bytes),
                    frontend=not args.disable_frontend)
    name, details = describe(args, key)(engine.config, engine.scheduler.block_pool.num_blocks)

    def started(host: str, port: int) -> None:
        print(f"nanopaged: serving {name!r} at http://{host}:{port}/v1 ({details}; engine in process)", flush=True)

    engine_loop.start()
    try:
        uvicorn_server(args, app, started).run()
    except KeyboardInterrupt:       # Ctrl-C: uvicorn shuts down gracefully, then may re-raise it
        pass
    finally:
        engine_loop.stop()


def cli() -> None:
    """The `nanopaged` command; `serve` is its one subcommand."""
    if sys.argv[1:2] != ["serve"]:
        sys.exit("usage: nanopaged serve [MODEL] [--host HOST] [--port PORT] [engine settings]; "
                 "nanopaged serve --help lists them")
    main(sys.argv[2:])


if __name__ == "__main__":
    main()
