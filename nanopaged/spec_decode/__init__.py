"""Speculative decoding: guess a request's next k tokens cheaply, verify them in one forward pass.

    extension.py          SpeculativeDecoding: how it attaches to the engine (engine/extension.py)
    config.py             SpeculativeConfig: `speculative_config={...}` with vLLM's names, checked at once
    ngram_proposer.py     drafts from the request's own tokens (prompt lookup)
    suffix_tree.py        suffix trees over token ids: what followed a context, and how often
    suffix_proposer.py    drafts from those trees: the request's own and finished requests' outputs
    draft_model.py        drafts from a smaller model that shares the tokenizer
    draft_budget.py       how many drafts each request gets a step: the step's cost, its acceptance rate
    drafter.py            the extension's one proposer: the grammar's forced drafts, then the method's
    stats.py              drafts, accepted tokens, mean acceptance length (vLLM's counters)

The core sees one number more: a request's `spec_token_ids`, which the scheduler adds to the
target that `num_computed_tokens` chases (`num_tokens_with_spec`) and rolls back off the counter
when drafts are rejected (core/scheduler.py: `_append`). The rejection sampler
(nanopaged/sample/rejection_sampler.py) decides which drafts to keep, so the output is what plain
decoding gives. docs/11_speculative_decoding.md.
"""
