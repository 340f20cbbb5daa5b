"""The spec workloads' timed runs (benchmarks/spec.py, spec_agent.py): an engine per
configuration and concurrency, the prompts in groups of that many, each run against speculation off's."""
from __future__ import annotations

import gc
import sys
import time
import traceback

from benchmarks.hooks import timing_proposers
from benchmarks.nanopaged_run import resolved_settings
from benchmarks.trace import WARMUP_PROMPT
from nanopaged import LLM, SamplingParams
from nanopaged.spec_decode import config as spec_config_module

# A prompt that repeats itself: every method finds drafts in it, so drafts are verified once before
# the clock (and the first request's output in suffix decoding's cache is not one of the workload's).
WARMUP_REPEATING = {"prompt_token_ids": WARMUP_PROMPT["prompt_token_ids"] * 3}
# What decides how many drafts a request gets per step in this engine, in words.
DRAFT_POLICY = "the engine's current policy (nanopaged/spec_decode/draft_budget.py)"


def ngram_config(k: int, args) -> dict:
    return {"method": "ngram", "num_speculative_tokens": k,
            "prompt_lookup_max": args.prompt_lookup_max, "prompt_lookup_min": args.prompt_lookup_min}


def suffix_config(k: int) -> dict:
    """vLLM's suffix defaults (tree depth 24, min_token_prob 0.1, spec factor 1), k as given."""
    return {"method": "suffix", "num_speculative_tokens": k}


def configurations(args, draft_dir: str | None = None) -> dict:
    """name -> (label, speculative_config); off first, the baseline of the others; the draft model last,
    where there is one."""
    configs = {"off": ("off", None)}
    for k in args.ngram_k:
        configs[f"ngram_k{k}"] = (f"ngram k={k}", ngram_config(k, args))
    for k in args.suffix_k:
        configs[f"suffix_k{k}"] = (f"suffix k={k}", suffix_config(k))
    if draft_dir:
        configs[f"draft_k{args.draft_k}"] = (f"draft k={args.draft_k} ({args.draft_layers} layers)",
                                             {"method": "draft_model", "model": draft_dir,
                                              "num_speculative_tokens": args.draft_k})
    return configs


def trace_configurations(args) -> dict:
    """name -> speculative_config of the random-token trace and of vLLM's runs: off, n-gram at the first
    --ngram-k, suffix at the first --suffix-k."""
    k, ks = args.ngram_k[0], args.suffix_k[0]
    return {"off": None, f"ngram_k{k}": ngram_config(k, args), f"suffix_k{ks}": suffix_config(ks)}


def concurrency_levels(asked: list[int], num_prompts: int) -> list[int]:
    """The concurrencies run: 1 always (one at a time), none above the prompts there are."""
    return sorted({1, *(min(c, num_prompts) for c in asked)})


def make_engine(model_dir: str, settings: dict, spec: dict | None, prefix_caching: bool) -> LLM:
    llm = LLM(model_dir, **{**settings, "enable_prefix_caching": prefix_caching, "speculative_config": spec})
    llm.generate(WARMUP_REPEATING, SamplingParams(temperature=0, max_tokens=8), use_tqdm=False)
    return llm


def run_levels(model_dir: str, settings: dict, spec: dict | None, prompts: list, params: list,
               levels: list[int], prefix_caching: bool = False) -> dict:
    """The prompts at each concurrency in `levels` (1: each alone, in turn), each on a fresh engine
    freed after: {"concurrency": {"c": figures}, "resolved": the engine's settings}."""
    out = {"concurrency": {}}
    n = len(prompts)
    for c in levels:
        llm = make_engine(model_dir, settings, spec, prefix_caching)
        try:
            out["concurrency"][str(c)] = timed(llm, [list(range(i, min(i + c, n))) for i in range(0, n, c)],
                                               prompts, params)
            out["resolved"] = resolved_settings(llm.llm_engine.config, llm.get_stats())
        finally:
            del llm
            gc.collect()
    return out


