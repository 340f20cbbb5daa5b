"""Speculative decoding: guess a request's next k tokens cheaply, verify them in one forward pass.

    config.py             SpeculativeConfig: `speculative_config={...}` with vLLM's names, checked at once
    ngram_proposer.py     drafts from the request's own tokens (prompt lookup)
    suffix_tree.py        suffix trees over token ids: what followed a context, and how often
    suffix_proposer.py    drafts from those trees: the request's own and finished requests' outputs
    draft_model.py        drafts from a smaller model that shares the tokenizer
    draft_budget.py       how many drafts each request gets a step: the step's cost, its acceptance rate
    drafter.py            the engine's one proposer: the grammar's forced drafts, then the method's
    stats.py              drafts, accepted tokens, mean acceptance length (vLLM's counters)

The core sees one number more: a request's `spec_token_ids`, which the scheduler adds to the
target that `num_computed_tokens` chases (`num_tokens_with_spec`) and rolls back off the counter
when drafts are rejected (core/scheduler.py: `_append`). The engine installs this module when
`speculative_config` is set (engine/llm_engine.py: CONFIG_EXTENSIONS): the proposer becomes one of
its `proposers` through the drafter, the rejection sampler (nanopaged/sample/rejection_sampler.py: which drafts to keep,
so the output is what plain decoding gives) its `token_selection`. Without a speculative config,
structured outputs install the drafter alone (`install_forced`): drafts the grammar forces, no method.
docs/11_speculative_decoding.md.
"""
from __future__ import annotations

from dataclasses import dataclass

from nanopaged.spec_decode.config import SpeculativeConfig
from nanopaged.spec_decode.stats import SpecDecodeStats


@dataclass
class SpecDecode:
    """What an engine with speculation holds (engine.extensions["nanopaged.spec_decode"])."""
    config: SpeculativeConfig | None       # None: forced drafts only (install_forced)
    stats: SpecDecodeStats
    proposer: object                       # the method's proposer (None without a config)
    drafter: object = None


def install(engine) -> SpecDecode:
    cfg: SpeculativeConfig = engine.config.speculative_config
    stats = SpecDecodeStats(cfg.num_speculative_tokens)
    if cfg.method == "ngram":
        from nanopaged.spec_decode.ngram_proposer import NgramProposer
        proposer, draft_probs = NgramProposer(cfg.num_speculative_tokens, cfg.prompt_lookup_max,
                                              cfg.prompt_lookup_min), None
    elif cfg.method == "suffix":
        from nanopaged.spec_decode.suffix_proposer import SuffixProposer
        proposer, draft_probs = SuffixProposer(cfg.num_speculative_tokens, cfg.suffix_decoding_max_tree_depth,
                                               cfg.suffix_decoding_max_cached_requests,
                                               cfg.suffix_decoding_max_spec_factor,
                                               cfg.suffix_decoding_min_token_prob), None
    else:
        from nanopaged.spec_decode.draft_model import DraftModelProposer
        proposer = DraftModelProposer(engine, cfg)
        draft_probs = proposer.draft_probs
    return _wire(engine, cfg, stats, proposer, draft_probs)


# Drafts a forced-only engine verifies a step, at most: a JSON key with its quotes and colon is a few tokens
FORCED_ONLY_K = 16


def install_forced(engine) -> SpecDecode:
    """Forced drafts without a speculative config: structured outputs call this when they install
    (structured_output/__init__.py) on an engine without speculation; it is then this extension."""
    return _wire(engine, None, SpecDecodeStats(FORCED_ONLY_K), None, None)


def _wire(engine, cfg, stats, proposer, draft_probs) -> SpecDecode:
    from nanopaged.sample.rejection_sampler import RejectionSampler
    from nanopaged.spec_decode.drafter import Drafter
    drafter = Drafter(engine, proposer, stats.k, stats)
    engine.token_selection = RejectionSampler(engine.token_selection, stats, draft_probs)
    engine.proposers.append(drafter)
    return SpecDecode(cfg, stats, proposer, drafter)


def of(engine) -> SpecDecode | None:
    """The engine's speculative decoding, or None."""
    return engine.extensions.get(__name__)
