"""The xgrammar backend: grammars compiled against the model's vocabulary, matchers, bitmasks.

xgrammar (Dong et al., "XGrammar", arXiv:2411.15100) turns a JSON schema, a regex or an EBNF grammar
into a pushdown automaton and precomputes, for each of its states, which tokens of the vocabulary
are always, never or sometimes allowed; a step's mask then checks only the few "sometimes" tokens.
So compiling is the slow part (milliseconds to seconds) and a mask is cheap (microseconds).
Its errors are C++ messages with a timestamp and a source line in front; they come out of here as
ValueErrors with only the message. vLLM: vllm/v1/structured_output/backend_xgrammar.py.
"""
from __future__ import annotations

import os
import re

import torch
import xgrammar as xgr

from nanopaged.structured_output.backend_types import GrammarMatcher, StructuredOutputBackend

# "[22:43:31] /project/cpp/regex_converter.cc:83: " and "Check failed: (...) is false: " in front of the message
CPP_NOISE = re.compile(r"^\s*\[[\d:]+\] [^:\s]+:\d+: |Check failed: \(.*?\) is false: ")


class XgrammarMatcher(GrammarMatcher):
    def __init__(self, matcher: xgr.GrammarMatcher) -> None:
        self.matcher = matcher

    def accept_token(self, token_id: int) -> bool:
        return self.matcher.accept_token(token_id)

    def is_terminated(self) -> bool:
        return self.matcher.is_terminated()

    def rollback(self, num_tokens: int) -> None:
        if num_tokens:
            self.matcher.rollback(num_tokens)

    def fill_row(self, bitmask: torch.Tensor, row: int) -> None:
        self.matcher.fill_next_token_bitmask(bitmask, row)

    def forced_text(self) -> str:
        return self.matcher.find_jump_forward_string()


class XgrammarBackend(StructuredOutputBackend):
    def __init__(self, tokenizer, vocab_size: int, stop_token_ids: list[int]) -> None:
        """`vocab_size`: the model's (its logits' width), which may differ from the tokenizer's;
        `stop_token_ids`: the tokens that end a complete output (the model's EOS ids)."""
        self.vocab_size = vocab_size
        self.tokenizer = tokenizer
        try:
            info = xgr.TokenizerInfo.from_huggingface(tokenizer, vocab_size=vocab_size,
                                                      stop_token_ids=sorted(stop_token_ids) or None)
        except Exception as e:        # a tokenizer it cannot read raises whatever its parser does
            raise ValueError(f"structured_outputs: xgrammar cannot read this model's tokenizer "
                             f"({type(tokenizer).__name__}): {clean(e)}") from None
        # No cache of xgrammar's own: the manager caches by the constraint's text (one cache to explain).
        self.compiler = xgr.GrammarCompiler(info, max_threads=2, cache_enabled=False)
        self.batch = xgr.BatchGrammarMatcher(min(8, os.cpu_count() or 1))   # the step waits: use every core

    def compile_grammar(self, kind: str, text: str, any_whitespace: bool) -> xgr.CompiledGrammar:
        try:
            if kind == "json":
                compiled = self.compiler.compile_json_schema(text, any_whitespace=any_whitespace)
            elif kind == "regex":
                compiled = self.compiler.compile_regex(text)
            elif "::=" in text:            # EBNF's rule sign; Lark writes `rule: ...`
                compiled = self.compiler.compile_grammar(text)
            else:
                compiled = self.compiler.compile_lark(text)
        except Exception as e:             # xgrammar raises RuntimeError (and a few others) for bad input
            raise ValueError(clean(e)) from None
        if not self._can_start(compiled):
            raise ValueError("it matches no text at all: no token, not even the end, can come first")
        return compiled

    def _can_start(self, compiled: xgr.CompiledGrammar) -> bool:
        """Whether any token (the stop token included) may come first: a regex such as [^\\x00-\\U0010FFFF]
        compiles, but a request under it could draw nothing."""
        bitmask = xgr.allocate_token_bitmask(1, self.vocab_size)
        xgr.GrammarMatcher(compiled).fill_next_token_bitmask(bitmask)
        return bool(bitmask.any())

    def encode(self, text: str) -> list[int]:
        return self.tokenizer.encode(text, add_special_tokens=False)

    def matcher(self, compiled: xgr.CompiledGrammar) -> XgrammarMatcher:
        # max_rollback_tokens=-1 (xgrammar's default): any number of accepted tokens can be undone
        return XgrammarMatcher(xgr.GrammarMatcher(compiled, max_rollback_tokens=-1))

    def fill_bitmask(self, matchers: list[XgrammarMatcher], bitmask: torch.Tensor) -> None:
        # One call for the whole step: xgrammar fills the rows on its own threads (one per core).
        self.batch.batch_fill_next_token_bitmask([m.matcher for m in matchers], bitmask)


def clean(error: Exception) -> str:
    """xgrammar's message without its C++ prefix, on one line."""
    return " ".join(CPP_NOISE.sub("", str(error)).split()) or type(error).__name__
