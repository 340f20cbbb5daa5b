"""SamplingParams: how one request picks its next tokens, with vLLM's names and defaults.

Plain data, no torch. Every value a user can get wrong is checked here, when the object is
built (with the one range check, `nanopaged/validation.py: check_range`), so a bad value fails
with the field's name and its allowed range before any work. The README's API section
lists the fields.
"""
from __future__ import annotations

import warnings
from dataclasses import dataclass

from nanopaged.validation import SEED_RANGE, check_bool, check_range

MAX_LOGPROBS = 20     # vLLM's default max_logprobs
MIN_TEMPERATURE = 0.01   # vLLM's _MAX_TEMP: below it, float32 logits / T overflow into NaN
MAX_TOP_K = 2**63 - 1    # the sampler keeps k in an int64 tensor


@dataclass
class SamplingParams:
    n: int = 1                             # samples per prompt; they share the prompt's blocks
    temperature: float = 1.0               # 0 means greedy (argmax)
    top_p: float = 1.0                     # keep the smallest set of tokens with this much mass
    top_k: int = 0                         # keep the k most likely tokens; 0 or -1: all
    min_p: float = 0.0                     # drop tokens below min_p x the top token's probability
    seed: int | None = None                # per-request generator: same output whatever the batch
    stop: str | list[str] | None = None    # stop strings, found in the detokenized text
    stop_token_ids: list[int] | None = None
    include_stop_str_in_output: bool = False
    ignore_eos: bool = False               # keep generating past EOS (benchmarks use this)
    max_tokens: int | None = 16            # None: up to the context length
    min_tokens: int = 0                    # EOS and stop tokens/strings are ignored until then
    logprobs: int | None = None            # top-k logprobs per generated token (+ the chosen one)
    prompt_logprobs: int | None = None     # top-k logprobs per prompt token (+ the actual one)
    presence_penalty: float = 0.0          # subtract once from tokens already generated
    frequency_penalty: float = 0.0         # subtract per occurrence in the generated tokens
    repetition_penalty: float = 1.0        # divide (>0 logits) / multiply (<0) for seen tokens
    skip_special_tokens: bool = True

    def __post_init__(self) -> None:
        check_range("n", self.n, 1, integer=True)
        check_range("temperature", self.temperature, 0.0)
        check_range("top_p", self.top_p, 0.0, 1.0, lo_open=True)
        check_range("top_k", self.top_k, -1, MAX_TOP_K, integer=True)
        check_range("min_p", self.min_p, 0.0, 1.0)
        check_range("seed", self.seed, *SEED_RANGE, integer=True, optional=True)
        if self.seed is not None and self.n > 1:    # sample i draws with seed + i
            check_range("seed + n - 1", self.seed + self.n - 1, *SEED_RANGE, integer=True)
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        if self.stop is not None and not isinstance(self.stop, (list, tuple)):
            raise ValueError(f"stop must be a string or a list of strings, got {self.stop!r}")
        self.stop = list(self.stop or [])
        if not all(isinstance(s, str) and s for s in self.stop):
            raise ValueError(f"stop must be a non-empty string or a list of them, got {self.stop!r}")
        if self.stop_token_ids is not None and not isinstance(self.stop_token_ids, (list, tuple)):
            raise ValueError(f"stop_token_ids must be a list of token ids, got {self.stop_token_ids!r}")
        self.stop_token_ids = list(self.stop_token_ids or [])
        for t in self.stop_token_ids:
            check_range("stop_token_ids[i]", t, 0, integer=True)
        check_range("max_tokens", self.max_tokens, 1, integer=True, optional=True)
        check_range("min_tokens", self.min_tokens, 0, integer=True)
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            raise ValueError(f"min_tokens must be <= max_tokens={self.max_tokens}, got {self.min_tokens}")
        check_range("logprobs", self.logprobs, 0, MAX_LOGPROBS, integer=True, optional=True)
        check_range("prompt_logprobs", self.prompt_logprobs, 0, MAX_LOGPROBS, integer=True, optional=True)
        check_range("presence_penalty", self.presence_penalty, -2.0, 2.0)
        check_range("frequency_penalty", self.frequency_penalty, -2.0, 2.0)
        check_range("repetition_penalty", self.repetition_penalty, 0.0, lo_open=True)
        for name in ("include_stop_str_in_output", "ignore_eos", "skip_special_tokens"):
            check_bool(name, getattr(self, name))
        self.temperature = float(self.temperature)
        if 0 < self.temperature < MIN_TEMPERATURE:
            warnings.warn(f"temperature {self.temperature} is below {MIN_TEMPERATURE}, where float32 logits "
                          f"/ temperature overflow into NaN; using {MIN_TEMPERATURE} (as vLLM does)", stacklevel=2)
            self.temperature = MIN_TEMPERATURE
        if self.top_k == -1:
            self.top_k = 0

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    @property
    def has_penalties(self) -> bool:
        return (self.presence_penalty != 0.0 or self.frequency_penalty != 0.0
                or self.repetition_penalty != 1.0)
