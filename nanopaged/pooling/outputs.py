"""What `LLM.embed` returns: vLLM's EmbeddingRequestOutput and EmbeddingOutput (vllm/outputs.py), plain records."""
from __future__ import annotations

from dataclasses import dataclass


@dataclass
class EmbeddingOutput:
    embedding: list[float]

    @property
    def hidden_size(self) -> int:
        return len(self.embedding)


@dataclass
class EmbeddingRequestOutput:
    request_id: str
    outputs: EmbeddingOutput
    prompt_token_ids: list[int]
    finished: bool = True
    num_cached_tokens: int = 0      # prompt tokens whose K/V came from the prefix cache (LAST pooling only)

    @classmethod
    def from_output(cls, output) -> "EmbeddingRequestOutput":
        """From the engine's PooledRequestOutput (nanopaged/pooling/processors.py)."""
        return cls(output.request_id, EmbeddingOutput(output.pooled.tolist()), output.prompt_token_ids,
                   output.finished, output.num_cached_tokens)
