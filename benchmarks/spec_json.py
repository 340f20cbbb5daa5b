"""The spec workload's structured outputs: the agent's tool call (benchmarks/agent_prompts.py) under
its JSON schema (TOOL_CALL_SCHEMA: fixed keys, two enums, a date pattern), no whitespace between tokens,
greedy, ending where the grammar ends, one at a time and all the prompts at once.
(In full: docs/07_benchmarks.md, "The benchmark modules in full".)
"""
from __future__ import annotations

import contextlib
import json

from benchmarks.agent_prompts import TOOL_CALL_SCHEMA, build_agent_workload
from benchmarks.spec_run import (compare, drop_outputs, forced_drafts_switch, ngram_config, run_configs, run_levels,
                                 suffix_config)
import nanopaged.spec_decode.extension as spec_extension
from nanopaged import SamplingParams, StructuredOutputsParams

MAX_TOKENS = 64          # the call is about 35 tokens without whitespace in the demo tokenizer


def forced_drafts() -> tuple[bool, str]:
    """Whether this engine drafts forced tokens, and how the runs turn them off."""
    ways = [f"speculative_config {forced_drafts_switch()!r}: False"] if forced_drafts_switch() else []
    ways.append("FORCED_DRAFTS = False in spec_decode/extension.py (without a speculative config)")
    return True, "on by default; off: " + "; ".join(ways)


@contextlib.contextmanager
def forced_drafts_without_spec(on: bool):
    """Forced drafts on or off for an engine without a speculative config (the first request with a
    grammar installs them: the whole run is inside)."""
    before = spec_extension.FORCED_DRAFTS
    spec_extension.FORCED_DRAFTS = on
    try:
        yield
    finally:
        spec_extension.FORCED_DRAFTS = before


def json_configurations(args) -> dict:
    """name -> (label, speculative_config, forced drafts expected on); "off" drafts nothing."""
    on, _ = forced_drafts()
    switch = forced_drafts_switch()
    configs = {"off": ("no speculative config, no drafts", None, False)}
    if on:
        configs["forced"] = ("no speculative config, forced drafts", None, True)
    for name, spec in ((f"ngram_k{max(args.ngram_k)}", ngram_config(max(args.ngram_k), args)),
                       (f"suffix_k{args.suffix_k[0]}", suffix_config(args.suffix_k[0]))):
        label = name.replace("_k", " k=")
        if switch:
            configs[f"{name}_unforced"] = (f"{label}, forced drafts off", {**spec, switch: False}, False)
        configs[name] = (f"{label}{', forced drafts' if on else ''}", spec, on)
    return configs


def run_json(args, model_dir: str, settings: dict, tokenizer) -> dict:
    items = build_agent_workload(tokenizer, args.json_prompts, args.seed)
    prompts = [{"prompt_token_ids": it.prompt_token_ids} for it in items]
    schema = StructuredOutputsParams(json=TOOL_CALL_SCHEMA, disable_any_whitespace=True)
    params = [SamplingParams(temperature=0, max_tokens=MAX_TOKENS, structured_outputs=schema) for _ in items]
    levels = sorted({1, len(items)})
    configs = json_configurations(args)

    def run_one(name, spec):
        with forced_drafts_without_spec(configs[name][2]):
            return run_levels(model_dir, settings, spec, prompts, params, levels)
    runs = run_configs({name: (label, spec) for name, (label, spec, _) in configs.items()}, run_one)
    for name, r in runs.items():
        counted = [(x.get("spec_decode") or {}).get("num_forced_draft_tokens")
                   for x in r.get("concurrency", {}).values()]
        # what the counters say where the engine counts forced drafts, else what the configuration expects
        r["forced_drafts"] = any(counted) if any(n is not None for n in counted) else configs[name][2]
    compare(runs)
    available, how = forced_drafts()
    result = {"settings": {"num_prompts": len(items), "max_tokens": MAX_TOKENS, "schema": TOOL_CALL_SCHEMA,
                           "disable_any_whitespace": True, "concurrency": levels, "forced_drafts": how},
              "configs": runs,
              "forced_vs_without": forced_vs_without(runs, 1) if available else (None, None),
              "forced_vs_without_at_once": forced_vs_without(runs, len(items)) if available else (None, None)}
    off = runs["off"]
    if "error" not in off:
        texts = off["concurrency"]["1"]["texts"]
        result["off_outputs"] = texts
        result["valid_calls"] = sum(valid_call(t, it) for t, it in zip(texts, items))
    drop_outputs(runs)
    return result


def forced_vs_without(runs: dict, c: int) -> tuple:
    """(forced drafts alone / no drafts at all, "forced") at concurrency c: what the grammar's drafts
    give by themselves. n-gram and suffix with forced drafts are reported beside it, not counted here:
    their own drafts would be credited to the grammar's."""
    tok_s = {name: r["concurrency"][str(c)]["output_tokens_per_s"] for name, r in runs.items()
             if "error" not in r and str(c) in r["concurrency"]}
    if "forced" not in tok_s or "off" not in tok_s:
        return None, None
    return tok_s["forced"] / tok_s["off"], "forced"


def valid_call(text: str, item) -> bool:
    """The output parses and calls the tool with the request's own city, date and unit."""
    try:
        call = json.loads(text)
    except json.JSONDecodeError:
        return False
    return call.get("arguments") == {"city": item.city, "date": item.date, "unit": item.unit}
