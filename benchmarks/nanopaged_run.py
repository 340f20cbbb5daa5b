"""nanopaged's timed run of the trace, with a look at its KV memory after every step; the same trace
again with one setting changed, alternating (quantization, batch invariance); and the warm-up and
timed generate call every other workload runs nanopaged with."""
from __future__ import annotations

import time

from benchmarks.decode_speed import decode_tokens_per_s
from benchmarks.hooks import observing
from benchmarks.memory import kv_sample
from benchmarks.trace import WARMUP_PROMPT, Run, StepTiming, Trace
from nanopaged import LLM, EngineConfig, SamplingParams
from nanopaged.cpu.choose import choose
from nanopaged.engine.llm_engine import StepRecord


def run_nanopaged(model_dir: str, trace: Trace, settings: dict) -> tuple[Run, dict, list, EngineConfig]:
    """LLM.generate's own loop through the trace after a warm-up, a step observer looking at KV memory
    (timed, inside wall_s): the run, get_stats(), the per-step KV samples and the resolved config."""
    llm = LLM(model_dir, **settings)
    engine = llm.llm_engine
    warm_up(llm)
    llm.reset_stats()                        # count only the timed run

    requests = [engine.process_request(f"bench-{i}", {"prompt_token_ids": p}, greedy(n))
                for i, (p, n) in enumerate(zip(trace.prompts, trace.output_lens))]
    samples, steps, look_s = [], [], 0.0

    def look(step: StepRecord) -> None:
        nonlocal look_s
        t = time.perf_counter()
        samples.append(kv_sample(t - start, step.running, engine.config))
        scheduled = step.scheduler_output.scheduled     # counters already advanced by the step
        steps.append(StepTiming(len(scheduled), sum(n for _, n in scheduled),
                                sum(r.num_computed_tokens for r, _ in scheduled),
                                step.times[2] - step.times[1], step.num_tokens,
                                sum(causal_pairs(n, r.num_computed_tokens) for r, n in scheduled)))
        look_s += time.perf_counter() - t

    # as in generate: one call at a time, and cpu_threads="auto" fits the threads, then gives them back
    with observing(llm, look), llm.one_call_at_a_time():
        start = time.perf_counter()
        for r in requests:
            engine.queue(r)
        while engine.has_unfinished_requests():
            engine.step()
        wall = time.perf_counter() - start

    run = Run("nanopaged", wall, sum(r[0].num_output_tokens for r in requests),
              trace.num_prompt_tokens, len(requests), {"kv_look_s": look_s}, steps,
              [list(r[0].output_token_ids) for r in requests])
    return run, llm.get_stats(), samples, engine.config


def causal_pairs(num_new: int, seq_len: int) -> int:
    """(query, key) pairs of num_new queries at the end of seq_len tokens, each seeing the keys up to itself."""
    return num_new * (seq_len - num_new) + num_new * (num_new + 1) // 2


def resolved_settings(config: EngineConfig, stats: dict) -> dict:
    """The engine settings as the engine resolved them (its defaults filled in)."""
    return {"block_size": config.block_size, "max_num_seqs": config.max_num_seqs,
            "max_num_batched_tokens": config.max_num_batched_tokens,
            "max_model_len": config.max_model_len, "num_kv_blocks": stats["num_kv_blocks"],
            "dtype": config.dtype, "cpu_linear": stats["cpu_linear"], "cpu_kernels": stats["cpu_kernels"],
            "attention_backend": stats["attention_backend"], "batch_invariant": stats["batch_invariant"],
            "quantization": config.quantization, "kv_cache_dtype": stats["kv_cache_dtype"]}


def alternating(model_dir: str, trace: Trace, settings: dict, first: Run, other: dict) -> tuple[list, list]:
    """Out tok/s of the trace with `settings` (`first`, then one more) and with `other` changed (two runs),
    alternating: on a shared host runs minutes apart differ by a few percent."""
    these, others = [first.figures()["output_tokens_per_s"]], []
    for changed in (other, {}, other):
        run = run_nanopaged(model_dir, trace, {**settings, **changed})[0]
        (others if changed else these).append(run.figures()["output_tokens_per_s"])
    return these, others


