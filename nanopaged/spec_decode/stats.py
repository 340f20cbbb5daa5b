"""Speculative decoding's counters, with vLLM's meanings (v1/spec_decode/metrics.py).

    num_drafts              verify steps of a request that had at least one draft
    num_draft_tokens        drafts verified
    num_accepted_tokens     drafts accepted
    accepted_per_pos[i]     verify steps whose draft i (0-based) was accepted
    mean_acceptance_length  1 + accepted / drafts: tokens a verify step emits, on average
    num_forced_draft_tokens     of the drafts, those the grammar forced (structured outputs)
    num_accepted_forced_tokens  of those, accepted
    acceptance              request id -> its method's recent acceptance rate (what the draft budget reads)
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable


@dataclass
class SpecDecodeStats:
    k: int
    num_drafts: int = 0
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    accepted_per_pos: list[int] = field(default_factory=list)
    num_forced_draft_tokens: int = 0
    num_accepted_forced_tokens: int = 0
    acceptance: Callable[[], dict[str, float]] = dict    # the draft budget's rates, read when asked

    def __post_init__(self) -> None:
        self.accepted_per_pos = self.accepted_per_pos or [0] * self.k

    def since(self, base: "SpecDecodeStats") -> "SpecDecodeStats":
        """The counts from `base` (a copy taken earlier: get_stats counts from the last reset_stats) to now."""
        return SpecDecodeStats(self.k, self.num_drafts - base.num_drafts, self.num_draft_tokens - base.num_draft_tokens,
                               self.num_accepted_tokens - base.num_accepted_tokens,
                               [a - b for a, b in zip(self.accepted_per_pos, base.accepted_per_pos)],
                               self.num_forced_draft_tokens - base.num_forced_draft_tokens,
                               self.num_accepted_forced_tokens - base.num_accepted_forced_tokens, self.acceptance)

    def copy(self) -> "SpecDecodeStats":
        return self.since(SpecDecodeStats(self.k))

    def record(self, drafts: int, accepted: int) -> None:
        if drafts == 0:
            return
        self.num_drafts += 1
        self.num_draft_tokens += drafts
        self.num_accepted_tokens += accepted
        for i in range(accepted):
            self.accepted_per_pos[i] += 1

    @property
    def mean_acceptance_length(self) -> float:
        return 1 + self.num_accepted_tokens / self.num_drafts if self.num_drafts else 0.0

    def as_dict(self) -> dict:
        return {"num_drafts": self.num_drafts, "num_draft_tokens": self.num_draft_tokens,
                "num_accepted_tokens": self.num_accepted_tokens, "accepted_per_pos": list(self.accepted_per_pos),
                "mean_acceptance_length": self.mean_acceptance_length,
                "draft_acceptance_rate": self.num_accepted_tokens / self.num_draft_tokens
                if self.num_draft_tokens else 0.0, **self.draft_figures()}

    def draft_figures(self) -> dict:
        """The drafter's own figures, beside vLLM's: forced drafts, and each request's acceptance rate."""
        return {"num_forced_draft_tokens": self.num_forced_draft_tokens,
                "num_accepted_forced_tokens": self.num_accepted_forced_tokens, "acceptance": self.acceptance()}
