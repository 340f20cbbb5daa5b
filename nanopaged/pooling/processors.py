"""A pooling engine's way in and way out: PoolingParams in, the pooled vector out with the output.

    PoolingInputProcessor   takes PoolingParams where a generating engine takes SamplingParams (and
                            refuses those, naming the runner); the request runs with `PrefillOnly`
    PoolingOutputProcessor  hands each finished request's vector out with its RequestOutput
                            (`PooledRequestOutput`), so the server's loop and metrics see the record
                            they know; LLM.embed and /v1/embeddings make vLLM's EmbeddingRequestOutput of it
"""
from __future__ import annotations

from dataclasses import dataclass, fields

import torch

from nanopaged.engine.input_processor import InputProcessor
from nanopaged.engine.output_processor import OutputProcessor
from nanopaged.outputs import RequestOutput
from nanopaged.pooling.config import check_task, model_tasks
from nanopaged.pooling.pooler import Pooler
from nanopaged.pooling_params import PoolingParams
from nanopaged.sampling_params import RequestOutputKind, SamplingParams

NOT_GENERATING = ("this engine runs runner='pooling': it pools (LLM.embed, classify, reward, score; /v1/embeddings, "
                  "/classify, /pooling, /score, /rerank) and does not generate text; load the model with "
                  "runner='generate' (vLLM: --runner generate) to generate")


@dataclass
class PrefillOnly(SamplingParams):
    """What a pooling request runs with: its prompt, then one placeholder token that ends it (no text)."""
    pooling_params: PoolingParams | None = None


@dataclass
class PooledRequestOutput(RequestOutput):
    # float32, on the CPU, one flat vector: (hidden_size,), (dimensions,) or (num_labels,); a token task's rows
    # one after another, len(prompt_token_ids) of them (so the record and the wire keep one shape)
    pooled: torch.Tensor | None = None


class PoolingInputProcessor(InputProcessor):
    prefill_only = True           # a prompt of max_model_len tokens fits: nothing is generated after it (as vLLM)

    def __init__(self, config, tokenizer, num_kv_blocks: int) -> None:
        super().__init__(config, tokenizer, num_kv_blocks)
        pooler = config.pooler_config
        self.hidden_size, self.matryoshka_dimensions = config.model_config.hidden_size, pooler.matryoshka_dimensions
        self.model_config = config.model_config

    def process(self, request_id: str, prompt, params=None):
        params = params if params is not None else PoolingParams()
        if not isinstance(params, PoolingParams):
            raise ValueError(f"{NOT_GENERATING} (got {type(params).__name__})")
        params = params.for_task(params.task or model_tasks(self.model_config)[0])
        check_task(params.task, self.model_config)
        params.verify(self.hidden_size, self.matryoshka_dimensions)
        return super().process(request_id, prompt, PrefillOnly(
            max_tokens=1, detokenize=False, output_kind=RequestOutputKind.FINAL_ONLY,
            truncate_prompt_tokens=params.truncate_prompt_tokens, pooling_params=params))


class PoolingOutputProcessor(OutputProcessor):
    def __init__(self, tokenizer, pooler: Pooler) -> None:
        super().__init__(tokenizer)
        self.pooler = pooler

    def process(self, sampled, prompt_logits=()):
        outputs, stopped = super().process(sampled, prompt_logits)
        return [self._with_vector(o) for o in outputs], stopped

    def _with_vector(self, output: RequestOutput) -> RequestOutput:
        pooled = self.pooler.finished.pop(output.request_id, None)
        if pooled is None:
            return output
        return PooledRequestOutput(**{f.name: getattr(output, f.name) for f in fields(output)}, pooled=pooled)
