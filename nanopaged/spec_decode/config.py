"""SpeculativeConfig: what `speculative_config={...}` asks for, with vLLM's names, checked at once.

    {"method": "ngram", "num_speculative_tokens": k, "prompt_lookup_max": a, "prompt_lookup_min": b}
    {"method": "draft_model", "model": PATH, "num_speculative_tokens": k}
    {"method": "suffix", "num_speculative_tokens": k, "suffix_decoding_max_tree_depth": 24, ...}

vLLM: vllm/config/speculative.py. As there, an n-gram config without prompt_lookup_min/max looks
for 5-grams, one without the other takes the given value for both, a config with a `model` and
no method is a draft model, and a suffix config may leave out k (32: it is only a cap) and each
suffix_decoding_* knob (SUFFIX_KNOBS). Every check runs in EngineConfig, before any weight loads.
"""
from __future__ import annotations

from dataclasses import dataclass

from nanopaged.validation import check_range
from nanopaged.models.config import ModelConfig

METHODS = ("ngram", "draft_model", "suffix")
OTHER_VLLM_METHODS = ("eagle", "eagle3", "medusa", "mlp_speculator", "mtp")
MAX_SPECULATIVE_TOKENS = 32
DEFAULT_MAX_CACHED_TOKENS = 100_000     # the suffix method's global tree: docs/11, "Suffix decoding"
DEFAULT_LOOKUP = 5          # vLLM's prompt_lookup_min = prompt_lookup_max when neither is given
# method "suffix": vLLM's knobs, its defaults, and each one's range (lo, hi, integer, lo excluded)
SUFFIX_KNOBS = {
    "suffix_decoding_max_tree_depth": (24, (2, None, True, False)),          # match + draft tokens; 1: no room
    "suffix_decoding_max_cached_requests": (10000, (0, None, True, False)),  # outputs in the global tree; 0: off
    "suffix_decoding_max_spec_factor": (1.0, (0, None, False, True)),        # a draft <= ceil(factor * matched)
    "suffix_decoding_min_token_prob": (0.1, (0, 1, False, False)),           # drafting stops below it
    # nanopaged's own: tokens in the global tree, its memory bound (each token holds up to depth nodes)
    "suffix_decoding_max_cached_tokens": (DEFAULT_MAX_CACHED_TOKENS, (0, None, True, False)),
}
KEYS = ("method", "num_speculative_tokens", "prompt_lookup_max", "prompt_lookup_min", "model", *SUFFIX_KNOBS)


@dataclass(frozen=True)
class SpeculativeConfig:
    method: str
    num_speculative_tokens: int
    prompt_lookup_max: int | None = None     # ngram: the longest n-gram looked up
    prompt_lookup_min: int | None = None     # ngram: the shortest
    model: str | None = None                 # draft_model: a smaller model's folder, same vocabulary
    suffix_decoding_max_tree_depth: int | None = None        # suffix: SUFFIX_KNOBS says what each is
    suffix_decoding_max_cached_requests: int | None = None
    suffix_decoding_max_spec_factor: float | None = None
    suffix_decoding_min_token_prob: float | None = None
    suffix_decoding_max_cached_tokens: int = DEFAULT_MAX_CACHED_TOKENS      # nanopaged's own, not vLLM's

    @classmethod
    def from_dict(cls, given, target, check_model_folder) -> "SpeculativeConfig":
        """`target` is the EngineConfig being built, `check_model_folder` its folder check (passed in:
        nanopaged/config.py imports this module, so this one does not import it back)."""
        if isinstance(given, SpeculativeConfig):
            return given
        if not isinstance(given, dict):
            raise ValueError(f"speculative_config must be a dict, got {given!r}")
        unknown = sorted(set(given) - set(KEYS))
        if unknown:
            raise ValueError(f"speculative_config: unknown key {unknown[0]!r}; nanopaged knows {list(KEYS)}")
        method = given.get("method") or ("draft_model" if given.get("model") else None)
        if method in OTHER_VLLM_METHODS:
            raise ValueError(f"speculative_config method {method!r} is not supported; nanopaged has {list(METHODS)}")
        if method not in METHODS:
            raise ValueError(f"speculative_config method must be one of {list(METHODS)}, got {method!r}")
        k = given.get("num_speculative_tokens")
        if k is None and method == "suffix":
            k = MAX_SPECULATIVE_TOKENS                   # vLLM's: suffix drafts adapt their length; k caps them
        check_range("speculative_config num_speculative_tokens", k, 1, MAX_SPECULATIVE_TOKENS, integer=True)
        _only_for(given, method, "ngram", ("prompt_lookup_max", "prompt_lookup_min"))
        _only_for(given, method, "suffix", tuple(SUFFIX_KNOBS))
        if method == "ngram":
            return cls(method, k, *_lookup(given.get("prompt_lookup_max"), given.get("prompt_lookup_min")))
        if method == "suffix":
            if given.get("model") is not None:
                raise ValueError("speculative_config method 'suffix' runs no draft model; leave out 'model'")
            return cls(method, k, **_suffix_knobs(given))
        return cls(method, k, model=check_draft_model(given.get("model"), target, check_model_folder))


def _only_for(given: dict, method: str, owner: str, keys: tuple[str, ...]) -> None:
    for key in keys:
        if method != owner and given.get(key) is not None:
            raise ValueError(f"speculative_config {key} belongs to method {owner!r}, not {method!r}")


def _suffix_knobs(given: dict) -> dict:
    knobs = {}
    for key, (default, (lo, hi, integer, lo_open)) in SUFFIX_KNOBS.items():
        value = given[key] if given.get(key) is not None else default
        check_range(f"speculative_config {key}", value, lo, hi, integer=integer, lo_open=lo_open)
        knobs[key] = value
    return knobs


def _lookup(longest, shortest) -> tuple[int, int]:
    if longest is None and shortest is None:
        return DEFAULT_LOOKUP, DEFAULT_LOOKUP
    longest = shortest if longest is None else longest
    shortest = longest if shortest is None else shortest
    check_range("speculative_config prompt_lookup_max", longest, 1, integer=True)
    check_range("speculative_config prompt_lookup_min", shortest, 1, integer=True)
    if shortest > longest:
        raise ValueError(f"speculative_config prompt_lookup_min={shortest} is above prompt_lookup_max={longest}")
    return longest, shortest


def check_draft_model(path, target, check_model_folder) -> str:
    """The draft model must exist, be a model nanopaged runs, and score the same vocabulary as the
    target: its token ids are the target's (it shares the tokenizer)."""
    if not path:
        raise ValueError("speculative_config method 'draft_model' needs a 'model': the draft model's folder")
    check_model_folder(path, target.tokenizer)      # the draft model uses the target's tokenizer
    draft = ModelConfig.from_folder(path)
    m = target.model_config
    if draft.vocab_size != m.vocab_size:
        raise ValueError(f"speculative_config draft model {path!r} has vocab_size={draft.vocab_size}; the target "
                         f"model has {m.vocab_size}: a draft model must share the target's vocabulary")
    if draft.max_position_embeddings < target.max_model_len:
        raise ValueError(f"speculative_config draft model {path!r} has max_position_embeddings="
                         f"{draft.max_position_embeddings}, below the engine's max_model_len={target.max_model_len}")
    if target.tensor_parallel_size > 1:
        raise ValueError("speculative_config method 'draft_model' runs with tensor_parallel_size=1 only")
    return str(path)
