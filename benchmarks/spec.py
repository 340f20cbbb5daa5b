"""--workload spec: speculative decoding where the answer repeats its input or earlier answers, and what
it costs where it does not; and vLLM's CPU engine on the same prompts."""
from __future__ import annotations

import gc
import sys
import traceback
from dataclasses import asdict

import torch

from benchmarks import vllm_peer
from benchmarks.figures import TARGET_DATA
from benchmarks.models import DRAFT_NOTE, build_draft_model, vocab_limit
from benchmarks.nanopaged_run import run_nanopaged
from benchmarks.peers import not_set_up, run_side, side_python, vllm_job
from benchmarks.quality import TEXTS
from benchmarks.spec_agent import run_agent, run_json
from benchmarks.spec_prompts import INSTRUCTIONS, MAX_TOKENS, MAX_TOKENS_SLACK, NUM_TYPOS, SpecPrompt, build_workload
from benchmarks.spec_run import (DRAFT_POLICY, concurrency_levels, configurations, drop_outputs, run_configs,
                                 run_levels, trace_configurations, versus_off)
from benchmarks.trace import make_trace, trace_settings
from nanopaged import SamplingParams
from nanopaged.engine.input_processor import load_tokenizer
from nanopaged.models.config import ModelConfig

WORKLOADS = ("repeating", "agent", "json", "trace")
# The issues' targets (benchmarks/data/targets.json): name -> (what, at least this).
TARGETS = {name: (t["what"], t["at_least"]) for name, t in TARGET_DATA["spec"].items()}


# ==== the repeating workload ============================================================

def run_repeating(args, model_dir: str, settings: dict, items: list[SpecPrompt], draft_dir: str) -> dict:
    levels = concurrency_levels(args.concurrency, len(items))
    prompts = [{"prompt_token_ids": it.prompt_token_ids} for it in items]
    params = [SamplingParams(temperature=0, max_tokens=it.max_tokens) for it in items]
    runs = run_configs(configurations(args, draft_dir),
                       lambda _, spec: run_levels(model_dir, settings, spec, prompts, params, levels))
    result = {"concurrency": levels, "configs": runs}
    off = runs["off"]
    if "error" not in off:
        alone = off["concurrency"]["1"]
        result["off_outputs"] = alone["texts"]
        result["copies"] = copies(items, alone["texts"])
        result["off_batched_identical_to_one_at_a_time"] = {
            c: sum(a == b for a, b in zip(x["token_ids"], alone["token_ids"])) for c, x in off["concurrency"].items()}
    drop_outputs(runs)
    return result


def copies(items: list[SpecPrompt], texts: list[str]) -> dict:
    """How many answers are the passage as the text has it (the typos fixed), by instruction."""
    out = {}
    for it, text in zip(items, texts):
        out[it.kind] = out.get(it.kind, 0) + (" ".join(text.split()) == it.passage)
    return out


# ==== the targets =======================================================================

def speedups(runs: dict, prefix: str, c: int) -> dict:
    """name -> speedup over off at concurrency c, of the configurations whose name starts with prefix."""
    return {name: r["concurrency"][str(c)]["speedup_vs_off"] for name, r in runs.items()
            if name.startswith(prefix) and "speedup_vs_off" in r.get("concurrency", {}).get(str(c), {})}


