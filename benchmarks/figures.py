"""The throughput run's summary figures: ratios to the peers, where the engine's time goes,
the targets nanopaged is held to, and the published figures shown beside (never in a ratio)."""
from __future__ import annotations

import json

from benchmarks.quality import DATA
from benchmarks.trace import Run

# The targets and the published figures are data (benchmarks/data/targets.json): name -> {"at_least" or
# "at_most": the goal, "issue": where it was set}.
TARGET_DATA = json.loads((DATA / "targets.json").read_text())
PUBLISHED = TARGET_DATA["published"]
TARGETS = {name: t.get("at_least", t.get("at_most")) for name, t in TARGET_DATA["throughput"].items()}
LOWER_IS_BETTER = {name for name, t in TARGET_DATA["throughput"].items() if "at_most" in t}
SERVE_TARGETS = TARGET_DATA["serve"]


def vllm_target(settings: dict) -> float:
    """The speedup over vLLM's CPU engine issue 23 asks for on this run's trace."""
    for trace in TARGET_DATA["speedup_vs_vllm_by_trace"]:
        if all(settings.get(k) == v for k, v in trace["settings"].items()):
            return trace["at_least"]
    return TARGETS["speedup_vs_vllm"]


def ratios(engine: dict, peers: dict) -> dict:
    """nanopaged's output tokens/s over each measured peer's (published figures never enter)."""
    return {f"engine_vs_{name}": engine["output_tokens_per_s"] / p["output_tokens_per_s"]
            for name, p in peers.items() if "output_tokens_per_s" in p}


def overhead_figures(stats: dict, run: Run) -> dict:
    """Where the engine's wall time goes: scheduler + block pool, the model, everything else."""
    steps = max(1, stats["num_steps"])
    sched, model = stats["schedule_time_s"], stats["model_time_s"]
    return {"num_steps": stats["num_steps"],
            "step_ms": 1e3 * (sched + model) / steps,
            "schedule_ms_per_step": 1e3 * sched / steps,
            "model_ms_per_step": 1e3 * model / steps,
            "schedule_share": sched / (sched + model) if sched + model else 0.0,
            "other_share_of_wall": 1 - (sched + model) / run.wall_s}   # detokenizing, outputs, loop


def target_figures(result: dict) -> dict:
    single = result["single_stream"]
    got = {"speedup_vs_vllm": result["ratios"].get("engine_vs_vllm"),
           "speedup_vs_hf": result["ratios"].get("engine_vs_hf"),
           "floor_fraction": result["roofline"]["floor"]["fraction"],
           "decode_vs_own_matmuls": result["roofline"]["floor"]["decode_vs_own_matmuls"],
           "single_stream_vs_hf": single["ratio"], "single_stream_vs_vllm": single.get("ratio_vs_vllm"),
           "kv_utilization_paged": result["kv_utilization"]["paged"],
           "schedule_share": result["overhead"]["schedule_share"],
           "kept_beside_a_busy_core": result.get("noise", {}).get("nanopaged", {}).get("kept"),  # --noise
           "single_stream_vs_llamacpp": single.get("ratio_vs_llamacpp"),
           "perplexity_vs_float32": result.get("quality", {}).get("vs_float32"),
           "perplexity_vs_llamacpp": result.get("quality", {}).get("vs_llamacpp"),
           "quantized_vs_dense": result.get("dense", {}).get("ratio"),
           "batch_invariance_cost": result.get("batch_invariance", {}).get("ratio"),
           "batch_invariance_single_stream": result.get("batch_invariance", {}).get("single_stream_ratio")}
    goals = {**TARGETS, "speedup_vs_vllm": vllm_target(result["settings"])}
    out = {}
    for name, goal in goals.items():
        value, lower_is_better = got[name], name in LOWER_IS_BETTER
        met = None if value is None else (value <= goal if lower_is_better else value >= goal)
        out[name] = {"value": value, "target": goal, "met": met, "lower_is_better": lower_is_better}
    return out
