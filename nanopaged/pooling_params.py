"""PoolingParams: what one embedding request asks for, with vLLM's names (vllm/pooling_params.py).

The pooling extension (nanopaged/pooling/) reads it; every field is checked here, and what depends
on the model (`dimensions`) when the request is processed. docs/04_scheduler.md, "Pooling".
"""
from __future__ import annotations

from dataclasses import dataclass

from nanopaged.validation import check_bool, check_choice, check_range


@dataclass
class PoolingParams:
    normalize: bool | None = None          # None: the model's own choice (its sentence-transformers config)
    dimensions: int | None = None          # keep the first d values (Matryoshka models only), then normalise
    truncate_prompt_tokens: int | None = None   # keep the prompt's last k tokens, as SamplingParams' field
    task: str | None = None                # vLLM's; "embed" is the one pooling task nanopaged runs

    def __post_init__(self) -> None:
        if self.normalize is not None:
            check_bool("normalize", self.normalize)
        check_range("dimensions", self.dimensions, 1, integer=True, optional=True)
        if self.truncate_prompt_tokens != -1:
            check_range("truncate_prompt_tokens", self.truncate_prompt_tokens, 1, integer=True, optional=True)
        check_choice("task", self.task, (None, "embed"))

    def verify(self, hidden_size: int, matryoshka_dimensions: list[int] | None) -> None:
        """`dimensions` only where the model was trained for shorter vectors (vLLM's rule): elsewhere
        the first d values of an embedding are no embedding of their own."""
        if self.dimensions is None:
            return
        if matryoshka_dimensions is None:
            raise ValueError(f"dimensions={self.dimensions} is not supported by this model: it was not trained "
                             "for Matryoshka (shorter) embeddings (its config.json sets no is_matryoshka or "
                             "matryoshka_dimensions)")
        allowed = matryoshka_dimensions or list(range(1, hidden_size + 1))
        if self.dimensions not in allowed:
            raise ValueError(f"dimensions={self.dimensions} is not one this model was trained for: "
                             f"{allowed if matryoshka_dimensions else f'1 to {hidden_size}'}")
