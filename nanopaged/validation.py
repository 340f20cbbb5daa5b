"""The one range check and its siblings, shared by every settings object; and one value per prompt.

EngineConfig, SamplingParams and BeamSearchParams all check their fields with these, so a
bad value reads the same wherever it is caught: the field's name, what is allowed, the value.
Plain Python with no imports from the package, so anything may use it without a circle.
"""
from __future__ import annotations

import math

SEED_RANGE = (-2**63, 2**64 - 1)    # what torch.Generator.manual_seed accepts
# Any integer a request may carry: what MessagePack (the engine core's socket) and torch's int64 hold
INT_RANGE = (-2**63, 2**64 - 1)
INT64_MAX = 2**63 - 1

def check_range(name: str, value, lo=None, hi=None, *, integer: bool = False, lo_open: bool = False,
                optional: bool = False) -> None:
    """The one range check: a ValueError that names the field, its range and the value.
    A number must be finite (NaN and infinities pass no comparison a kernel can trust)."""
    if value is None and optional:
        return
    if isinstance(value, bool) or not isinstance(value, int if integer else (int, float)):
        raise ValueError(f"{name} must be {'an integer' if integer else 'a number'}, got {value!r}")
    if not integer and not math.isfinite(value):
        raise ValueError(f"{name} must be a finite number, got {value!r}")
    if (lo is not None and (value <= lo if lo_open else value < lo)) or (hi is not None and value > hi):
        raise ValueError(f"{name} must be in {'(' if lo_open else '['}{'-inf' if lo is None else lo}, "
                         f"{'inf' if hi is None else hi}], got {value!r}")


def check_choice(name: str, value, choices: tuple) -> None:
    if value not in choices:
        raise ValueError(f"{name} must be one of {list(choices)}, got {value!r}")


def check_bool(name: str, value) -> None:
    if not isinstance(value, bool):
        raise ValueError(f"{name} must be True or False, got {value!r}")


def per_prompt(name: str, value, num_prompts: int) -> list:
    """One value for every prompt, or a list of one per prompt."""
    if not isinstance(value, (list, tuple)):
        return [value] * num_prompts
    if len(value) != num_prompts:
        raise ValueError(f"got {len(value)} {name} for {num_prompts} prompts; give one, or one per prompt")
    return list(value)


def encodes_as_utf8(text: str) -> bool:
    """False for a string holding a lone UTF-16 surrogate (JSON's "\\ud800" without its pair): not text."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True
