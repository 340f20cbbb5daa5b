"""The n-gram proposer (prompt lookup): guess that the text goes on as it went on before.

For n from `prompt_lookup_max` down to `prompt_lookup_min`, the request's last n tokens are looked
for in its prompt + output; at the earliest place they occur (before the end itself), the k tokens
that followed them there are the drafts. No model runs: it costs a search over the token ids, and
it pays where the output repeats its context (editing, summarising, code, quoting a source).
vLLM: v1/spec_decode/ngram_proposer.py.
"""
from __future__ import annotations

from nanopaged.core.request import Request
from nanopaged.spec_decode.draft_budget import room


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
    """The method "ngram": the engine's drafter (drafter.py) asks `propose` for each request's drafts."""

    def __init__(self, k: int, longest: int, shortest: int) -> None:
        self.k, self.longest, self.shortest = k, longest, shortest

    def follow(self, running: list[Request]) -> None:
        """Nothing to keep: the drafts come from the tokens alone."""

    def forget(self, request: Request) -> None:
        """Nothing kept to drop."""

    def propose(self, todo: list[tuple[Request, int, list[int]]]) -> list[list[int]]:
        """(request, budget, before): up to `budget` drafts after the request's tokens and then `before`."""
        return [propose_ngram(r.token_ids(0, r.num_tokens) + before, budget, self.longest, self.shortest)
                for r, budget, before in todo]

    def __call__(self, running: list[Request]) -> None:
        draft_alone(self, running, self.k)


def draft_alone(method, running: list[Request], k: int) -> None:
    """A method alone, without the drafter (drafter.py), as the unit tests drive it: every running
    request that decodes next and follows no grammar drafts as much as it may."""
    method.follow(running)
    todo = [(r, b, []) for r in running if (b := draft_budget(r, k))]
    for (r, _, _), drafts in zip(todo, method.propose(todo)):
        r.spec_token_ids = drafts


def draft_budget(request: Request, k: int) -> int:
    """What a method alone may draft for a request: draft_budget.py's `room`, and nothing for a
    request with a grammar (its drafts go through the drafter, which checks them against it)."""
    return 0 if request.sampling_params.structured_outputs else room(request, k)
