"""What a structured-output backend does for the engine: four operations, whatever library it wraps.

    compile_grammar   a constraint's text -> a compiled grammar (slow: done once per text, off the step)
    matcher           a compiled grammar -> a matcher: one sequence's place in the grammar (cheap)
    fill_bitmask      every constrained row of a step: which tokens may come next, as packed bits
    GrammarMatcher    accept_token (advance, False if the grammar forbids it), is_terminated; for drafts
                      (speculative decoding) rollback, fill_row and forced_text

The bitmask packs the vocabulary 32 tokens to an int32: bit j of word w is token 32 * w + j, 1 if it
may come next (bitmask.py applies it). xgrammar is the backend (backend_xgrammar.py); llguidance or
outlines-core would be a class beside it. vLLM: vllm/v1/structured_output/backend_types.py.
"""
from __future__ import annotations

from abc import ABC, abstractmethod

import torch


class GrammarMatcher(ABC):
    @abstractmethod
    def accept_token(self, token_id: int) -> bool:
        """Advance by one token; False (and no change) if the grammar does not allow it here."""

    @abstractmethod
    def is_terminated(self) -> bool:
        """The grammar has reached its end: it accepted its stop token (EOS) after a complete output."""

    @abstractmethod
    def rollback(self, num_tokens: int) -> None:
        """Undo the last `num_tokens` accepted tokens (drafts tried on the matcher go back this way)."""

    @abstractmethod
    def fill_row(self, bitmask: torch.Tensor, row: int) -> None:
        """Row `row` of `bitmask` gets the tokens that may come next from where the matcher is."""

    @abstractmethod
    def forced_text(self) -> str:
        """The longest text every output allowed from here goes on with ("" if the next character is free)."""


class StructuredOutputBackend(ABC):
    vocab_size: int                     # the model's vocabulary: the width of the bitmask, in bits

    @abstractmethod
    def compile_grammar(self, kind: str, text: str, any_whitespace: bool) -> object:
        """kind: "json" (a schema's text), "regex" or "grammar"; a ValueError says what is wrong."""

    @abstractmethod
    def encode(self, text: str) -> list[int]:
        """The model's tokens for a piece of output text (no special tokens added)."""

    @abstractmethod
    def matcher(self, compiled: object) -> GrammarMatcher:
        """A new matcher at the start of the grammar."""

    @abstractmethod
    def fill_bitmask(self, matchers: list[GrammarMatcher], bitmask: torch.Tensor) -> None:
        """Row i of `bitmask` (int32, (len(matchers), ceil(vocab_size / 32))) gets matchers[i]'s next tokens."""
