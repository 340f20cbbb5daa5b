"""SpeculativeDecoding: the extension that drafts tokens and verifies them in one forward pass.

Installed with the engine when `speculative_config` is set (`wanted`), and otherwise by the first
request with structured outputs (its request field), for the drafts a grammar forces alone
(`FORCED_DRAFTS`). Through the contract it wraps the engine's token selection in the rejection
sampler (sample/rejection_sampler.py: which drafts to keep, so the output is what plain decoding
gives), proposes each step's drafts (drafter.py), lets the draft budget observe each step's cost, and
reports vLLM's counters (stats.py). docs/11_speculative_decoding.md.
"""
from __future__ import annotations

from nanopaged.config import check_model_folder
from nanopaged.core.request import Request
from nanopaged.engine.extension import Extension
from nanopaged.sample.rejection_sampler import RejectionSampler
from nanopaged.spec_decode.config import SpeculativeConfig
from nanopaged.spec_decode.draft_model import DraftModelProposer
from nanopaged.engine.overlap import without_async_scheduling
from nanopaged.spec_decode.drafter import Drafter
from nanopaged.spec_decode.ngram_proposer import NgramProposer
from nanopaged.spec_decode.stats import SpecDecodeStats
from nanopaged.spec_decode.suffix_proposer import SuffixProposer

# Without a speculative config, verify the drafts a grammar forces anyway: the output is the same, in
# fewer steps (docs/11_speculative_decoding.md, "Drafts the grammar forces"); False turns that off.
FORCED_DRAFTS = True
# Drafts a forced-only engine verifies a step, at most: a JSON key with its quotes and colon is a few tokens
FORCED_ONLY_K = 16


class SpeculativeDecoding(Extension):
    name = "spec_decode"
    request_fields = ("structured_outputs",)

    @classmethod
    def check_config(cls, config) -> None:
        """`speculative_config={...}` with vLLM's names, checked (its draft model's folder too) before any weight loads."""
        if config.speculative_config is not None:
            without_async_scheduling(config, "speculative_config", "a step's drafts are guessed from the tokens of "
                                     "the step before, which are not known when async scheduling schedules it")
        if config.speculative_config is not None and not isinstance(config.speculative_config, SpeculativeConfig):
            config.speculative_config = SpeculativeConfig.from_dict(config.speculative_config, config,
                                                                    check_model_folder)

    @classmethod
    def wanted(cls, config) -> bool:
        return config.speculative_config is not None

    @classmethod
    def late_install(cls, config, fields: dict) -> bool:
        # asked for by name, async scheduling keeps overlapping and no drafts are forced; unset, the steps
        # run one at a time from the first structured request on, and drafts are forced (the greater gain)
        return FORCED_DRAFTS and config.async_scheduling is not True

    def __init__(self, config) -> None:
        super().__init__(config)
        self.spec: SpeculativeConfig | None = config.speculative_config     # None: forced drafts only
        self.counts = SpecDecodeStats(FORCED_ONLY_K if self.spec is None else self.spec.num_speculative_tokens)
        self.base = self.counts.copy()
        self.proposer, self.draft_probs = None, None

    def attach(self, engine) -> None:
        spec = self.spec
        if spec is not None and spec.method == "ngram":
            self.proposer = NgramProposer(spec.num_speculative_tokens, spec.prompt_lookup_max, spec.prompt_lookup_min)
        elif spec is not None and spec.method == "suffix":
            self.proposer = SuffixProposer(spec.num_speculative_tokens, spec.suffix_decoding_max_tree_depth,
                                           spec.suffix_decoding_max_cached_requests,
                                           spec.suffix_decoding_max_spec_factor, spec.suffix_decoding_min_token_prob,
                                           spec.suffix_decoding_max_cached_tokens)
        elif spec is not None:
            self.proposer = DraftModelProposer(engine, spec)
            self.draft_probs = self.proposer.draft_probs
        self.drafter = Drafter(engine, self.proposer, self.counts.k, self.counts)
        self.budget = self.drafter.budget

    def wrap_token_selection(self, selection):
        return RejectionSampler(selection, self.counts, self.draft_probs)

    def observe(self, record) -> None:
        self.budget(record)

    def propose(self, running: list[Request]) -> None:
        self.drafter(running)

    def forget(self, request: Request) -> None:
        if self.proposer is not None:     # a suffix tree, a draft model's bookkeeping: dropped at once
            self.proposer.forget(request)

    def stats(self) -> dict:
        """Drafts, draft tokens, accepted tokens (per position), mean acceptance length, since the last reset."""
        return self.counts.since(self.base).as_dict()

    def reset_stats(self) -> None:
        self.base = self.counts.copy()

    def counters(self) -> dict[str, tuple[str, int | list[int]]]:
        """vLLM's four counters."""
        c = self.counts
        return {"spec_decode_num_drafts": ("Verify steps of a request with drafts.", c.num_drafts),
                "spec_decode_num_draft_tokens": ("Draft tokens verified.", c.num_draft_tokens),
                "spec_decode_num_accepted_tokens": ("Draft tokens accepted.", c.num_accepted_tokens),
                "spec_decode_num_accepted_tokens_per_pos": ("Draft tokens accepted, by position.",
                                                            list(c.accepted_per_pos))}

    def progress(self) -> str:
        return f"accepted {self.counts.since(self.base).mean_acceptance_length:.2f}/step"