def timed(llm: LLM, groups: list[list[int]], prompts: list, params: list) -> dict:
    """The prompts in `groups`, one generate call each: wall time, output tokens/s, each call's wall time,
    the proposers' time and speculation's counters since reset_stats()."""
    token_ids, texts, reasons = [None] * len(prompts), [None] * len(prompts), [None] * len(prompts)
    call_s = []
    llm.reset_stats()
    with timing_proposers(llm) as propose_s:
        start = time.perf_counter()
        for group in groups:
            t = time.perf_counter()
            outs = llm.generate([prompts[i] for i in group], [params[i] for i in group], use_tqdm=False)
            call_s.append(time.perf_counter() - t)
            for i, o in zip(group, outs):
                token_ids[i], texts[i] = list(o.outputs[0].token_ids), o.outputs[0].text
                reasons[i] = o.outputs[0].finish_reason
        wall = time.perf_counter() - start
    stats = llm.get_stats()
    spec = stats["spec_decode"]
    tokens = sum(map(len, token_ids))
    return {"wall_s": wall, "output_tokens": tokens, "output_tokens_per_s": tokens / wall,
            "num_requests": len(prompts), "num_steps": stats["num_steps"], "model_time_s": stats["model_time_s"],
            "propose_s": propose_s[0], "stopped_by_eos": sum(r == "stop" for r in reasons), "call_s": call_s,
            "mean_acceptance_length": spec["mean_acceptance_length"] if spec else None,
            "draft_acceptance_rate": spec["draft_acceptance_rate"] if spec else None,
            "spec_decode": spec, "token_ids": token_ids, "texts": texts}


def run_configs(configs: dict, run_one) -> dict:
    """name -> {"label", figures...} for each configuration (label, speculative_config): run_one(name, spec),
    compared with off's; one failing is a result (its error), the others still run."""
    runs = {}
    for name, (label, spec) in configs.items():
        print(f"bench: spec workload, {label}", file=sys.stderr)
        try:
            runs[name] = {"label": label, **run_one(name, spec)}
        except Exception as e:
            traceback.print_exc()
            runs[name] = {"label": label, "error": f"{type(e).__name__}: {e}"}
    compare(runs)
    return runs


def compare(runs: dict, baseline: str = "off") -> None:
    """Each run against the baseline's at the same concurrency: speedup, outputs equal token for
    token, and where each differing output first differs."""
    base = runs.get(baseline, {})
    for r in runs.values():
        if "error" in r or "error" in base:
            continue
        for c, mine in r["concurrency"].items():
            theirs = base["concurrency"].get(c)
            if theirs is None:
                continue
            mine |= versus_off(mine, theirs, mine["token_ids"], theirs["token_ids"])
            mine["first_differences"] = [first_difference(a, b) for a, b in zip(mine["token_ids"], theirs["token_ids"])
                                         if a != b]


def versus_off(run: dict, off: dict, ids: list, off_ids: list) -> dict:
    """A run against speculation off's on the same prompts (`ids`: each one's greedy output): its
    speedup in output tokens/s, and how many outputs equal off's token for token."""
    return {"speedup_vs_off": run["output_tokens_per_s"] / off["output_tokens_per_s"],
            "identical_to_off": sum(a == b for a, b in zip(ids, off_ids))}


def first_difference(a: list[int], b: list[int]) -> int:
    """The first position where two outputs differ (or the shorter one's length): a late one in bfloat16
    points at a near-tie that the verify pass and the one-row decode broke apart."""
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))


def drop_outputs(runs: dict) -> None:
    """The token ids and texts leave the JSON once compared (the prompts keep off's answers)."""
    for r in runs.values():
        for x in r.get("concurrency", {}).values():
            x.pop("token_ids", None)
            x.pop("texts", None)


# ==== what this engine's speculation can do (it grows: read at run time) ======================

def forced_drafts_switch() -> str | None:
    """The speculative_config key that turns grammar-forced drafts on and off, None where there is none."""
    keys = [k for k in spec_config_module.KEYS if "forced" in k or "grammar" in k]
    return keys[0] if keys else None

