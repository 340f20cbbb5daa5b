"""Pooling: the extension that makes a causal LM's engine an embedding engine (vLLM: as_embedding_model).

Installed with the engine when `runner="pooling"`. Through the contract: the model pipeline's `head`
stage takes the output head off, so the "logits" are the hidden states; `before_forward` has the runner
read out every row; the pooler takes the token-selection seat (wrap_token_selection replaces it); the
input and output processors take PoolingParams and give vectors. docs/04_scheduler.md, "Pooling".
"""
from __future__ import annotations

from torch import nn

from nanopaged.engine.extension import Extension
from nanopaged.engine.overlap import without_async_scheduling
from nanopaged.models.pipeline import ModelStage
from nanopaged.pooling.config import check_pooling
from nanopaged.pooling.pooler import Pooler, read_every_row
from nanopaged.pooling.processors import PoolingInputProcessor, PoolingOutputProcessor


class Pooling(Extension):
    name = "pooling"

    @classmethod
    def check_config(cls, config) -> None:
        if config.runner != "generate" or config.pooler_config is not None:
            check_pooling(config)         # resolves runner and pooler_config
        if config.runner == "pooling":
            without_async_scheduling(config, "runner='pooling'", "a pooling request ends with its prompt's step, so "
                                     "there is no next step of its own to schedule ahead")

    @classmethod
    def wanted(cls, config) -> bool:
        return config.runner == "pooling"

    def model_stages(self) -> list[ModelStage]:
        return [ModelStage("head", drop_head)]

    def attach(self, engine) -> None:
        config = self.config.pooler_config
        self.pooler = Pooler(config.pooling_type, config.normalize)
        self.engine = engine

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
