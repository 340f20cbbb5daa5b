"""--workload spec: speculative decoding where the answer repeats its input, and what it costs where it does not.

The repeating workload's prompts (benchmarks/spec_prompts.py): passages of an English text to repeat
exactly or to fix typos in, greedy, ending where the model stops (no ignore_eos), at most the passage's
tokens + MAX_TOKENS_SLACK (or --spec-max-tokens).

Each configuration gets its own engine, one after another in this process, each freed before the next:
speculation off, n-gram prompt lookup at each --ngram-k, and a draft model. Each engine runs the
prompts twice: one at a time (each alone, in turn; the wall time of all) and --concurrency at once
(one generate call). Prefix caching is off, so both runs compute their prompts. Per run: output tokens/s,
speculation's counters (mean acceptance length, draft acceptance rate), the speedup over speculation off
at the same concurrency, and how many greedy outputs equal off's token for token.

The draft model is the target's own first --draft-layers decoder layers (an early exit,
benchmarks/models.py: build_draft_model): no separately trained small model is available offline.

Then the throughput workload's random-token trace (make_trace, run_nanopaged: ignore_eos), off and
n-gram at the first --ngram-k: the prompts repeat nothing, and the figure is what speculation costs
(unless the model's greedy answers repeat themselves, as a small model's do: the drafts say so).
TARGETS are the issue's, reported met or missed. `--peers vllm` also runs vLLM's CPU engine on the
same prompts without and with its own n-gram speculation (benchmarks/vllm_peer.py). The table:
benchmarks/report.py: print_spec.
"""
from __future__ import annotations

import gc
import sys
import time
import traceback
from dataclasses import asdict

import torch

from benchmarks import vllm_peer
from benchmarks.models import DRAFT_NOTE, build_draft_model, vocab_limit
from benchmarks.nanopaged_run import resolved_settings, run_nanopaged
from benchmarks.peers import not_set_up, run_side, side_python, vllm_job
from benchmarks.spec_prompts import INSTRUCTIONS, MAX_TOKENS_SLACK, NUM_TYPOS, TEXT, SpecPrompt, build_workload
from benchmarks.trace import WARMUP_PROMPT, make_trace
from nanopaged import LLM, SamplingParams
from nanopaged.engine.input_processor import load_tokenizer
from nanopaged.models.config import ModelConfig

# The targets: n-gram speculation (its best k) over speculation off, output tokens/s, on the
# repeating workload. Reported met or missed, never adjusted.
TARGETS = {"one_at_a_time": 1.8, "at_once": 1.3}
RUNS = ("one_at_a_time", "at_once")


# ==== the timed runs ====================================================================

def ngram_config(k: int, args) -> dict:
    return {"method": "ngram", "num_speculative_tokens": k,
            "prompt_lookup_max": args.prompt_lookup_max, "prompt_lookup_min": args.prompt_lookup_min}


def configurations(args, draft_dir: str) -> dict:
    """name -> (label, speculative_config); off first, the baseline of the others."""
    configs = {"off": ("off", None)}
    for k in args.ngram_k:
        configs[f"ngram_k{k}"] = (f"ngram k={k}", ngram_config(k, args))
    configs[f"draft_k{args.draft_k}"] = (f"draft k={args.draft_k} ({args.draft_layers} layers)",
                                         {"method": "draft_model", "model": draft_dir,
                                          "num_speculative_tokens": args.draft_k})
    return configs


