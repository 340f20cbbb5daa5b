"""Commands a user runs, and the server's processes (docs/01, 08).

    serve.py           `nanopaged serve [MODEL]`: the OpenAI-compatible server's command line
    openai/            the server: routes, the engine loop, responses, /metrics
    frontend/          the page at /: index.html, app.js, style.css (a playground and a dashboard)
    processes.py       the supervisor: opens the socket, starts, watches and stops the processes below
    engine_core.py     the engine-core process: scheduler, runner, block pool, and no text work
    dp_router.py       data parallelism: which engine core a new request goes to (--dp-routing)
    api_server.py      an API-server process: HTTP, JSON, tokenizing and detokenizing, no model
    core_messages.py   what crosses the ZeroMQ socket between them, as MessagePack structs
    kv_cache_size.py   KV bytes per token of any config.json (python -m nanopaged.entrypoints.kv_cache_size)
"""
