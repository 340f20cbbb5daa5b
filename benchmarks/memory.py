"""KV memory models: the slots paged blocks hold next to what the reservation allocators
PagedAttention replaced would have held (the paper's Fig. 2), and HF's padded cache."""
from __future__ import annotations

from typing import NamedTuple

from benchmarks.trace import Trace
from nanopaged.core.block_pool import cdiv


class KVSample(NamedTuple):
    """KV slots in one step (tokens), for the requests that held blocks during it."""
    t: float                   # seconds into the timed run
    num_running: int
    stored: int                # tokens whose K/V is in the cache
    paged: int                 # slots of the blocks held
    reserve_needed: int        # slots if each reserved prompt + max_tokens
    reserve_max_len: int       # slots if each reserved max_model_len


def kv_sample(t: float, held_by: list, config) -> KVSample:
    """One step's KV figures for the requests that held blocks during it: on demand, each held
    cdiv(num_computed_tokens, block_size) blocks (docs/07_benchmarks.md, "KV utilization")."""
    bs = config.block_size
    stored = sum(r.num_computed_tokens for r in held_by)
    paged = sum(cdiv(r.num_computed_tokens, bs) for r in held_by) * bs
    reserve_max_len = len(held_by) * config.max_model_len
    reserve_needed = sum(r.num_prompt_tokens + r.max_tokens for r in held_by)
    return KVSample(t, len(held_by), stored, paged, reserve_needed, reserve_max_len)


def memory_figures(stats: dict, samples: list, trace: Trace, max_model_len: int,
                   max_num_seqs: int) -> tuple[dict, dict]:
    """KV utilization of paged vs reservation allocators; how many requests fit at once, etc."""
    stored = sum(s.stored for s in samples)
    util = {"paged": stats["kv_utilization"],
            "paged_recomputed": stored / max(1, sum(s.paged for s in samples)),
            "reserve_prompt_plus_max_tokens": stored / max(1, sum(s.reserve_needed for s in samples)),
            "reserve_max_model_len": stored / max(1, sum(s.reserve_max_len for s in samples))}
    budget = stats["num_kv_blocks"] * stats["block_size"]          # KV slots, all layers
    mean_needed = (trace.num_prompt_tokens + trace.num_output_tokens) / len(trace.prompts)
    paged_bound = ("max_num_seqs" if stats["max_num_running"] >= max_num_seqs else
                   "trace size (all requests ran at once)" if stats["max_num_running"] >= len(trace.prompts)
                   else "KV blocks")
    slots_used = [s.paged for s in samples]
    q = stats["prefix_cache_queries"]
    return util, {
        "kv_budget_tokens": budget,
        "max_num_running": {"paged": stats["max_num_running"], "paged_bound_by": paged_bound,
                            "reserve_max_model_len": budget // max_model_len,
                            "reserve_prompt_plus_max_tokens": int(budget // mean_needed)},
        "num_preemptions": stats["num_preemptions"],
        "peak_kv_usage": stats["peak_kv_cache_usage"],
        "mean_kv_usage": sum(slots_used) / len(slots_used) / budget if slots_used else 0.0,
        "prefix_cache_hit_rate": stats["prefix_cache_hits"] / q if q else None,
    }


def hf_static_kv_utilization(trace: Trace, batches) -> float:
    """Real tokens / slots of HF's padded cache over its decode steps: at step t a batch holds
    batch x (longest prompt + t) slots, request i fills min(p_i + t, p_i + o_i) of them."""
    stored = held = 0
    for b in batches:
        longest, steps = max(len(trace.prompts[i]) for i in b), max(trace.output_lens[i] for i in b)
        for t in range(1, steps + 1):
            held += len(b) * (longest + t)
            stored += sum(len(trace.prompts[i]) + min(t, trace.output_lens[i]) for i in b)
    return stored / held
