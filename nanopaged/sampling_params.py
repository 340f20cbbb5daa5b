"""SamplingParams: how one request picks its next tokens, with vLLM's names and defaults.

Plain data, no torch. Every value a user can get wrong is checked here, when the object is
built, so a bad value fails with the field's name and its allowed range before any work.
"""
from __future__ import annotations

from dataclasses import dataclass, field

MAX_LOGPROBS = 20   # vLLM's default max_logprobs


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
    presence_penalty: float = 0.0          # subtract once from tokens already generated
    frequency_penalty: float = 0.0         # subtract per occurrence in the generated tokens
    repetition_penalty: float = 1.0        # divide (>0 logits) / multiply (<0) for seen tokens
    skip_special_tokens: bool = True

    def __post_init__(self) -> None:
        _int("n", self.n, lo=1)
        _num("temperature", self.temperature, lo=0.0)
        _num("top_p", self.top_p, lo=0.0, hi=1.0, lo_open=True)
        _int("top_k", self.top_k, lo=-1)
        _num("min_p", self.min_p, lo=0.0, hi=1.0)
        if self.seed is not None:
            _int("seed", self.seed)
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        self.stop = list(self.stop or [])
        if not all(isinstance(s, str) and s for s in self.stop):
            raise ValueError(f"stop must be a non-empty string or a list of them, got {self.stop!r}")
        self.stop_token_ids = list(self.stop_token_ids or [])
        for t in self.stop_token_ids:
            _int("stop_token_ids[i]", t, lo=0)
        if self.max_tokens is not None:
            _int("max_tokens", self.max_tokens, lo=1)
        _int("min_tokens", self.min_tokens, lo=0)
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            raise ValueError(f"min_tokens must be <= max_tokens={self.max_tokens}, got {self.min_tokens}")
        if self.logprobs is not None:
            _int("logprobs", self.logprobs, lo=0, hi=MAX_LOGPROBS)
        _num("presence_penalty", self.presence_penalty, lo=-2.0, hi=2.0)
        _num("frequency_penalty", self.frequency_penalty, lo=-2.0, hi=2.0)
        _num("repetition_penalty", self.repetition_penalty, lo=0.0, lo_open=True)
        for name in ("include_stop_str_in_output", "ignore_eos", "skip_special_tokens"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"{name} must be True or False, got {getattr(self, name)!r}")
        self.temperature = float(self.temperature)
        if self.top_k == -1:
            self.top_k = 0

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    @property
    def has_penalties(self) -> bool:
        return (self.presence_penalty != 0.0 or self.frequency_penalty != 0.0
                or self.repetition_penalty != 1.0)


def _int(name, value, lo=None, hi=None) -> None:
    if not isinstance(value, int) or isinstance(value, bool):
        raise ValueError(f"{name} must be an integer, got {value!r}")
    _range(name, value, lo, hi, False)


def _num(name, value, lo=None, hi=None, lo_open=False) -> None:
    if not isinstance(value, (int, float)) or isinstance(value, bool) or value != value:
        raise ValueError(f"{name} must be a number, got {value!r}")
    _range(name, value, lo, hi, lo_open)


def _range(name, value, lo, hi, lo_open) -> None:
    bad_lo = lo is not None and (value <= lo if lo_open else value < lo)
    bad_hi = hi is not None and value > hi
    if bad_lo or bad_hi:
        left = "(" if lo_open else "["
        raise ValueError(f"{name} must be in {left}{'-inf' if lo is None else lo}, "
                         f"{'inf' if hi is None else hi}], got {value!r}")
