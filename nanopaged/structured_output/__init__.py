"""Structured outputs: every token a request draws keeps its output inside a JSON schema, a regex,
a list of choices or a grammar (docs/10_structured_outputs.md).

    extension.py         StructuredOutputs: how it attaches to the engine (engine/extension.py)
    params.py            StructuredOutputsParams: the constraint, with vLLM's names (plain data)
    backend_types.py     what a backend does: compile, match, fill a step's bitmask
    backend_xgrammar.py  the xgrammar backend
    bitmask.py           a packed bitmask applied to a step's logits in one operation
    manager.py           the compiled grammars, a matcher per sequence

The engine installs the extension the first time a request sets `SamplingParams.structured_outputs`.
Needs the `structured` extra (`pip install -e '.[structured]'`: xgrammar), imported only then.
"""
