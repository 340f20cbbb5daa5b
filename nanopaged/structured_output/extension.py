"""StructuredOutputs: the extension that keeps a request's tokens inside its constraint.

Installed the first time a request sets `SamplingParams.structured_outputs` (its request field). It
masks each step's logits (process_logits), ends a request whose grammar is complete (stop), and
offers the tokens a grammar forces as drafts (the ForcedDrafts capability, which the drafting
extension finds by type: spec_decode/drafter.py). The work is the manager's (manager.py).
"""
from __future__ import annotations

import torch

from nanopaged.core.request import Request
from nanopaged.engine.extension import Extension, ForcedDrafts
from nanopaged.structured_output.manager import StructuredOutputManager

INSTALL_HINT = "pip install -e '.[structured]'"


class StructuredOutputs(Extension, ForcedDrafts):
    name = "structured_outputs"
    request_fields = ("structured_outputs",)

    @classmethod
    def late_install(cls, config, fields: dict) -> bool:
        return True

    def attach(self, engine) -> None:
        """A ValueError, naming the extra, if xgrammar is not installed."""
        try:    # the optional `structured` extra: imported only when a request asks for it
            from nanopaged.structured_output.backend_xgrammar import XgrammarBackend
        except ImportError as e:
            raise ValueError(f"structured_outputs needs xgrammar, which is not installed ({e}): "
                             f"{INSTALL_HINT}") from None
        model = engine.config.model_config
        self.manager = StructuredOutputManager(XgrammarBackend(engine.tokenizer, model.vocab_size,
                                                               model.eos_token_ids),
                                               engine.config.reasoning_parser, engine.tokenizer)

    def prepare(self, samples: list[Request], fields: dict) -> None:
        self.manager.prepare(samples)         # compiled now (a ValueError if it cannot be), not in a step

    def process_logits(self, logits: torch.Tensor, requests: list[Request]) -> torch.Tensor:
        return self.manager(logits, requests)

    def stop(self, request: Request) -> bool:
        return self.manager.ended(request)

    def forget(self, request: Request) -> None:
        self.manager.forget(request)

    def forced_drafts(self, request: Request, most: int) -> list[int]:
        if request.sampling_params.structured_outputs is None:
            return []
        return self.manager.forced_drafts(request, most)

    def allowed_drafts(self, request: Request, forced: list[int], more: list[int]) -> list[int]:
        if request.sampling_params.structured_outputs is None:
            return more
        return self.manager.allowed_drafts(request, forced, more)
