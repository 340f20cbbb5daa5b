"""bench.py --workload moe: a mixture of experts at a real model's shape, against what its active weights allow."""
from __future__ import annotations

import ctypes
import gc
import time

import torch

from benchmarks.decode_speed import uncached_decode_tokens_per_s
from benchmarks.models import vocab_limit
from benchmarks.nanopaged_run import greedy, resolved_settings, timed_generate, token_prompts, warm_up
from benchmarks.peers import run_vllm_side, vllm_job
from benchmarks.roofline import copy_bytes_per_s, read_bytes_per_s
from benchmarks.trace import make_trace, trace_settings
from nanopaged import LLM

KV_BLOCKS = 1024          # of 16 tokens: the default trace's 32 requests of up to 192 tokens, with room


def active_bytes(llm: LLM) -> int:
    """Bytes of weights one token reads: every layer's attention and router, its top-k experts (each
    expert's gate, up and down), the final lm_head; as the engine stores them (int4: codes and scales)."""
    m = llm.llm_engine.config.model_config
    moe, itemsize = m.moe, getattr(torch, llm.llm_engine.config.dtype).itemsize
    q, kv = m.num_attention_heads * m.head_dim, m.num_key_value_heads * m.head_dim
    attention = m.hidden_size * (2 * q + 2 * kv)
    expert = 3 * m.hidden_size * moe.intermediate_size
    quantized = llm.get_stats().get("quantization") or {}
    per_weight = (quantized["quantized_bytes"] / quantized["weights_replaced"]) if quantized.get("quantized_linears") \
        else itemsize          # attention and experts alike, as quantize_linears swaps both
    layer = per_weight * (attention + moe.top_k * expert) + itemsize * m.hidden_size * moe.num_experts
    return int(m.num_hidden_layers * layer + itemsize * m.vocab_size * m.hidden_size)


def run_moe(args, model_dir: str, settings: dict) -> dict:
    settings = {"num_kv_blocks": KV_BLOCKS, **settings}
    trace = make_trace(args.num_requests, args.input_len, args.output_len, args.seed, vocab_limit(model_dir))
    load = time.perf_counter()
    llm = LLM(model_dir, **settings)
    load = time.perf_counter() - load
    stats = llm.get_stats()
    warm_up(llm)
    llm.reset_stats()
    trace_figures, _ = timed_generate(llm, token_prompts(trace.prompts), [greedy(n) for n in trace.output_lens])
    ours = {"load_s": load, **trace_figures, "decode_tokens_per_s": one_at_a_time(llm, trace)}
    floor_bytes, read, copy = active_bytes(llm), read_bytes_per_s(2**30), copy_bytes_per_s(2**30)
    floor = read / floor_bytes
    out = {"settings": {"model": model_dir, "random_weights": args.random_weights, **trace_settings(args),
                        "threads": torch.get_num_threads(), **settings},
           "engine": {**ours, "stats": {k: stats[k] for k in ("cpu_linear", "cpu_kernels", "batch_invariant")},
                      "quantization": stats.get("quantization"),
                      "expert_load": llm.get_stats()["moe"]["max_over_mean"]},
           "floor": {"active_weight_bytes": floor_bytes, "read_bytes_per_s": read, "copy_bytes_per_s": copy,
                     "decode_tokens_per_s": floor,
                     "fraction": ours["decode_tokens_per_s"] / floor}}
    resolved = resolved_settings(llm.llm_engine.config, stats)
    config = llm.llm_engine.config.model_config
    del llm
    release_memory()
    if "vllm" in args.peers:
        out["vllm"] = run_vllm_moe(args, model_dir, config, resolved, trace)
    out["targets"] = moe_targets(out)
    return out


def release_memory() -> None:
    """Give the freed engine's memory back to the system before vLLM loads the same weights beside this
    process: glibc keeps freed blocks of a few MB (an expert's weights) for reuse unless asked to trim."""
    gc.collect()
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):       # not glibc: nothing to ask
        pass


def one_at_a_time(llm: LLM, trace) -> float:
    """Decode tokens/s of the trace's first prompt alone, with the prefix cache on (uncached_decode_tokens_per_s)."""
    def generate(prompts: list, lens: list) -> None:
        llm.generate(token_prompts(prompts), [greedy(n) for n in lens], use_tqdm=False)
    return uncached_decode_tokens_per_s(generate, trace.prompts[0], max(2, max(trace.output_lens)))


def run_vllm_moe(args, model_dir: str, config, resolved: dict, trace) -> dict:
    """vLLM's CPU engine on the same folder and trace, and one request at a time; an error says why not."""
    job = {**vllm_job(model_dir, config, resolved, trace.prompts, trace.output_lens),
           "single_stream": {"prompt": trace.prompts[0], "output_tokens": max(2, max(trace.output_lens))}}
    out = run_vllm_side(args, job)
    if "error" in out:
        return out
    return {"version": out["vllm"], "load_s": out["load_s"], "wall_s": out["wall_s"],
            "output_tokens": out["output_tokens"], "output_tokens_per_s": out["output_tokens"] / out["wall_s"],
            "decode_tokens_per_s": out.get("decode_tokens_per_s")}


def moe_targets(r: dict) -> dict:
    fraction = r["floor"]["fraction"]
    targets = {"one request at a time >= 60% of the active-weight floor": {"value": fraction, "met": fraction >= 0.6}}
    theirs = r.get("vllm", {}).get("output_tokens_per_s")
    if theirs:
        x = r["engine"]["output_tokens_per_s"] / theirs
        targets["the trace >= 1.5x vLLM CPU's"] = {"value": x, "met": x >= 1.5}
    return targets
