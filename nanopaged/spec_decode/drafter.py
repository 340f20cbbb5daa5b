"""The drafter: the engine's one proposer. For each running request that decodes next, its drafts are

    1. the tokens its grammar forces (an extension offering the ForcedDrafts capability,
       engine/extension.py: structured outputs), then
    2. its method's drafts (n-gram, suffix, draft model) after them, as many as the draft budget
       grants (draft_budget.py), kept up to the first one the grammar refuses.

Each method proposer offers `propose([(request, budget, before)])`: up to `budget` drafts for each
request, continuing its tokens followed by `before` (the forced drafts). Without a speculative config
the drafter runs with no method at all (forced drafts only) for requests with structured outputs.
docs/11_speculative_decoding.md, "Drafts the grammar forces".
"""
from __future__ import annotations

from typing import Protocol

from nanopaged.core.request import Request
from nanopaged.engine.extension import ForcedDrafts
from nanopaged.spec_decode.draft_budget import DraftBudget, room


class DraftMethod(Protocol):
    """What each method's proposer offers the drafter (ngram_proposer, suffix_proposer, draft_model)."""

    def follow(self, running: list[Request]) -> None:
        """Every step, before `propose`: the running requests (forget those gone, catch up on tokens)."""

    def propose(self, todo: list[tuple[Request, int, list[int]]]) -> list[list[int]]:
        """(request, budget, before) -> up to `budget` drafts after its tokens and then `before`."""

    def forget(self, request: Request) -> None:
        """The request finished or was aborted: drop what is kept for it now."""


class Drafter:
    def __init__(self, engine, method: DraftMethod | None, k: int, stats) -> None:
        """`method`: the configured proposer, or None (forced drafts only); k: most drafts a step."""
        self.engine, self.method, self.k, self.stats = engine, method, k, stats
        self.budget = DraftBudget(stats)          # observes each step (the extension's `observe`)
        stats.acceptance = self.budget.rates

    def __call__(self, running: list[Request]) -> None:
        if self.method is not None:
            self.method.follow(running)
        grammar = self.engine.find(ForcedDrafts)        # an extension that knows forced tokens, if installed
        wanted, forced_of = [], []
        for request in running:
            most = room(request, self.k)
            if not most:
                continue
            forced = grammar.forced_drafts(request, most) if grammar is not None else []
            if self.method is None and not forced:
                continue
            wanted.append((request, len(forced), 0 if self.method is None else most - len(forced)))
            forced_of.append(forced)
        if not wanted:
            return
        plain = len(self.engine.scheduler.running) + sum(n for _, n, _ in wanted)
        budgets = self.budget.plan(wanted, plain)
        todo = [(r, b, forced) for (r, _, _), b, forced in zip(wanted, budgets, forced_of) if b]
        drafted = dict(zip([r for r, _, _ in todo], self.method.propose(todo))) if todo else {}
        for (request, _, _), forced in zip(wanted, forced_of):
            more = drafted.get(request, [])
            if more and grammar is not None:
                more = grammar.allowed_drafts(request, forced, more)
            request.spec_token_ids = forced + more
            if request.spec_token_ids:
                self.budget.drafted[request] = len(forced)
                self.stats.num_forced_draft_tokens += len(forced)
