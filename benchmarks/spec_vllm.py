"""vLLM's CPU engine on the spec workload's prompts (benchmarks/vllm_peer.py, in its own environment):
off, its n-gram and its suffix decoding, at every concurrency, then the agent's prompts one at a time.
(In full: docs/07_benchmarks.md, "The benchmark modules in full".)
"""
from __future__ import annotations

import sys

from benchmarks import vllm_peer
from benchmarks.spec_prompts import MAX_TOKENS
from benchmarks.peers import not_set_up, run_side, side_python, vllm_job
from benchmarks.spec_prompts import SpecPrompt
from benchmarks.spec_run import concurrency_levels, ngram_config, suffix_config, versus_off
from nanopaged.models.config import ModelConfig


def run_vllm_spec(args, model_dir: str, items: list[SpecPrompt], resolved: dict,
                  agent_prompts: list[list[int]] | None = None) -> dict:
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
    k, ks = args.ngram_k[0], args.suffix_k[0]
    rows, ids = {}, {}
    for name, spec in (("off", None), (f"ngram_k{k}", ngram_config(k, args)), (f"suffix_k{ks}", suffix_config(ks))):
        print(f"bench: spec workload, vllm {name}", file=sys.stderr)
        try:
            out = run_side(python, vllm_peer, {**job, **({"speculative_config": spec} if spec else {})})
        except Exception as e:          # a peer failing is a result to report
            rows[name] = {"skipped": f"{type(e).__name__}: {e}"}
            continue
        runs = {**out["concurrency"], **out["sequences"]}
        rows[name] = {"version": out["vllm"], "load_s": out["load_s"], "speculative_config": spec,
                      "concurrency": {c: figures(x) for c, x in out["concurrency"].items()},
                      **({"agent": figures(out["sequences"]["agent"])} if "agent" in out["sequences"] else {})}
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


def figures(x: dict) -> dict:
    return {"wall_s": x["wall_s"], "output_tokens": x["output_tokens"],
            "output_tokens_per_s": x["output_tokens"] / x["wall_s"], "spec_decode": x.get("spec_decode")}
