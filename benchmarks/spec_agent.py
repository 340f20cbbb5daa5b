"""The spec workload's runs of the agent-like prompts (benchmarks/spec_prompts.py): the tool call asked
again and again, one request at a time in order on one engine per configuration (agent); and the same
call under its JSON schema (TOOL_CALL_SCHEMA: fixed keys, two enums, a date pattern), no whitespace
between tokens, greedy, ending where the grammar ends, one at a time and all the prompts at once (json)."""
from __future__ import annotations

import contextlib
import json

import nanopaged.spec_decode.extension as spec_extension
from benchmarks.spec_prompts import SYSTEM, TOOL_CALL_SCHEMA, answer_tokens, build_agent_workload
from benchmarks.spec_run import (configurations, drop_outputs, forced_drafts_switch, ngram_config,
                                 run_configs, run_levels, suffix_config)
from nanopaged import SamplingParams, StructuredOutputsParams

JSON_MAX_TOKENS = 64          # the call is about 35 tokens without whitespace in the demo tokenizer


# ==== agent: the requests one at a time, in order ===========================================

def run_agent(args, model_dir: str, settings: dict, tokenizer) -> dict:
    items = build_agent_workload(tokenizer, args.agent_prompts, args.seed)
    prompts = [{"prompt_token_ids": it.prompt_token_ids} for it in items]
    params = [SamplingParams(temperature=0, max_tokens=it.max_tokens) for it in items]
    runs = run_configs(configurations(args),
                       lambda _, spec: run_levels(model_dir, settings, spec, prompts, params, [1], prefix_caching=True))
    for r in runs.values():
        if "error" not in r:
            r["first_and_rest"] = first_and_rest(r["concurrency"]["1"])
    result = {"settings": {"num_prompts": len(items), "max_tokens": items[0].max_tokens, "enable_prefix_caching": True,
                           "system": SYSTEM, "prompt_tokens": [min(len(p["prompt_token_ids"]) for p in prompts),
                                                               max(len(p["prompt_token_ids"]) for p in prompts)],
                           "expected_answer_tokens": answer_tokens(tokenizer, items)},
              "prompts": [{"city": it.city, "date": it.date, "unit": it.unit, "expected_answer": it.expected_answer}
                          for it in items],
              "configs": runs, "prompt_token_ids": [it.prompt_token_ids for it in items]}
    off = runs["off"]
    if "error" not in off:
        texts = off["concurrency"]["1"]["texts"]
        for p, text in zip(result["prompts"], texts):
            p["off_output"] = text
        result["answers_as_taught"] = sum(t.strip() == it.expected_answer for t, it in zip(texts, items))
    drop_outputs(runs)
    return result


def first_and_rest(run: dict) -> dict:
    """Output tokens/s of the first request (nothing cached yet) and of the others together."""
    tokens = [len(ids) for ids in run["token_ids"]]
    calls = run["call_s"]
    rest_s = sum(calls[1:])
    return {"first_tokens_per_s": tokens[0] / calls[0],
            "rest_tokens_per_s": sum(tokens[1:]) / rest_s if rest_s else None}


# ==== json: the call under its schema, with and without the drafts the grammar forces =========

def forced_drafts_how() -> str:
    """How the runs turn forced drafts (on by default in this engine) off."""
    ways = [f"speculative_config {forced_drafts_switch()!r}: False"] if forced_drafts_switch() else []
    ways.append("FORCED_DRAFTS = False in spec_decode/extension.py (without a speculative config)")
    return "on by default; off: " + "; ".join(ways)


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
    switch = forced_drafts_switch()
    configs = {"off": ("no speculative config, no drafts", None, False),
               "forced": ("no speculative config, forced drafts", None, True)}
    for name, spec in ((f"ngram_k{max(args.ngram_k)}", ngram_config(max(args.ngram_k), args)),
                       (f"suffix_k{args.suffix_k[0]}", suffix_config(args.suffix_k[0]))):
        label = name.replace("_k", " k=")
        if switch:
            configs[f"{name}_unforced"] = (f"{label}, forced drafts off", {**spec, switch: False}, False)
        configs[name] = (f"{label}, forced drafts", spec, True)
    return configs


def run_json(args, model_dir: str, settings: dict, tokenizer) -> dict:
    items = build_agent_workload(tokenizer, args.json_prompts, args.seed)
    prompts = [{"prompt_token_ids": it.prompt_token_ids} for it in items]
    schema = StructuredOutputsParams(json=TOOL_CALL_SCHEMA, disable_any_whitespace=True)
    params = [SamplingParams(temperature=0, max_tokens=JSON_MAX_TOKENS, structured_outputs=schema) for _ in items]
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
    result = {"settings": {"num_prompts": len(items), "max_tokens": JSON_MAX_TOKENS, "schema": TOOL_CALL_SCHEMA,
                           "disable_any_whitespace": True, "concurrency": levels, "forced_drafts": forced_drafts_how()},
              "configs": runs, "forced_vs_without": forced_vs_without(runs, 1),
              "forced_vs_without_at_once": forced_vs_without(runs, len(items))}
    off = runs["off"]
    if "error" not in off:
        texts = off["concurrency"]["1"]["texts"]
        result["off_outputs"] = texts
        result["valid_calls"] = sum(valid_call(t, it) for t, it in zip(texts, items))
    drop_outputs(runs)
    return result


def forced_vs_without(runs: dict, c: int) -> tuple:
    """(forced drafts alone / no drafts at all, "forced") at concurrency c: the grammar's drafts by
    themselves (n-gram's or suffix's own drafts would be credited to them)."""
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
