"""Async scheduling on and off (docs/04_scheduler.md, "Async scheduling"): each step's phases, the share of
the steps' wall time the model computed, and output tokens/s, on three workloads: the default trace, its
first requests one at a time, and --overlap-requests requests of 16 output tokens (where the work between
forward passes weighs most). Both engines live in one process and take turns, OVERLAP_ROUNDS times; a
figure is an engine's fastest round."""
from __future__ import annotations

from benchmarks.models import vocab_limit
from benchmarks.nanopaged_run import greedy, timed_generate, token_prompts, warm_up
from benchmarks.trace import make_trace, trace_settings
from nanopaged import LLM

OVERLAP_ROUNDS = 3
ONE_AT_A_TIME = 8           # requests of the trace sent one after another


def overlap_workloads(args, vocab: int) -> dict[str, tuple[list, list, bool]]:
    """name -> (prompts, params, one at a time)."""
    trace = make_trace(args.num_requests, args.input_len, args.output_len, args.seed, vocab)
    many = make_trace(args.overlap_requests, args.input_len, (16, 16), args.seed + 1, vocab)
    first = slice(0, ONE_AT_A_TIME)
    return {"trace": (token_prompts(trace.prompts), list(map(greedy, trace.output_lens)), False),
            "one at a time": (token_prompts(trace.prompts[first]), list(map(greedy, trace.output_lens[first])), True),
            f"{len(many.prompts)} x 16 tokens": (token_prompts(many.prompts), list(map(greedy, many.output_lens)),
                                                 False)}


def timed_run(llm: LLM, prompts: list, params: list, one_at_a_time: bool) -> tuple[dict, list]:
    """One round on one engine: its figures and its tokens."""
    llm.reset_stats()
    runs = ([timed_generate(llm, [p], [q]) for p, q in zip(prompts, params)] if one_at_a_time
            else [timed_generate(llm, prompts, params)])
    wall, tokens = sum(r["wall_s"] for r, _ in runs), sum(r["output_tokens"] for r, _ in runs)
    stats = llm.get_stats()
    steps = stats["num_steps"]
    return ({"output_tokens_per_s": tokens / wall, "wall_s": wall, "num_steps": steps,
             "model_busy_share": stats["model_busy_share"], "num_discarded_rows": stats["num_discarded_rows"],
             "step_ms": {phase: 1e3 * s / steps for phase, s in stats["step_time_s"].items()},
             "step_wall_ms": 1e3 * stats["step_wall_s"] / steps},
            [c.token_ids for _, outs in runs for o in outs for c in o.outputs])


def run_overlap(args, model_dir: str, settings: dict) -> dict:
    llms = {mode: LLM(model_dir, **{**settings, "async_scheduling": mode == "on"}) for mode in ("off", "on")}
    for llm in llms.values():
        warm_up(llm)
    result = {"settings": {"model": model_dir, **trace_settings(args), "overlap_requests": args.overlap_requests,
                           "rounds": OVERLAP_ROUNDS, **settings},
              "workloads": {}}
    for name, (prompts, params, one_at_a_time) in overlap_workloads(args, vocab_limit(model_dir)).items():
        best, tokens = {}, {}
        for _ in range(OVERLAP_ROUNDS):
            for mode, llm in llms.items():
                figures, tokens[mode] = timed_run(llm, prompts, params, one_at_a_time)
                if mode not in best or figures["output_tokens_per_s"] > best[mode]["output_tokens_per_s"]:
                    best[mode] = figures
        off, on = best["off"], best["on"]
        result["workloads"][name] = {
            **best, "speedup": on["output_tokens_per_s"] / off["output_tokens_per_s"],
            "non_model_share_off": 1 - off["model_busy_share"],
            "identical_outputs": tokens["on"] == tokens["off"]}
    return result
