"""SamplingParams: how one request picks its next tokens, with vLLM's names and defaults.

Plain data, no torch. Every value a user can get wrong is checked here, when the object is
built (with the one range check, `nanopaged/validation.py: check_range`), so a bad value fails
with the field's name and its allowed range before any work; what needs the model (a token id
inside the vocabulary) is checked by the input processor. docs/api.md lists the
fields; vLLM's fields that nanopaged does not implement are accepted at their off value and
refused by name otherwise (VLLM_ONLY). `structured_outputs` is checked by its own module
(nanopaged/structured_output/params.py), read only when a request sets it.
"""
from __future__ import annotations

import enum
import warnings
from dataclasses import dataclass, field, make_dataclass

from nanopaged.structured_output.params import StructuredOutputsParams, check_sampling_params
from nanopaged.validation import INT64_MAX, SEED_RANGE, check_bool, check_choice, check_range
from nanopaged.vllm_compat import check_sampling_fields

MAX_LOGPROBS = 20     # vLLM's default max_logprobs
MIN_TEMPERATURE = 0.01   # vLLM's _MAX_TEMP: below it, float32 logits / T overflow into NaN
MAX_TOP_K = 2**63 - 1    # the sampler keeps k in an int64 tensor
# A request's n samples run at once (n past max_num_seqs is refused by the input processor); this
# bound holds before the engine's settings are known, so nothing sized by n is ever huge.
MAX_N = 1024
# Every new character of the output is matched against the stop strings (detokenizer.py's
# StopMatcher, a trie of them, built on the thread that serves every stream): these bound the
# trie's size and build time, and how much text a stream holds back.
MAX_STOP_STRINGS = 64
MAX_STOP_STRING_CHARS = 128


class RequestOutputKind(enum.Enum):
    """What `LLMEngine.step` returns for a request (vLLM: vllm/sampling_params.py)."""
    CUMULATIVE = 0    # every output holds all the tokens and text so far
    DELTA = 1         # only what is new since the request's last output
    FINAL_ONLY = 2    # one output, when the request finishes (what LLM.generate asks for)


# vLLM's fields that nanopaged does not implement, with their defaults: keyword-only, and any other
# value is checked by nanopaged/vllm_compat.py (NOT_IMPLEMENTED_SAMPLING: accepted, or refused by name).
VLLM_ONLY = {"best_of": None, "use_beam_search": False, "guided_decoding": None,
             "logits_processors": None, "logprob_token_ids": None, "prompt_logprob_token_ids": None,
             "prompt_logprob_start": None, "flat_logprobs": False, "stream_interval": None,
             "skip_reading_prefix_cache": None, "thinking_token_budget": None, "repetition_detection": None,
             "trace_decode_token_ids": None, "routed_experts_prompt_start": 0, "extra_args": None, "skip_clone": False}
VllmOnlyFields = make_dataclass("VllmOnlyFields", [(name, object, field(default=default, kw_only=True, repr=False))
                                                   for name, default in VLLM_ONLY.items()])


