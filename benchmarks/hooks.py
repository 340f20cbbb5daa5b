"""Every place the bench reaches into the engine, in one module: a step observer for a while, the
drafter timed, the grammar manager. All through the engine's extension interface (docs/00_how_to_extend.md)."""
from __future__ import annotations

import time
from contextlib import contextmanager

from nanopaged.engine.extension import StepObserver
from nanopaged.spec_decode.extension import SpeculativeDecoding
from nanopaged.structured_output.extension import StructuredOutputs


@contextmanager
def observing(llm, observe):
    """`observe(step_record)` after every step of `llm`'s engine while the block runs."""
    watcher = llm.llm_engine.install(StepObserver(observe))
    try:
        yield observe
    finally:
        llm.llm_engine.remove(watcher)


@contextmanager
def timing_proposers(llm):
    """The seconds speculative decoding's drafter takes while the block runs: yields a one-item list
    (stays 0 on an engine without speculation)."""
    spec, spent = llm.llm_engine.find(SpeculativeDecoding), [0.0]
    if spec is None:
        yield spent
        return
    drafter = spec.drafter

    def timed(running):
        t = time.perf_counter()
        try:
            return drafter(running)
        finally:
            spent[0] += time.perf_counter() - t

    spec.drafter = timed            # the extension's own attribute, put back after the block
    try:
        yield spent
    finally:
        spec.drafter = drafter


def grammar_manager(llm):
    """Structured outputs' manager (installed now, as a request with a constraint would)."""
    return llm.llm_engine.extension(StructuredOutputs).manager
