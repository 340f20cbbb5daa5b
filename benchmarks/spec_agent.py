"""The spec workload's agent-like run: one tool call asked again and again with small changes
(benchmarks/agent_prompts.py), one request at a time, in order, on one engine per configuration.
(In full: docs/07_benchmarks.md, "The benchmark modules in full".)
"""
from __future__ import annotations

from benchmarks.agent_prompts import SYSTEM, answer_tokens, build_agent_workload
from benchmarks.spec_run import compare, configurations, drop_outputs, run_configs, run_levels
from nanopaged import SamplingParams


def run_agent(args, model_dir: str, settings: dict, tokenizer) -> dict:
    items = build_agent_workload(tokenizer, args.agent_prompts, args.seed)
    prompts = [{"prompt_token_ids": it.prompt_token_ids} for it in items]
    params = [SamplingParams(temperature=0, max_tokens=it.max_tokens) for it in items]
    runs = run_configs(configurations(args),
                       lambda _, spec: run_levels(model_dir, settings, spec, prompts, params, [1], prefix_caching=True))
    compare(runs)
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