@dataclass
class SamplingParams(VllmOnlyFields):
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
    spaces_between_special_tokens: bool = True   # for the tokenizer's decode (a fast one ignores it, as in vLLM)
    detokenize: bool = True                # False: text stays "" and nothing is decoded; ids and logprobs as usual
    truncate_prompt_tokens: int | None = None    # keep the prompt's last k tokens; -1: as many as the context takes
    bad_words: list[str] | None = None     # never completed: a word's last token is blocked after its others
    allowed_token_ids: list[int] | None = None   # only these tokens can be drawn
    logit_bias: dict[int, float] | None = None   # token id -> added to its logit, before the penalties
    output_kind: RequestOutputKind = RequestOutputKind.CUMULATIVE   # what LLMEngine.step returns for it
    # a JSON schema, regex, choice or grammar the output follows (nanopaged/structured_output/)
    structured_outputs: StructuredOutputsParams | None = field(default=None, kw_only=True)
    # bad_words as token ids, as the input processor tokenizes them (vLLM: update_from_tokenizer)
    bad_words_token_ids: list[list[int]] | None = field(default=None, init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        check_range("n", self.n, 1, MAX_N, integer=True)
        check_range("temperature", self.temperature, 0.0)
        check_range("top_p", self.top_p, 0.0, 1.0, lo_open=True)
        check_range("top_k", self.top_k, -1, MAX_TOP_K, integer=True)
        check_range("min_p", self.min_p, 0.0, 1.0)
        if isinstance(self.seed, int) and self.seed == -1:   # vLLM's "no seed"
            self.seed = None
        check_range("seed", self.seed, *SEED_RANGE, integer=True, optional=True)
        if self.seed is not None and self.n > 1:    # sample i draws with seed + i
            check_range("seed + n - 1", self.seed + self.n - 1, *SEED_RANGE, integer=True)
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        if self.stop is not None and not isinstance(self.stop, (list, tuple)):
            raise ValueError(f"stop must be a string or a list of strings, got {self.stop!r}")
        self.stop = list(self.stop or [])
        if len(self.stop) > MAX_STOP_STRINGS:
            raise ValueError(f"stop holds {len(self.stop)} strings; at most MAX_STOP_STRINGS={MAX_STOP_STRINGS} "
                             "are allowed")
        if not all(isinstance(s, str) and s for s in self.stop):
            raise ValueError(f"stop must be a non-empty string or a list of them, got {self.stop!r}")
        longest = max(self.stop, key=len, default="")
        if len(longest) > MAX_STOP_STRING_CHARS:
            raise ValueError(f"stop holds a string of {len(longest)} characters; at most "
                             f"MAX_STOP_STRING_CHARS={MAX_STOP_STRING_CHARS} are allowed")
        self.stop_token_ids = _token_ids("stop_token_ids", [] if self.stop_token_ids is None else self.stop_token_ids)
        check_range("max_tokens", self.max_tokens, 1, INT64_MAX, integer=True, optional=True)
        check_range("min_tokens", self.min_tokens, 0, INT64_MAX, integer=True)
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            raise ValueError(f"min_tokens must be <= max_tokens={self.max_tokens}, got {self.min_tokens}")
        check_range("logprobs", self.logprobs, 0, MAX_LOGPROBS, integer=True, optional=True)
        check_range("prompt_logprobs", self.prompt_logprobs, 0, MAX_LOGPROBS, integer=True, optional=True)
        check_range("presence_penalty", self.presence_penalty, -2.0, 2.0)
        check_range("frequency_penalty", self.frequency_penalty, -2.0, 2.0)
        check_range("repetition_penalty", self.repetition_penalty, 0.0, lo_open=True)
        for name in ("include_stop_str_in_output", "ignore_eos", "skip_special_tokens",
                     "spaces_between_special_tokens", "detokenize"):
            check_bool(name, getattr(self, name))
        self._check_vllm_fields()
        self.temperature = float(self.temperature)
        if 0 < self.temperature < MIN_TEMPERATURE:
            warnings.warn(f"temperature {self.temperature} is below {MIN_TEMPERATURE}, where float32 logits "
                          f"/ temperature overflow into NaN; using {MIN_TEMPERATURE} (as vLLM does)", stacklevel=2)
            self.temperature = MIN_TEMPERATURE
        if self.top_k == -1:
            self.top_k = 0

    def _check_vllm_fields(self) -> None:
        """vLLM's later fields, with vLLM's rules (vllm/sampling_params.py: _verify_args)."""
        if self.stop and not self.detokenize:
            raise ValueError(f"stop strings are found in the text, so they need detokenize=True; "
                             f"got stop={self.stop!r} with detokenize=False")
        k = self.truncate_prompt_tokens
        check_range("truncate_prompt_tokens", k, -1, integer=True, optional=True)
        if k == 0:
            raise ValueError("truncate_prompt_tokens must be an integer >= 1 or -1, got 0")
        words = [] if self.bad_words is None else self.bad_words
        if isinstance(words, str) or not isinstance(words, (list, tuple)) or not all(
                isinstance(w, str) and w for w in words):
            raise ValueError(f"bad_words must be a list of non-empty strings, got {self.bad_words!r}")
        self.bad_words = list(dict.fromkeys(words))
        if self.allowed_token_ids is not None:
            self.allowed_token_ids = _token_ids("allowed_token_ids", self.allowed_token_ids)
            if not self.allowed_token_ids:
                raise ValueError("allowed_token_ids must hold at least one token id, got []")
        self.logit_bias = _logit_bias(self.logit_bias)
        check_choice("output_kind", self.output_kind, tuple(RequestOutputKind))
        if self.structured_outputs is not None:
            check_sampling_params(self)
        if self.best_of is not None:
            check_range("best_of", self.best_of, 1, MAX_N, integer=True)
        if any(getattr(self, name) != default for name, default in VLLM_ONLY.items()):
            check_sampling_fields(self)

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    @property
    def has_penalties(self) -> bool:
        return (self.presence_penalty != 0.0 or self.frequency_penalty != 0.0
                or self.repetition_penalty != 1.0)


def _token_ids(name: str, value) -> list[int]:
    if not isinstance(value, (list, tuple)):
        raise ValueError(f"{name} must be a list of token ids, got {value!r}")
    for t in value:
        check_range(f"{name}[i]", t, 0, integer=True)
    return list(value)


def _logit_bias(bias) -> dict[int, float] | None:
    """{token id: bias}; keys may be strings of digits, as JSON sends them (vLLM: from_optional)."""
    if bias is None:
        return None
    if not isinstance(bias, dict):
        raise ValueError(f"logit_bias must be a dict of token id -> bias, got {bias!r}")
    out = {}
    for token, value in bias.items():
        if isinstance(token, str) and token.isdigit():
            token = int(token)
        check_range("logit_bias key", token, 0, integer=True)
        check_range(f"logit_bias[{token}]", value)
        out[token] = float(value)
    return out

