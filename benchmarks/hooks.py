"""Every place the bench reaches into the engine's extension hooks, in one module, so a change of
those hooks is adapted here alone: a step observer for a while, the proposers timed, an extension."""
from __future__ import annotations

import time
from contextlib import contextmanager


@contextmanager
def observing(llm, observe):
    """`observe(step_record)` after every step of `llm`'s engine while the block runs."""
    engine = llm.llm_engine
    engine.observers.append(observe)
    try:
        yield observe
    finally:
        engine.observers.remove(observe)


@contextmanager
def timing_proposers(llm):
    """The seconds the engine's draft proposers take while the block runs: yields a one-item list."""
    engine, spent = llm.llm_engine, [0.0]

    def timed(propose):
        def wrapped(running):
            t = time.perf_counter()
            try:
                return propose(running)
            finally:
                spent[0] += time.perf_counter() - t
        return wrapped

    proposers = list(engine.proposers)
    engine.proposers[:] = [timed(p) for p in proposers]
    try:
        yield spent
    finally:
        engine.proposers[:] = proposers


def extension(llm, name: str):
    """The engine's extension registered under `name` (structured outputs' manager)."""
    return llm.llm_engine.extension(name)
