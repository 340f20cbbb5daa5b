"""Pooling: `LLM(model, runner="pooling").embed(prompts)`, prefill without sampling (docs/04_scheduler.md, "Pooling").

    config.py       runner and pooler_config: LAST / MEAN / CLS and normalisation, from the settings, the
                    model folder's sentence-transformers files, or vLLM's default for a decoder
    pooler.py       the pooler, in the token-selection seat: hidden states, chunk by chunk, to one vector
    processors.py   PoolingParams in, the pooled vector out with the request's output
    outputs.py      vLLM's EmbeddingRequestOutput and EmbeddingOutput
    embed.py        LLM.embed

A pooling request goes through the same scheduler and block pool as any prompt: chunked prefill,
the prefix cache (LAST pooling only: the cache keeps K/V, not hidden states), preemption. The engine
installs this module when `runner="pooling"` (engine/llm_engine.py: CONFIG_EXTENSIONS, on the
resolved `pooler_config`); nothing of the core changes. The pooling parameters: nanopaged/pooling_params.py.
"""
from __future__ import annotations

from torch import nn

from nanopaged.pooling.config import PoolerConfig
from nanopaged.pooling.pooler import Pooler, read_every_row
from nanopaged.pooling.processors import PoolingInputProcessor, PoolingOutputProcessor


def install(engine) -> PoolerConfig:
    """Make a causal LM's engine an embedding engine (vLLM: as_embedding_model): the model's head is
    taken off, so its "logits" are its hidden states; the runner reads out every row; the pooler takes
    the token-selection seat; the input and output processors take PoolingParams and give vectors."""
    config: PoolerConfig = engine.config.pooler_config
    model = engine.runner.model
    causal_lm = model if hasattr(model, "lm_head") else model.model      # under a backend's wrapper (CUDA graphs)
    causal_lm.lm_head = nn.Identity()
    engine.runner.before_forward.append(read_every_row)
    engine.token_selection = pooler = Pooler(config.pooling_type, config.normalize)
    engine.input_processor = PoolingInputProcessor(engine.config, engine.tokenizer, engine.runner.num_kv_blocks)
    engine.output_processor = PoolingOutputProcessor(engine.tokenizer, pooler)
    return config
