"""SamplingParams: how one request picks its next tokens, with vLLM's names and defaults.

Plain data, no torch: the scheduler reads `max_tokens` and `ignore_eos`, the runner's
sampler reads `temperature` and `seed`. Every value a user can get wrong is checked here,
when the object is built, so a bad value fails before any work is done.
"""
from __future__ import annotations

from dataclasses import dataclass


@dataclass
class SamplingParams:
    n: int = 1
    temperature: float = 1.0      # 0 means greedy (argmax), as in vLLM
    max_tokens: int | None = 16   # None: up to the context length (vLLM's meaning)
    ignore_eos: bool = False      # keep generating past EOS (benchmarks use this)
    seed: int | None = None       # per-request generator: same output whatever the batch

    def __post_init__(self) -> None:
        if not isinstance(self.n, int) or self.n != 1:
            # Parallel sampling (n > 1, forked blocks with copy-on-write) is not built yet.
            raise ValueError(f"n must be 1 in this version, got {self.n!r}")
        if not isinstance(self.temperature, (int, float)) or self.temperature < 0:
            raise ValueError(f"temperature must be >= 0 (0 = greedy), got {self.temperature!r}")
        if self.max_tokens is not None and (not isinstance(self.max_tokens, int)
                                            or isinstance(self.max_tokens, bool)
                                            or self.max_tokens < 1):
            raise ValueError(f"max_tokens must be an integer >= 1 or None, got {self.max_tokens!r}")
        if self.seed is not None and (not isinstance(self.seed, int) or isinstance(self.seed, bool)):
            raise ValueError(f"seed must be an integer or None, got {self.seed!r}")
        self.temperature = float(self.temperature)

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0
