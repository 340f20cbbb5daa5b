"""`nanopaged serve [MODEL]`: an OpenAI-compatible server, like `vllm serve MODEL`.

    nanopaged serve                                   # the demo model on 127.0.0.1:8000
    nanopaged serve /path/to/hf/folder --port 9000 --max-num-seqs 64 --block-size 16
    python -m nanopaged.entrypoints.serve ...                     # the same

Every engine setting (README, "Engine settings") is a flag in kebab case; `--port 0` takes a
free port, and the line printed when the server is ready names it. The server itself is
nanopaged/entrypoints/openai/ (docs/08_server.md); it needs `pip install -e '.[serve]'`.
"""
from __future__ import annotations

import argparse
import sys
from dataclasses import fields

from nanopaged.config import EngineConfig

SETTINGS_OFF_IS_NONE = {"cpu_threads"}          # "auto" or None, spelled "none" on the command line


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["serve"]:                   # `nanopaged serve ...`; the package has one command
        argv = argv[1:]
    p = argparse.ArgumentParser(prog="nanopaged serve", description=__doc__.split("\n\n")[0])
    p.add_argument("model", nargs="?", help="a local Hugging Face folder (default: the demo model)")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8000, help="0: any free port (the ready line names it)")
    p.add_argument("--served-model-name", help="the name clients ask for (default: MODEL as given)")
    p.add_argument("--uvicorn-log-level", default="warning",
                   choices=["critical", "error", "warning", "info", "debug", "trace"])
    engine = p.add_argument_group("engine settings (README: Engine settings)")
    for f in fields(EngineConfig):
        if f.init and f.name != "model":
            add_setting(engine, f.name, str(f.type), f.default)
    return p.parse_args(argv)


def add_setting(group, name: str, type_name: str, default) -> None:
    """One EngineConfig field as a flag; unset flags keep the engine's own default."""
    flag = "--" + name.replace("_", "-")
    kw = dict(dest=name, default=argparse.SUPPRESS, help=f"default: {default}")
    if type_name == "bool":
        group.add_argument(flag, action=argparse.BooleanOptionalAction, **kw)
    elif name in SETTINGS_OFF_IS_NONE:
        group.add_argument(flag, type=_auto_or_none, metavar="{auto,none}", **kw)
    else:
        convert = int if type_name.startswith("int") else float if type_name.startswith("float") else str
        group.add_argument(flag, type=convert, **kw)


def _auto_or_none(text: str) -> str | None:
    if text not in ("auto", "none"):
        raise argparse.ArgumentTypeError(f"expected auto or none, got {text!r}")
    return None if text == "none" else text


def engine_settings(args: argparse.Namespace) -> dict:
    names = {f.name for f in fields(EngineConfig) if f.init} - {"model"}
    return {n: getattr(args, n) for n in names if hasattr(args, n)}


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    try:
        import uvicorn
        from nanopaged.entrypoints.openai.app import build_app
    except ImportError as e:
        sys.exit(f"nanopaged serve needs the serve extra ({e.name} is missing): pip install -e '.[serve]'")
    from nanopaged.models.demo_model import DEMO_MODEL
    from nanopaged.entrypoints.openai.engine_loop import EngineLoop
    from nanopaged.entrypoints.openai.metrics import ServerMetrics
    from nanopaged.llm import LLM

    try:
        llm = LLM(args.model, **engine_settings(args))
    except ValueError as e:                     # a bad setting or model folder: say which, no traceback
        sys.exit(f"nanopaged serve: {e}")
    engine = llm.llm_engine
    name = args.served_model_name or args.model or DEMO_MODEL
    metrics = ServerMetrics(engine, llm.stats)
    # The loop holds the LLM for its whole life: its lock, and its CPU thread governor.
    engine_loop = EngineLoop(engine, metrics, hold=llm.one_call_at_a_time)
    app = build_app(engine_loop, metrics, name, engine.config.max_model_len)

    class Server(uvicorn.Server):
        async def startup(self, sockets=None) -> None:
            await super().startup(sockets)
            if self.started:                    # the socket listens: now say where
                host, port = self.servers[0].sockets[0].getsockname()[:2]
                print(f"nanopaged: serving {name!r} at http://{host}:{port}/v1 "
                      f"({engine.scheduler.block_pool.num_blocks} KV blocks of {engine.config.block_size} "
                      f"tokens, max_model_len {engine.config.max_model_len})", flush=True)

    engine_loop.start()
    try:
        Server(uvicorn.Config(app, host=args.host, port=args.port, log_level=args.uvicorn_log_level,
                              lifespan="off")).run()   # no startup hooks; "on" logs a traceback on Ctrl-C
    except KeyboardInterrupt:       # Ctrl-C: uvicorn shuts down gracefully, then may re-raise it
        pass
    finally:
        engine_loop.stop()
    print("nanopaged: stopped", flush=True)


def cli() -> None:
    """The `nanopaged` command; `serve` is its one subcommand."""
    if sys.argv[1:2] != ["serve"]:
        sys.exit("usage: nanopaged serve [MODEL] [--host HOST] [--port PORT] [engine settings]; "
                 "nanopaged serve --help lists them")
    main(sys.argv[2:])


if __name__ == "__main__":
    main()