def target_figures(result: dict) -> dict:
    """Every target from the figures: a best k is the one fastest one at a time; a target whose run is
    missing (a failed configuration, a concurrency not run) has no value and is missed."""
    runs = result.get("repeating", {}).get("configs", {})
    ngram1, suffix1 = speedups(runs, "ngram", 1), speedups(runs, "suffix", 1)
    (_, best_ngram), (_, best_suffix) = best_of(ngram1), best_of(suffix1)
    values = {"ngram_one_at_a_time": best_of(ngram1),
              "ngram_at_16": best_of(speedups(runs, "ngram", 16)),
              "suffix_vs_ngram_one_at_a_time": (suffix1[best_suffix] / ngram1[best_ngram], best_suffix)
              if best_ngram and best_suffix else (None, None)}
    for c in (16, 32):
        at = {name: x for name, x in {**speedups(runs, "ngram", c), **speedups(runs, "suffix", c)}.items()
              if name in (best_ngram, best_suffix)}
        both = len(at) == 2
        values[f"never_slower_at_{c}"] = (min(at.values()), min(at, key=at.get)) if both else (None, None)
        if c == 16:
            values["best_at_16"] = (max(at.values()), max(at, key=at.get)) if both else (None, None)
    agent = result.get("agent", {}).get("configs", {})
    values["agent_suffix_one_at_a_time"] = best_of(speedups(agent, "suffix", 1))
    values["json_forced_one_at_a_time"] = result.get("json", {}).get("forced_vs_without", (None, None))
    out = {}
    for name, (what, target) in TARGETS.items():
        value, of = values.get(name, (None, None))
        out[name] = {"what": what, "target": target, "value": value, "of": of,
                     "met": value is not None and value >= target}
    return out


def best_of(speedup: dict) -> tuple:
    best = max(speedup, key=speedup.get) if speedup else None
    return (speedup[best], best) if best else (None, None)


# ==== the random-token trace ============================================================

def run_trace(args, model_dir: str, settings: dict) -> dict:
    """The throughput workload's random-token trace under trace_configurations."""
    trace = make_trace(args.num_requests, args.input_len, args.output_len, args.seed, vocab_limit(model_dir))
    configs = trace_configurations(args)
    result = {"settings": {**trace_settings(args), "sampling": "greedy, ignore_eos", "ngram_k": args.ngram_k[0],
                           "suffix_k": args.suffix_k[0]}}
    ids = {}
    for name, spec in configs.items():
        try:
            run, stats, _, _ = run_nanopaged(model_dir, trace, {**settings, "speculative_config": spec})
        except Exception as e:
            traceback.print_exc()
            result[name] = {"error": f"{type(e).__name__}: {e}"}
            continue
        finally:
            gc.collect()
        f = run.figures()
        result[name] = {**{k: f[k] for k in ("output_tokens_per_s", "wall_s", "output_tokens", "prompt_tokens")},
                        "spec_decode": stats["spec_decode"]}
        ids[name] = run.token_ids
    for name in list(configs)[1:]:
        if "error" not in result["off"] and "error" not in result[name]:
            result[name] |= versus_off(result[name], result["off"], ids[name], ids["off"])
            result[name]["cost"] = 1 - result[name]["speedup_vs_off"]
    return result


# ==== vLLM's CPU engine on the same prompts =============================================

def run_vllm_spec(args, model_dir: str, items: list[SpecPrompt], resolved: dict,
                  agent_prompts: list[list[int]] | None = None) -> dict:
    """benchmarks/vllm_peer.py under trace_configurations, at every concurrency of the repeating prompts,
    then the agent's prompts one at a time; each row its figures or why it did not run."""
    python = side_python(args, "vllm")
    if python is None:
        return {"skipped": not_set_up("vllm")}
    if not resolved:
        return {"skipped": "nanopaged's repeating run with speculation off did not run: no engine settings for vLLM"}
    levels = concurrency_levels(args.concurrency, len(items))
    job = {**vllm_job(model_dir, ModelConfig.from_folder(model_dir), resolved, [it.prompt_token_ids for it in items],
                      [it.max_tokens for it in items]),
           "max_num_seqs": max(levels), "ignore_eos": False, "enable_prefix_caching": False, "concurrency": levels}
    if agent_prompts:
        job["sequences"] = {"agent": {"prompts": agent_prompts, "output_lens": [MAX_TOKENS] * len(agent_prompts)}}
    rows, ids = {}, {}
    for name, spec in trace_configurations(args).items():
        print(f"bench: spec workload, vllm {name}", file=sys.stderr)
        try:
            out = run_side(python, vllm_peer, {**job, **({"speculative_config": spec} if spec else {})})
        except Exception as e:          # a peer failing is a result to report
            rows[name] = {"skipped": f"{type(e).__name__}: {e}"}
            continue
        runs = {**out["concurrency"], **out["sequences"]}
        rows[name] = {"version": out["vllm"], "load_s": out["load_s"], "speculative_config": spec,
                      "concurrency": {c: vllm_figures(x) for c, x in out["concurrency"].items()},
                      **({"agent": vllm_figures(out["sequences"]["agent"])} if "agent" in out["sequences"] else {})}
        ids[name] = {c: x["token_ids"] for c, x in runs.items()}
    for name, row in rows.items():
        if name == "off" or "skipped" in row or "skipped" in rows["off"]:
            continue
        off = rows["off"]
        for c, x in row["concurrency"].items():
            x |= versus_off(x, off["concurrency"][c], ids[name][c], ids["off"][c])
        if "agent" in row:
            row["agent"] |= versus_off(row["agent"], off["agent"], ids[name]["agent"], ids["off"]["agent"])
    return rows


