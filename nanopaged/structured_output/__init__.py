"""Structured outputs: every token a request draws keeps its output inside a JSON schema, a regex,
a list of choices or a grammar (docs/10_structured_outputs.md).

    params.py            StructuredOutputsParams: the constraint, with vLLM's names (plain data)
    backend_types.py     what a backend does: compile, match, fill a step's bitmask
    backend_xgrammar.py  the xgrammar backend
    bitmask.py           a packed bitmask applied to a step's logits in one operation
    manager.py           the compiled grammars, a matcher per sequence, the engine's hooks

Nothing here is imported until a request sets `SamplingParams.structured_outputs`; the engine then
calls `install` once (engine/llm_engine.py: FIELD_EXTENSIONS). Needs the `structured` extra
(`pip install -e '.[structured]'`: xgrammar).
"""
from __future__ import annotations

INSTALL_HINT = "pip install -e '.[structured]'"
# Without a speculative config, verify the drafts a grammar forces anyway (spec_decode: install_forced):
# the output is the same, in fewer steps (docs/11_speculative_decoding.md, "Drafts the grammar forces").
FORCED_DRAFTS = True
SPEC_DECODE = "nanopaged.spec_decode"


def install(engine):
    """Hook structured outputs into an engine: the manager becomes a logits processor of its sampler
    and a stop rule of check_stop; on an engine without speculation, forced drafts come with it (the
    drafter and the rejection sampler). A ValueError, naming the extra, if xgrammar is not installed."""
    try:
        from nanopaged.structured_output.backend_xgrammar import XgrammarBackend
    except ImportError as e:
        raise ValueError(f"structured_outputs needs xgrammar, which is not installed ({e}): "
                         f"{INSTALL_HINT}") from None
    from nanopaged.structured_output.manager import StructuredOutputManager
    model = engine.config.model_config
    manager = StructuredOutputManager(XgrammarBackend(engine.tokenizer, model.vocab_size, model.eos_token_ids))
    engine.add_logits_processor(manager)
    engine.add_stop_rule(manager.ended)
    if FORCED_DRAFTS and SPEC_DECODE not in engine.extensions and engine.config.speculative_config is None:
        from nanopaged.spec_decode import install_forced
        engine.extensions[SPEC_DECODE] = install_forced(engine)
    return manager
