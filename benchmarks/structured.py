"""--workload structured: what a JSON schema costs per output token, and what compiling one costs."""
from __future__ import annotations

import json
import statistics
import time

from benchmarks.hooks import grammar_manager, observing
from benchmarks.models import vocab_limit
from benchmarks.quality import DATA
from benchmarks.nanopaged_run import greedy, timed_generate, token_prompts, warm_up
from benchmarks.trace import make_trace, trace_settings
from nanopaged import LLM, SamplingParams, StructuredOutputsParams

TARGET_OVERHEAD = 0.10      # the target: <= 10% more per output token on CPU
# The schemas are data (benchmarks/data/structured.json). BENCH_SCHEMA: records of a few fields, more
# items than any trace's output has tokens for, so the grammar cannot end first. COMPILED: the constraints
# whose compile time is reported, cold (first request) and cached (every later one).
SCHEMAS = json.loads((DATA / "structured.json").read_text())
BENCH_SCHEMA = SCHEMAS["bench_schema"]
COMPILED = {"bench schema": {"json": BENCH_SCHEMA}, **SCHEMAS["compiled"]}


def run_structured(args, model_dir: str, settings: dict) -> dict:
    trace = make_trace(args.num_requests, args.input_len, args.output_len, args.seed, vocab_limit(model_dir))
    prompts = token_prompts(trace.prompts)
    schema = StructuredOutputsParams(json=BENCH_SCHEMA, disable_any_whitespace=True)
    plain = [greedy(n) for n in trace.output_lens]
    constrained = [SamplingParams(temperature=0, max_tokens=n, structured_outputs=schema) for n in trace.output_lens]
    llm = LLM(model_dir, **settings)
    warm_up(llm, SamplingParams(max_tokens=4))
    result = {"settings": {"model": model_dir, **trace_settings(args), **settings},
              "compile": compile_times(llm)}            # the bench schema is compiled (cold) here, before any run
    manager = grammar_manager(llm)
    runs = {"plain": [], "constrained": []}
    for _ in range(2):
        runs["plain"].append(timed(llm, prompts, plain, manager))
        runs["constrained"].append(timed(llm, prompts, constrained, manager))
    best = {name: min(rs, key=lambda r: r["wall_s"]) for name, rs in runs.items()}
    assert best["plain"]["output_tokens"] == best["constrained"]["output_tokens"] == trace.num_output_tokens
    per_token = {name: r["wall_s"] / r["output_tokens"] for name, r in best.items()}
    overhead = per_token["constrained"] / per_token["plain"] - 1
    result.update(plain=best["plain"], constrained=best["constrained"], runs=runs, overhead_per_token=overhead,
                  target=TARGET_OVERHEAD, target_met=overhead <= TARGET_OVERHEAD)
    return result


def timed(llm: LLM, prompts: list, params: list, manager) -> dict:
    """One timed generation: wall time, output tokens/s, and per step the share spent on masks and matchers."""
    steps = []
    seen = [manager.mask_seconds, manager.accept_seconds]

    def observe(record) -> None:          # runs at the end of each step, after check_stop's matcher updates
        now, (mask, accept) = time.perf_counter(), (manager.mask_seconds, manager.accept_seconds)
        steps.append((now - record.times[0], mask - seen[0], accept - seen[1]))
        seen[:] = [mask, accept]

    with observing(llm, observe):
        run, _ = timed_generate(llm, prompts, params)
    step_s, mask_s, accept_s = (sum(s[i] for s in steps) for i in range(3))
    return {**run, "steps": len(steps),
            "step_s": step_s, "mask_s": mask_s, "matcher_s": accept_s,
            "mask_and_matcher_share": (mask_s + accept_s) / step_s if step_s else 0.0,
            "median_step_share": statistics.median((m + a) / s for s, m, a in steps) if steps else 0.0}


def compile_times(llm: LLM) -> dict:
    """Seconds to compile each constraint the first time, and to find it again in the cache."""
    manager = grammar_manager(llm)
    times = {}
    for name, constraint in COMPILED.items():
        params = StructuredOutputsParams(**constraint, disable_any_whitespace=name == "bench schema")
        start = time.perf_counter()
        manager.grammar(params)
        cold = time.perf_counter() - start
        start = time.perf_counter()
        manager.grammar(params)
        times[name] = {"cold_s": cold, "cached_s": time.perf_counter() - start}
    return times
