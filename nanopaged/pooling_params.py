"""PoolingParams: what one pooling request asks for, with vLLM's names (vllm/pooling_params.py).

The pooling extension (nanopaged/pooling/) reads it; every field is checked here, and what depends
on the model (`dimensions`, the task) when the request is processed. docs/04_scheduler.md, "Pooling".
"""
from __future__ import annotations

from dataclasses import dataclass, replace

from nanopaged.validation import check_bool, check_choice, check_range

# vLLM's pooling tasks and the parameters each takes (PoolingParams.valid_parameters)
TASK_PARAMETERS = {"embed": ("dimensions", "normalize"), "token_embed": ("dimensions", "normalize"),
                   "classify": ("use_activation",), "score": ("use_activation",),
                   "token_classify": ("use_activation",)}
TOKEN_TASKS = ("token_embed", "token_classify")     # one row per prompt token (vLLM's ALL pooling)


@dataclass
class PoolingParams:
    normalize: bool | None = None          # None: the model's own choice (its sentence-transformers config)
    dimensions: int | None = None          # keep the first d values (Matryoshka models only), then normalise
    truncate_prompt_tokens: int | None = None   # keep the prompt's last k tokens, as SamplingParams' field
    task: str | None = None                # one of TASK_PARAMETERS; None: the model's first (embed or classify)
    use_activation: bool | None = None     # a classifier's softmax / sigmoid; None: on

    def __post_init__(self) -> None:
        for name in ("normalize", "use_activation"):
            if getattr(self, name) is not None:
                check_bool(name, getattr(self, name))
        check_range("dimensions", self.dimensions, 1, integer=True, optional=True)
        if self.truncate_prompt_tokens != -1:
            check_range("truncate_prompt_tokens", self.truncate_prompt_tokens, 1, integer=True, optional=True)
        check_choice("task", self.task, (None, *TASK_PARAMETERS))

    def for_task(self, task: str) -> "PoolingParams":
        """A copy that runs `task` (vLLM's verify): a task already set must be this one, and no parameter
        of another task may be set."""
        if self.task is not None and self.task != task:
            raise ValueError(f"PoolingParams(task={self.task!r}) cannot run as task={task!r}")
        others = [name for name in ("dimensions", "normalize", "use_activation")
                  if getattr(self, name) is not None and name not in TASK_PARAMETERS[task]]
        if others:
            raise ValueError(f"task={task!r} takes {list(TASK_PARAMETERS[task])} only, not {others}")
        return replace(self, task=task)

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
