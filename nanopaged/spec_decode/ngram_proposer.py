"""The n-gram proposer (prompt lookup): guess that the text goes on as it went on before.

For n from `prompt_lookup_max` down to `prompt_lookup_min`, the request's last n tokens are looked
for in its prompt + output; at the earliest place they occur (before the end itself), the k tokens
that followed them there are the drafts. No model runs: it costs a search over the token ids, and
it pays where the output repeats its context (editing, summarising, code, quoting a source).
vLLM: v1/spec_decode/ngram_proposer.py.
"""
from __future__ import annotations

from nanopaged.core.request import Request


def propose_ngram(tokens: list[int], k: int, longest: int, shortest: int) -> list[int]:
    """Up to k tokens that followed the earliest earlier occurrence of the longest suffix of
    `tokens` of length in [shortest, longest]; [] if there is none."""
    for n in range(min(longest, len(tokens) - 1), shortest - 1, -1):
        suffix = tokens[-n:]
        first = suffix[0]
        end = len(tokens) - n               # an occurrence must start before the suffix itself
        at = _index(tokens, first, 0, end)
        while at is not None:
            if tokens[at:at + n] == suffix:
                return tokens[at + n:at + n + k]
            at = _index(tokens, first, at + 1, end)
    return []


def _index(tokens: list[int], value: int, start: int, end: int) -> int | None:
    try:
        return tokens.index(value, start, end)
    except ValueError:
        return None


class NgramProposer:
    """The engine's proposer (LLMEngine.proposers): after each step, drafts for every running
    request that decodes next."""

    def __init__(self, k: int, longest: int, shortest: int) -> None:
        self.k, self.longest, self.shortest = k, longest, shortest

    def __call__(self, running: list[Request]) -> None:
        for request in running:
            budget = draft_budget(request, self.k)
            if budget:
                request.spec_token_ids = propose_ngram(request.token_ids(0, request.num_tokens), budget,
                                                       self.longest, self.shortest)


def draft_budget(request: Request, k: int) -> int:
    """How many drafts a request can use next step: 0 unless it decodes next (its K/V is computed up
    to its last token) and is free to (no grammar to follow); never more than the tokens it may still
    emit less the one the step adds anyway (max_tokens, clipped to max_model_len)."""
    if request.num_computed_tokens != request.num_tokens - 1 or request.sampling_params.structured_outputs:
        return 0
    return max(0, min(k, request.max_tokens - request.num_output_tokens - 1))