def run_config(model_dir: str, settings: dict, spec_config: dict | None, items: list[SpecPrompt],
               concurrency: int) -> dict:
    """One engine: a warm-up, the prompts one at a time, then `concurrency` at once; freed after."""
    llm = LLM(model_dir, **{**settings, "enable_prefix_caching": False, "speculative_config": spec_config})
    try:
        prompts = [{"prompt_token_ids": it.prompt_token_ids} for it in items]
        params = [SamplingParams(temperature=0, max_tokens=it.max_tokens) for it in items]
        llm.generate(WARMUP_PROMPT, SamplingParams(temperature=0, max_tokens=4), use_tqdm=False)
        llm.generate(prompts[0], SamplingParams(temperature=0, max_tokens=8), use_tqdm=False)   # drafts verified too
        n = len(items)
        result = {"one_at_a_time": timed(llm, [[i] for i in range(n)], prompts, params),
                  "at_once": timed(llm, [list(range(i, min(i + concurrency, n))) for i in range(0, n, concurrency)],
                                   prompts, params)}
        result["resolved"] = resolved_settings(llm.llm_engine.config, llm.get_stats())
        return result
    finally:
        del llm
        gc.collect()


def timed(llm: LLM, groups: list[list[int]], prompts: list, params: list) -> dict:
    """The prompts in `groups` (one generate call each, in turn): wall time, output tokens/s, the time
    the proposers took, and speculation's counters. get_stats() counts since reset_stats() (the engine's
    own counters, spec_decode.of(engine).stats, run on from the engine's start)."""
    engine = llm.llm_engine
    propose_s = [0.0]

    def timing(propose):
        def wrapped(running):
            t = time.perf_counter()
            try:
                return propose(running)
            finally:
                propose_s[0] += time.perf_counter() - t
        return wrapped

    proposers = list(engine.proposers)
    engine.proposers[:] = [timing(p) for p in proposers]
    token_ids, texts, reasons = [None] * len(prompts), [None] * len(prompts), [None] * len(prompts)
    llm.reset_stats()
    try:
        start = time.perf_counter()
        for group in groups:
            outs = llm.generate([prompts[i] for i in group], [params[i] for i in group], use_tqdm=False)
            for i, o in zip(group, outs):
                token_ids[i], texts[i] = list(o.outputs[0].token_ids), o.outputs[0].text
                reasons[i] = o.outputs[0].finish_reason
        wall = time.perf_counter() - start
    finally:
        engine.proposers[:] = proposers
    stats = llm.get_stats()
    spec = stats["spec_decode"]
    tokens = sum(map(len, token_ids))
    return {"wall_s": wall, "output_tokens": tokens, "output_tokens_per_s": tokens / wall,
            "num_requests": len(prompts), "num_steps": stats["num_steps"], "model_time_s": stats["model_time_s"],
            "propose_s": propose_s[0], "stopped_by_eos": sum(r == "stop" for r in reasons),
            "mean_acceptance_length": spec["mean_acceptance_length"] if spec else None,
            "draft_acceptance_rate": spec["draft_acceptance_rate"] if spec else None,
            "spec_decode": spec, "token_ids": token_ids, "texts": texts}


def compare(runs: dict) -> None:
    """Each run against off's at the same concurrency: speedup, outputs equal token for token, and
    where each differing output first differs."""
    off = runs["off"]
    for name, r in runs.items():
        if "error" in r or "error" in off:
            continue
        for run in RUNS:
            mine, base = r[run], off[run]
            mine |= versus_off(mine, base, mine["token_ids"], base["token_ids"])
            mine["first_differences"] = [first_difference(a, b) for a, b in zip(mine["token_ids"], base["token_ids"])
                                         if a != b]


def versus_off(run: dict, off: dict, ids: list, off_ids: list) -> dict:
    """A run against speculation off's on the same prompts (`ids`: each one's greedy output): its
    speedup in output tokens/s, and how many outputs equal off's token for token."""
    return {"speedup_vs_off": run["output_tokens_per_s"] / off["output_tokens_per_s"],
            "identical_to_off": sum(a == b for a, b in zip(ids, off_ids))}


def first_difference(a: list[int], b: list[int]) -> int:
    """The first output position where two outputs differ (or the shorter one's length). Greedy
    speculation must not change the output; where it does, a late first difference in bfloat16 points
    at a near-tie in the logits that the k + 1-row verify pass and the one-row decode broke apart."""
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))


