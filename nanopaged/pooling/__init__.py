"""Pooling: `LLM(model, runner="pooling").embed(prompts)` (and classify, reward, score, encode), prefill
without sampling (docs/04_scheduler.md, "Pooling").

    extension.py    Pooling: how it attaches to the engine (engine/extension.py), with runner="pooling"
    config.py       runner and pooler_config: LAST / MEAN / CLS and normalisation, from the settings, the
                    model folder's sentence-transformers files, or vLLM's default for a decoder; a
                    classifier's activations; which tasks a model runs
    pooler.py       the pooler, in the token-selection seat: hidden states, chunk by chunk, to one vector
                    (or every row), then the task's head
    processors.py   PoolingParams in, the pooled vector out with the request's output
    outputs.py      vLLM's output records: Embedding-, Classification-, Scoring- and PoolingRequestOutput
    embed.py        LLM.embed, and the loop every pooling call runs
    tasks.py        LLM.classify, LLM.reward, LLM.encode
    score.py        LLM.score: a cross-encoder's pair scores, or embeddings' cosine

A pooling request goes through the same scheduler and block pool as any prompt: chunked prefill,
the prefix cache (LAST pooling only: the cache keeps K/V, not hidden states), preemption. The engine
installs the extension when `runner="pooling"` (on the resolved `pooler_config`); nothing of the
core changes. The pooling parameters: nanopaged/pooling_params.py.
"""
