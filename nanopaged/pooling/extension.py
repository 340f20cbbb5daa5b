"""Pooling: the extension that makes a causal LM's engine an embedding engine (vLLM: as_embedding_model).

Installed with the engine when `runner="pooling"`. Through the contract: the model pipeline's `head`
stage takes the output head off, so the "logits" are the hidden states (a classifier's `score` head goes
to the pooler, which applies it after pooling, as vLLM's does); `before_forward` has the runner
read out every row; the pooler takes the token-selection seat (wrap_token_selection replaces it); the
input and output processors take PoolingParams and give vectors. docs/04_scheduler.md, "Pooling".
"""
from __future__ import annotations

import itertools

from torch import nn

from nanopaged.engine.extension import Extension
from nanopaged.engine.overlap import without_async_scheduling
from nanopaged.models.pipeline import ModelStage
from nanopaged.pooling.config import check_pooling
from nanopaged.pooling.pooler import Pooler, read_every_row
from nanopaged.pooling_params import TOKEN_TASKS
from nanopaged.pooling.processors import PoolingInputProcessor, PoolingOutputProcessor


class Pooling(Extension):
    name = "pooling"

    @classmethod
    def check_config(cls, config) -> None:
        if config.runner != "generate" or config.pooler_config is not None or config.model_config.num_labels:
            check_pooling(config)         # resolves runner and pooler_config
        if config.runner == "pooling":
            without_async_scheduling(config, "runner='pooling'", "a pooling request ends with its prompt's step, so "
                                     "there is no next step of its own to schedule ahead")

    @classmethod
    def wanted(cls, config) -> bool:
        return config.runner == "pooling"

    def __init__(self, config) -> None:
        super().__init__(config)
        self.classifier: nn.Module | None = None     # a classifier's score head, taken by the head stage
        self.token_requests = itertools.count()      # a fresh prefix-cache key for each token task's request

    def model_stages(self) -> list[ModelStage]:
        return [ModelStage("head", self.take_head)]

    def take_head(self, model: nn.Module) -> nn.Module:
        """The model pipeline's `head` stage: the head comes off; a classifier's is kept for the pooler."""
        self.classifier = getattr(model, "score", None)
        return drop_head(model)

    def attach(self, engine) -> None:
        self.pooler = Pooler(self.config.pooler_config, self.classifier)
        self.engine = engine

    def block_hash_keys(self, request) -> tuple:
        """A token task needs every position's hidden state, and the cache keeps only K/V: a key of its own
        keeps its prompt off every cached block (vLLM: skip_reading_prefix_cache)."""
        if request.sampling_params.pooling_params.task in TOKEN_TASKS:
            return (f"pooling-all-{next(self.token_requests)}",)
        return ()

    def before_forward(self, scheduler_output, model_input) -> None:
        read_every_row(scheduler_output, model_input)

    def wrap_token_selection(self, selection):
        return self.pooler

    def input_processor(self, default):
        return PoolingInputProcessor(self.engine.config, self.engine.tokenizer, self.engine.runner.num_kv_blocks)

    def output_processor(self, default):
        return PoolingOutputProcessor(self.engine.tokenizer, self.pooler)


def drop_head(model: nn.Module) -> nn.Module:
    """The model pipeline's `head` stage: no head, so compute_logits returns the hidden states."""
    model.lm_head = nn.Identity()
    return model