def target_figures(runs: dict) -> dict:
    """The issue's targets, from the figures: the best n-gram k's speedup at each concurrency."""
    out = {}
    for run, target in TARGETS.items():
        ngram = {name: r[run]["speedup_vs_off"] for name, r in runs.items()
                 if name.startswith("ngram") and "speedup_vs_off" in r.get(run, {})}
        best = max(ngram, key=ngram.get) if ngram else None
        value = ngram[best] if best else None
        out[f"ngram_{run}"] = {"target": target, "value": value, "best_of": best,
                               "met": value is not None and value >= target}
    return out


def copies(items: list[SpecPrompt], texts: list[str]) -> dict:
    """How many answers are the passage as the text has it (the typos fixed), by instruction."""
    out = {}
    for it, text in zip(items, texts):
        out.setdefault(it.kind, 0)
        out[it.kind] += " ".join(text.split()) == it.passage
    return out


def run_trace(args, model_dir: str, settings: dict) -> dict:
    """The throughput workload's random-token trace, off and n-gram at the first --ngram-k."""
    trace = make_trace(args.num_requests, args.input_len, args.output_len, args.seed, vocab_limit(model_dir))
    k = args.ngram_k[0]
    result = {"settings": {"num_requests": args.num_requests, "input_len": list(args.input_len),
                           "output_len": list(args.output_len), "seed": args.seed,
                           "sampling": "greedy, ignore_eos", "ngram_k": k}}
    ids = {}
    for name, spec in (("off", None), (f"ngram_k{k}", ngram_config(k, args))):
        try:
            run, stats, _, _ = run_nanopaged(model_dir, trace, {**settings, "speculative_config": spec})
        except Exception as e:
            traceback.print_exc()
            result[name] = {"error": f"{type(e).__name__}: {e}"}
            continue
        finally:
            gc.collect()
        f = run.figures()
        result[name] = {k2: f[k2] for k2 in ("output_tokens_per_s", "wall_s", "output_tokens", "prompt_tokens")}
        result[name]["spec_decode"] = stats["spec_decode"]
        ids[name] = run.token_ids
    spec_name = f"ngram_k{k}"
    if "error" not in result["off"] and "error" not in result[spec_name]:
        r = result[spec_name]
        r |= versus_off(r, result["off"], ids[spec_name], ids["off"])
        result["cost"] = 1 - r["speedup_vs_off"]
    return result


