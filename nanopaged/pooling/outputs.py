"""What the pooling calls return: vLLM's output records (vllm/outputs.py), plain records.

    LLM.embed      EmbeddingRequestOutput       outputs.embedding: list[float]
    LLM.classify   ClassificationRequestOutput  outputs.probs: list[float], one per class
    LLM.reward     PoolingRequestOutput         outputs.data: a tensor, (prompt tokens, num_labels)
    LLM.encode     PoolingRequestOutput         outputs.data: the task's vector, or a token task's rows
    LLM.score      ScoringRequestOutput         outputs.score: float
"""
from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class EmbeddingOutput:
    embedding: list[float]

    @property
    def hidden_size(self) -> int:
        return len(self.embedding)


@dataclass
class ClassificationOutput:
    probs: list[float]              # after the activation (softmax, or sigmoid for one label), unless turned off

    @property
    def num_classes(self) -> int:
        return len(self.probs)


@dataclass
class PoolingOutput:
    data: torch.Tensor


@dataclass
class ScoringOutput:
    score: float


@dataclass
class PoolingRequestOutput:
    request_id: str
    outputs: PoolingOutput
    prompt_token_ids: list[int]
    finished: bool = True
    num_cached_tokens: int = 0      # prompt tokens whose K/V came from the prefix cache (LAST pooling only)

    @classmethod
    def from_output(cls, output, per_token: bool = False) -> "PoolingRequestOutput":
        """From the engine's PooledRequestOutput (nanopaged/pooling/processors.py), its flat vector as
        the task gave it; `per_token`: a token task's, one row per prompt token."""
        data = output.pooled.view(len(output.prompt_token_ids), -1) if per_token else output.pooled
        return cls(output.request_id, cls.wrap(data), output.prompt_token_ids, output.finished,
                   output.num_cached_tokens)

    @staticmethod
    def wrap(data: torch.Tensor) -> PoolingOutput:      # the task's result as `outputs` holds it
        return PoolingOutput(data)


@dataclass
class EmbeddingRequestOutput(PoolingRequestOutput):
    outputs: EmbeddingOutput

    @staticmethod
    def wrap(data: torch.Tensor) -> EmbeddingOutput:
        return EmbeddingOutput(data.tolist())


@dataclass
class ClassificationRequestOutput(PoolingRequestOutput):
    outputs: ClassificationOutput

    @staticmethod
    def wrap(data: torch.Tensor) -> ClassificationOutput:
        return ClassificationOutput(data.tolist())


@dataclass
class ScoringRequestOutput(PoolingRequestOutput):
    outputs: ScoringOutput
