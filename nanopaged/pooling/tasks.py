"""LLM.classify, LLM.reward and LLM.encode: vLLM's other pooling calls, each the loop of pooling/embed.py
for its task (pooling/config.py says which tasks a model runs). docs/04_scheduler.md, "Pooling".

    classify   a classifier's class probabilities, pooled at the last token (ClassificationRequestOutput)
    reward     a classifier's scores for every prompt token (vLLM >= 0.11: the task token_classify),
               (tokens, num_labels), after the activation unless use_activation=False (PoolingRequestOutput)
    encode     any task the model runs, by name (vLLM's pooling_task), as PoolingRequestOutput
"""
from __future__ import annotations

from nanopaged.pooling.config import model_tasks
from nanopaged.pooling.embed import pool
from nanopaged.pooling.outputs import ClassificationRequestOutput, PoolingRequestOutput
from nanopaged.pooling_params import TASK_PARAMETERS, TOKEN_TASKS
from nanopaged.validation import check_choice


def classify(llm, prompts, pooling_params=None, use_tqdm: bool = True, lora_request=None
             ) -> list[ClassificationRequestOutput]:
    outputs = pool(llm, "LLM.classify", "classify", prompts, pooling_params, use_tqdm, lora_request)
    return [ClassificationRequestOutput.from_output(o) for o in outputs]


def reward(llm, prompts, pooling_params=None, use_tqdm: bool = True, lora_request=None
           ) -> list[PoolingRequestOutput]:
    outputs = pool(llm, "LLM.reward", "token_classify", prompts, pooling_params, use_tqdm, lora_request)
    return [PoolingRequestOutput.from_output(o, per_token=True) for o in outputs]


def encode(llm, prompts, pooling_params=None, use_tqdm: bool = True, lora_request=None,
           pooling_task: str | None = None) -> list[PoolingRequestOutput]:
    """`pooling_task`: None takes the params' task, else the model's first (embed, or classify)."""
    check_choice("pooling_task", pooling_task, (None, *TASK_PARAMETERS))
    if pooling_task is None:
        given = pooling_params if not isinstance(pooling_params, (list, tuple)) else (pooling_params or [None])[0]
        pooling_task = getattr(given, "task", None) or model_tasks(llm.llm_engine.config.model_config)[0]
    outputs = pool(llm, "LLM.encode", pooling_task, prompts, pooling_params, use_tqdm, lora_request)
    return [PoolingRequestOutput.from_output(o, per_token=pooling_task in TOKEN_TASKS) for o in outputs]

