"""Decode tokens/s of one request, the rule every engine's single-stream figure is timed by."""
from __future__ import annotations

import itertools
import time
from typing import Callable

REPEATS = 3


def decode_tokens_per_s(generates: list[Callable[[int], object]], n: int) -> list[float]:
    """Each engine's best decode tokens/s over REPEATS rounds; `generate(tokens)` generates
    `tokens` tokens (ignoring EOS) from the prompt."""
    for generate in generates:
        generate(n)                              # warm-up
    best = [0.0] * len(generates)
    for _ in range(REPEATS):
        for i, generate in enumerate(generates):
            t0 = time.perf_counter()
            generate(1)
            t1 = time.perf_counter()
            generate(n)
            t2 = time.perf_counter()
            best[i] = max(best[i], tokens_per_s(n, t1 - t0, t2 - t1))
    return best


def uncached_decode_tokens_per_s(generate: Callable[[list, list], object], prompt: list[int], n: int) -> float:
    """decode_tokens_per_s of one request on an engine with prefix caching on (`generate(prompts, lens)`):
    each call's prompt starts with a token of its own, so none reuses the cache another call left."""
    first = itertools.count(100)

    def one(tokens: int) -> None:
        generate([[next(first)] + prompt[1:]], [tokens])
    return decode_tokens_per_s([one], n)[0]


def tokens_per_s(n: int, one_s: float, n_s: float) -> float:
    """(n - 1) decode tokens over the time n tokens take beyond one (the prefill's share cancels)."""
    return (n - 1) / max(n_s - one_s, 1e-9)