def quantized_vs_dense(model_dir: str, trace: Trace, settings: dict, first: Run) -> dict:
    """Issue 28's "no slower with quantization": the same trace without it, alternating, the best
    of two of each."""
    quantized, dense = alternating(model_dir, trace, settings, first, {"quantization": None})
    return {"output_tokens_per_s": max(dense), "quantized_output_tokens_per_s": max(quantized),
            "runs": {"quantized": quantized, "dense": dense}, "ratio": max(quantized) / max(dense)}


def kernels(settings: dict, model_dir: str) -> tuple:
    """What the engine would run with these settings (nanopaged/cpu/choose.py), without loading it."""
    path = choose(EngineConfig(model_dir, **settings))
    return path.linear, path.layers, path.attention_backend, path.batch_invariant


def batch_invariance_cost(model_dir: str, trace: Trace, settings: dict, first: Run) -> dict:
    """Issue 36: the trace and one request at a time with batch_invariant=False, alternating; nothing runs
    again where both choose the same kernels (a CPU without AMX, quantized layers)."""
    off_settings = {**settings, "batch_invariant": False}
    on, off = kernels(settings, model_dir), kernels(off_settings, model_dir)
    if not on[3]:
        return {"batch_invariant": False}
    if on[:3] == off[:3]:
        return {"batch_invariant": True, "same_kernels": True, "kernels": list(on[:3]), "ratio": 1.0,
                "single_stream_ratio": 1.0}
    invariant, not_invariant = alternating(model_dir, trace, settings, first, {"batch_invariant": False})
    engines = [LLM(model_dir, **{**s, "enable_prefix_caching": False}) for s in (settings, off_settings)]
    prompt, n = trace.prompts[0], max(2, max(trace.output_lens))
    one = decode_tokens_per_s([one_request(llm, prompt) for llm in engines], n)
    return {"batch_invariant": True, "same_kernels": False, "kernels": list(on[:3]), "kernels_off": list(off[:3]),
            "invariant_output_tokens_per_s": max(invariant), "output_tokens_per_s": max(not_invariant),
            "runs": {"invariant": invariant, "not_invariant": not_invariant},
            "ratio": max(invariant) / max(not_invariant),
            "single_stream_decode_tokens_per_s": {"invariant": one[0], "not_invariant": one[1]},
            "single_stream_ratio": one[0] / one[1]}


def one_request(llm: LLM, prompt: list[int]):
    """`generate(tokens)` for decode_tokens_per_s: the prompt, greedy, exactly `tokens` tokens."""
    def generate(tokens: int) -> None:
        llm.generate({"prompt_token_ids": prompt}, greedy(tokens), use_tqdm=False)
    return generate


# ==== what every workload runs nanopaged with ==================================================

def greedy(max_tokens: int) -> SamplingParams:
    """Greedy and exactly `max_tokens` tokens: the trace's sampling."""
    return SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)


def warm_up(llm: LLM, params: SamplingParams | None = None, **kwargs) -> None:
    """One short request before the clock (WARMUP_PROMPT starts no prompt of a trace)."""
    llm.generate(WARMUP_PROMPT, params or greedy(4), use_tqdm=False, **kwargs)


def timed_generate(llm: LLM, prompts: list, params, **kwargs) -> tuple[dict, list]:
    """One timed generate call: {wall_s, output_tokens, output_tokens_per_s}, and its outputs."""
    start = time.perf_counter()
    outs = llm.generate(prompts, params, use_tqdm=False, **kwargs)
    wall = time.perf_counter() - start
    tokens = sum(len(c.token_ids) for o in outs for c in o.outputs)
    return {"wall_s": wall, "output_tokens": tokens, "output_tokens_per_s": tokens / wall}, outs


def token_prompts(prompts: list[list[int]]) -> list[dict]:
    return [{"prompt_token_ids": p} for p in prompts]
