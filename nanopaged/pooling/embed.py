"""LLM.embed: one embedding per prompt, in their order (vLLM's LLM.embed), on a runner="pooling" engine;
and `pool`, the loop every pooling call runs (pooling/tasks.py, pooling/score.py).

The same loop as LLM.generate: every prompt checked before any is queued, then step until all are done.
"""
from __future__ import annotations

from nanopaged.pooling.outputs import EmbeddingRequestOutput
from nanopaged.pooling_params import PoolingParams
from nanopaged.validation import per_prompt


def embed(llm, prompts, pooling_params=None, use_tqdm: bool = True, lora_request=None
          ) -> list[EmbeddingRequestOutput]:
    outputs = pool(llm, "LLM.embed", "embed", prompts, pooling_params, use_tqdm, lora_request)
    return [EmbeddingRequestOutput.from_output(o) for o in outputs]


def pool(llm, caller: str, task: str, prompts, pooling_params=None, use_tqdm: bool = True,
         lora_request=None) -> list:
    """Each prompt pooled for `task`, in order: the engine's PooledRequestOutputs (pooling/processors.py).
    A ValueError names `caller` when the LLM does not pool, or the task's own rule (pooling/config.py)."""
    engine = llm.llm_engine
    if engine.config.runner != "pooling":
        raise ValueError(f"{caller} needs a pooling model, and this LLM runs runner={engine.config.runner!r}: "
                         "load it with LLM(model, runner='pooling') (vLLM: --runner pooling)")
    if isinstance(prompts, (str, dict)):
        prompts = [prompts]
    if not isinstance(prompts, (list, tuple)):
        raise ValueError(f"prompts must be a prompt or a list of them, got {type(prompts).__name__}")
    if pooling_params is None:
        pooling_params = PoolingParams()
    if not isinstance(pooling_params, (PoolingParams, list, tuple)):
        raise ValueError(f"pooling_params must be a PoolingParams or a list of them, "
                         f"got {type(pooling_params).__name__}")
    params = per_prompt("PoolingParams", pooling_params, len(prompts))
    if not all(isinstance(p, PoolingParams) for p in params):
        raise ValueError("pooling_params must be a PoolingParams or a list of them")
    params = [p.for_task(task) for p in params]
    loras = per_prompt("lora_request", lora_request, len(prompts))
    with llm.one_call_at_a_time():
        requests = [engine.process_request(llm._new_request_id(), p, pp, lora_request=lora)
                    for p, pp, lora in zip(prompts, params, loras)]     # all checked before any is queued
        for samples in requests:
            engine.queue(samples)
        return llm._run([samples[0].request_id for samples in requests], use_tqdm)
