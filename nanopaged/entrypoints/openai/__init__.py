"""`nanopaged serve`: an OpenAI-compatible HTTP server on the engine (docs/08_server.md).

    protocol.py      OpenAI request bodies -> prompts and SamplingParams; OpenAI's error body
    served_models.py the model names served: the base model, LoRA adapters (loaded, unloaded)
    limits.py        who may ask (--api-key) and how much: body size, JSON type, header deadline
    engine_loop.py   the one thread that owns the LLMEngine and steps it (prompts are tokenized
                     on input threads beside it); per-request output queues
    responses.py     RequestOutputs -> whole responses and streamed chunks
    app.py           the FastAPI routes and Server-Sent Events
    metrics.py       /metrics: Prometheus figures with vLLM's names, from a step observer

Needs the `serve` extra (`pip install -e '.[serve]'`: fastapi, uvicorn, prometheus-client);
nothing else in nanopaged imports this package. The command line is nanopaged/entrypoints/serve.py.
"""
