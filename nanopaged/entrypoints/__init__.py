"""Commands a user runs (docs/01, 08).

    serve.py           `nanopaged serve [MODEL]`: the OpenAI-compatible server's command line
    openai/            the server: routes, the engine loop, responses, /metrics
    kv_cache_size.py   KV bytes per token of any config.json (python -m nanopaged.entrypoints.kv_cache_size)
"""