def vllm_figures(x: dict) -> dict:
    return {"wall_s": x["wall_s"], "output_tokens": x["output_tokens"],
            "output_tokens_per_s": x["output_tokens"] / x["wall_s"], "spec_decode": x.get("spec_decode")}


# ==== all of it =========================================================================

def run_spec(args, model_dir: str, settings: dict) -> dict:
    tokenizer = load_tokenizer(model_dir)
    items = build_workload(tokenizer, args.num_prompts, args.spec_max_tokens, args.seed)
    draft_dir = str(build_draft_model(model_dir, args.draft_layers))
    total = ModelConfig.from_folder(model_dir).num_hidden_layers
    result = {"settings": {
        "model": model_dir, "workloads": args.spec_workloads, "draft_model": draft_dir,
        "draft_layers": args.draft_layers, "target_layers": total,
        "draft_note": DRAFT_NOTE.format(n=args.draft_layers, total=total),
        "num_prompts": len(items), "concurrency": concurrency_levels(args.concurrency, len(items)),
        "max_tokens": args.spec_max_tokens, "max_tokens_slack": MAX_TOKENS_SLACK,   # None: passage + slack
        "ngram_k": args.ngram_k, "prompt_lookup_max": args.prompt_lookup_max,
        "prompt_lookup_min": args.prompt_lookup_min, "suffix_k": args.suffix_k, "draft_k": args.draft_k,
        "seed": args.seed, "sampling": "greedy, stops at EOS", "enable_prefix_caching": False,
        "threads": torch.get_num_threads(), "draft_policy": DRAFT_POLICY,
        "texts": [t.name for t in TEXTS], "instructions": INSTRUCTIONS, "num_typos": NUM_TYPOS,
        "speculative_configs": {name: spec for name, (_, spec) in configurations(args, draft_dir).items()},
        **settings}}
    prompts = [{k: v for k, v in asdict(it).items() if k != "prompt_token_ids"}
               | {"prompt_tokens": len(it.prompt_token_ids)} for it in items]
    result["passage_tokens"] = [min(it.passage_tokens for it in items), max(it.passage_tokens for it in items)]
    result["prompts"] = prompts
    if "repeating" in args.spec_workloads:
        result["repeating"] = run_repeating(args, model_dir, settings, items, draft_dir)
        for p, text in zip(prompts, result["repeating"].pop("off_outputs", [])):
            p["off_output"] = text
    if "agent" in args.spec_workloads:
        result["agent"] = run_agent(args, model_dir, settings, tokenizer)
    if "json" in args.spec_workloads:
        result["json"] = run_json(args, model_dir, settings, tokenizer)
    if "trace" in args.spec_workloads:
        result["trace"] = run_trace(args, model_dir, settings)
    result["targets"] = target_figures(result)
    if "vllm" in args.peers:
        resolved = result.get("repeating", {}).get("configs", {}).get("off", {}).get("resolved") or {}
        agent = result.get("agent", {}).get("prompt_token_ids")
        result["peers"] = {"vllm": run_vllm_spec(args, model_dir, items, resolved, agent)}
    for section in ("agent", "json"):
        result.get(section, {}).pop("prompt_token_ids", None)
    return result