def run_spec(args, model_dir: str, settings: dict) -> dict:
    tokenizer = load_tokenizer(model_dir)
    items = build_workload(tokenizer, args.num_prompts, args.spec_max_tokens, args.seed)
    draft_dir = str(build_draft_model(model_dir, args.draft_layers))
    total = ModelConfig.from_folder(model_dir).num_hidden_layers
    configs = configurations(args, draft_dir)
    result = {"settings": {
        "model": model_dir, "draft_model": draft_dir, "draft_layers": args.draft_layers, "target_layers": total,
        "draft_note": DRAFT_NOTE.format(n=args.draft_layers, total=total),
        "num_prompts": len(items), "concurrency": min(args.concurrency, len(items)),
        "max_tokens": args.spec_max_tokens, "max_tokens_slack": MAX_TOKENS_SLACK,   # None: passage + slack
        "ngram_k": args.ngram_k, "prompt_lookup_max": args.prompt_lookup_max,
        "prompt_lookup_min": args.prompt_lookup_min, "draft_k": args.draft_k, "seed": args.seed,
        "sampling": "greedy, stops at EOS", "enable_prefix_caching": False, "threads": torch.get_num_threads(),
        "text": TEXT.name, "instructions": INSTRUCTIONS, "num_typos": NUM_TYPOS,
        "speculative_configs": {name: spec for name, (_, spec) in configs.items()}, **settings}}
    runs = {}
    for name, (label, spec) in configs.items():
        print(f"bench: spec workload, {label}", file=sys.stderr)
        try:
            runs[name] = {"label": label, **run_config(model_dir, settings, spec, items, args.concurrency)}
        except Exception as e:         # one configuration failing is a result; the others still run
            traceback.print_exc()
            runs[name] = {"label": label, "error": f"{type(e).__name__}: {e}"}
    compare(runs)
    off = runs["off"]
    prompts = [{k: v for k, v in asdict(it).items() if k != "prompt_token_ids"}
               | {"prompt_tokens": len(it.prompt_token_ids)} for it in items]
    if "error" not in off:
        for p, text in zip(prompts, off["one_at_a_time"]["texts"]):
            p["off_output"] = text
        result["copies"] = copies(items, off["one_at_a_time"]["texts"])
        result["off_at_once_identical_to_one_at_a_time"] = sum(
            a == b for a, b in zip(off["at_once"]["token_ids"], off["one_at_a_time"]["token_ids"]))
    for r in runs.values():
        for run in RUNS:
            for key in ("token_ids", "texts"):
                r.get(run, {}).pop(key, None)
    result["passage_tokens"] = [min(it.passage_tokens for it in items), max(it.passage_tokens for it in items)]
    result["prompts"] = prompts
    result["configs"] = runs
    result["targets"] = target_figures(runs)
    result["trace"] = run_trace(args, model_dir, settings)
    if "vllm" in args.peers:
        resolved = off.get("resolved") or {}
        result["peers"] = {"vllm": run_vllm_spec(args, model_dir, items, resolved)}
    return result


# ==== vLLM ==============================================================================

def run_vllm_spec(args, model_dir: str, items: list[SpecPrompt], resolved: dict) -> dict:
    """vLLM's CPU engine on the same prompts (benchmarks/vllm_peer.py, its own environment), without
    and with its n-gram speculation at the first --ngram-k; each row its figures or why it did not run."""
    python = side_python(args, "vllm")
    if python is None:
        return {"skipped": not_set_up("vllm")}
    if not resolved:
        return {"skipped": "nanopaged's run with speculation off failed: no engine settings to give vLLM"}
    job = {**vllm_job(model_dir, ModelConfig.from_folder(model_dir), resolved, [it.prompt_token_ids for it in items],
                      [it.max_tokens for it in items]),
           "max_num_seqs": min(resolved["max_num_seqs"], args.concurrency),
           "ignore_eos": False, "enable_prefix_caching": False, "one_at_a_time": True}
    k = args.ngram_k[0]
    rows, ids = {}, {}
    for name, spec in (("off", None), (f"ngram_k{k}", ngram_config(k, args))):
        print(f"bench: spec workload, vllm {name}", file=sys.stderr)
        try:
            out = run_side(python, vllm_peer, {**job, **({"speculative_config": spec} if spec else {})})
        except Exception as e:          # a peer failing is a result to report
            rows[name] = {"skipped": f"{type(e).__name__}: {e}"}
            continue
        by_run = {"at_once": out, "one_at_a_time": out["one_at_a_time"]}
        rows[name] = {"version": out["vllm"], "load_s": out["load_s"], "speculative_config": spec,
                      **{run: {"wall_s": x["wall_s"], "output_tokens": x["output_tokens"],
                               "output_tokens_per_s": x["output_tokens"] / x["wall_s"],
                               "spec_decode": x.get("spec_decode")} for run, x in by_run.items()}}
        ids[name] = {run: x["token_ids"] for run, x in by_run.items()}
    spec_name = f"ngram_k{k}"
    if "skipped" not in rows["off"] and "skipped" not in rows[spec_name]:
        for run in RUNS:
            rows[spec_name][run] |= versus_off(rows[spec_name][run], rows["off"][run], ids[spec_name][run],
                                               ids["off"][run])
    return rows
