"""`nanopaged serve`: an OpenAI-compatible HTTP server on the engine (docs/08_server.md).

    protocol.py      OpenAI request bodies -> prompts and SamplingParams; OpenAI's error body
    served_models.py the model names served: the base model, LoRA adapters (loaded, unloaded)
    limits.py        who may ask (--api-key, or x-api-key) and how much: body size, JSON type, header deadline
    engine_loop.py   the engine on a thread of this process (--engine-in-process); per-request output queues
    core_client.py   the same interface, the engine in the engine-core process (the default layout)
    dp_client.py     the same interface over several engine cores (--data-parallel-size), each request routed
    responses.py     RequestOutputs -> whole responses and streamed chunks
    tools.py         tools and tool_choice: checked, rendered, constrained ("required", a named function)
    tool_parsers.py  tool calls found in the text, whole or streamed (hermes, llama3_json)
    tokenize.py      /tokenize and /detokenize
    embeddings.py    /v1/embeddings (a pooling engine)
    classify.py      /classify and /pooling (a pooling engine's other tasks)
    score.py         /score and /rerank (a cross-encoder's pair scores, or embeddings' cosine)
    pooling_requests.py  what the pooling routes share: the runner's check, one submission of pooling requests
    anthropic_api.py /v1/messages: Anthropic's Messages API as a translation of the chat route
    responses_api.py /v1/responses: OpenAI's Responses API as a translation of the chat route; its bounded store
    app.py           the FastAPI routes and Server-Sent Events
    metrics.py       /metrics: Prometheus figures with vLLM's names, from the engine's figures
    dashboard.py     the engine's figures over the last minutes, for the page's charts (/dashboard.json)
    frontend.py      the page at / (its static files need no key) and its feed; --disable-frontend

Needs the `serve` extra (`pip install -e '.[serve]'`: fastapi, uvicorn, prometheus-client, pyzmq,
msgspec); nothing else in nanopaged imports this package. The command line is
nanopaged/entrypoints/serve.py; the processes, nanopaged/entrypoints/processes.py.
"""
