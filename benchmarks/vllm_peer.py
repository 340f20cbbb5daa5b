"""vLLM's CPU engine on bench.py's trace, run in its own environment (scripts/setup_vllm_peer.sh)."""
from __future__ import annotations

import json
import math
import os
import sys
import time

from benchmarks.decode_speed import uncached_decode_tokens_per_s
from benchmarks.trace import WARMUP_PROMPT


def main(path_in: str, path_out: str) -> None:
    job = json.loads(open(path_in).read())
    # The CPU backend sizes its KV cache from this variable (GiB); kv_cache_memory_bytes says the same.
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", str(max(1, math.ceil(job["kv_cache_bytes"] / 2**30))))
    import vllm
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt
    load = time.perf_counter()
    # Its own block size: vLLM's CPU attention takes only multiples of 32 (nanopaged's default is 16).
    spec, adapters = job.get("speculative_config"), job.get("lora_adapters")
    lora = {"enable_lora": True, "max_loras": len(adapters), "max_cpu_loras": len(adapters),
            "max_lora_rank": job["max_lora_rank"]} if adapters else {}
    llm = LLM(job["model"], dtype=job["dtype"], max_num_seqs=job["max_num_seqs"],
              max_num_batched_tokens=job["max_num_batched_tokens"], max_model_len=job["max_model_len"],
              kv_cache_memory_bytes=job["kv_cache_bytes"], enable_prefix_caching=job.get("enable_prefix_caching", True),
              seed=0, **({"speculative_config": spec, "disable_log_stats": False} if spec else {}), **lora,
              **({"limit_mm_per_prompt": {"image": 1}, "disable_log_stats": False} if "conversations" in job else {}))
    load = time.perf_counter() - load
    if "conversations" in job:
        open(path_out, "w").write(json.dumps({"vllm": vllm.__version__, "load_s": load, **chat_run(llm, job)}))
        return
    if adapters:
        open(path_out, "w").write(json.dumps({"vllm": vllm.__version__, "load_s": load,
                                              **lora_runs(llm, job, adapters)}))
        return
    ignore_eos = job.get("ignore_eos", True)

    def generate(prompts, lens):
        params = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=ignore_eos) for n in lens]
        return llm.generate([TokensPrompt(prompt_token_ids=p) for p in prompts], params, use_tqdm=False)

    generate([WARMUP_PROMPT["prompt_token_ids"]], [4])
    result = {"load_s": load, "vllm": vllm.__version__}
    if job.get("concurrency"):
        result |= spec_runs(llm, job, generate, spec)
    else:
        result |= timed(llm, generate, job["prompts"], job["output_lens"], len(job["prompts"]), spec)
        result["block_size"] = llm.llm_engine.vllm_config.cache_config.block_size
        one = job.get("single_stream")
        if one:
            result["decode_tokens_per_s"] = uncached_decode_tokens_per_s(generate, one["prompt"], one["output_tokens"])
    open(path_out, "w").write(json.dumps(result))


def timed(llm, generate, prompts, lens, c: int, spec) -> dict:
    """The prompts in groups of c, one generate call each: wall time, output tokens and ids, and the
    spec-decode counters of the run."""
    before = spec_counters(llm) if spec else None
    start = time.perf_counter()
    outs = [o for i in range(0, len(prompts), c) for o in generate(prompts[i:i + c], lens[i:i + c])]
    return {"wall_s": time.perf_counter() - start, "output_tokens": sum(len(o.outputs[0].token_ids) for o in outs),
            "token_ids": [list(o.outputs[0].token_ids) for o in outs],
            "spec_decode": counters_since(spec_counters(llm), before) if spec else None}


def chat_run(llm, job: dict) -> dict:
    """The multimodal workload's conversations after its warm-up one: wall time, tokens, and each request's time
    from the call's start to its first token (its stats: arrival wall time + latency to the first token)."""
    from vllm import SamplingParams
    params = SamplingParams(temperature=0, max_tokens=job["max_tokens"], ignore_eos=True)
    llm.chat(job["warmup"], params, use_tqdm=False)
    start, clock = time.time(), time.perf_counter()
    outs = llm.chat(job["conversations"], params, use_tqdm=False)
    return {"wall_s": time.perf_counter() - clock, "output_tokens": sum(len(o.outputs[0].token_ids) for o in outs),
            "prompt_tokens": sum(len(o.prompt_token_ids) for o in outs),
            "ttft_s": [o.metrics.arrival_time + o.metrics.first_token_latency - start for o in outs]}


def spec_runs(llm, job: dict, generate, spec) -> dict:
    """The prompts in groups of c for each c in job["concurrency"], then each of job["sequences"] one
    at a time (timed)."""
    return {"concurrency": {str(c): timed(llm, generate, job["prompts"], job["output_lens"], c, spec)
                            for c in job["concurrency"]},
            "sequences": {name: timed(llm, generate, x["prompts"], x["output_lens"], 1, spec)
                          for name, x in job.get("sequences", {}).items()}}


def lora_runs(llm, job: dict, adapters: list[str]) -> dict:
    """The trace with its prompts spread over the adapters, and without adapters: each timed after a warm-up."""
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt
    from vllm.lora.request import LoRARequest
    loras = [LoRARequest(f"adapter-{i}", i + 1, path) for i, path in enumerate(adapters)]
    prompts = [TokensPrompt(prompt_token_ids=p) for p in job["prompts"]]
    params = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True) for n in job["output_lens"]]
    out = {}
    for name, per_prompt in (("lora", [loras[i % len(loras)] for i in range(len(prompts))]), ("base", None)):
        for lora in (loras if per_prompt else [None]):       # each adapter read and warmed up before the clock
            llm.generate([TokensPrompt(**WARMUP_PROMPT)], SamplingParams(max_tokens=4), lora_request=lora,
                         use_tqdm=False)
        start = time.perf_counter()
        outs = llm.generate(prompts, params, lora_request=per_prompt, use_tqdm=False)
        wall = time.perf_counter() - start
        tokens = sum(len(o.outputs[0].token_ids) for o in outs)
        out[name] = {"wall_s": wall, "output_tokens": tokens, "output_tokens_per_s": tokens / wall}
    return out


def spec_counters(llm) -> dict | None:
    """vLLM's speculative-decoding counters (vllm:spec_decode_num_drafts, ..._draft_tokens,
    ..._accepted_tokens), summed over their labels; None where its metrics cannot be read."""
    try:
        out = {}
        for m in llm.get_metrics():
            if m.name.startswith("vllm:spec_decode_num_") and hasattr(m, "value"):
                name = m.name.removeprefix("vllm:spec_decode_").removesuffix("_total")
                out[name] = out.get(name, 0) + m.value
        return out
    except Exception:
        return None


def counters_since(now: dict | None, before: dict | None) -> dict | None:
    """The counts of one run, with the mean acceptance length and rate (vLLM's meanings)."""
    if now is None or before is None:
        return None
    d = {k: v - before.get(k, 0) for k, v in now.items()}
    drafts, tokens, accepted = d.get("num_drafts", 0), d.get("num_draft_tokens", 0), d.get("num_accepted_tokens", 0)
    return {**d, "mean_acceptance_length": 1 + accepted / drafts if drafts else 0.0,
            "draft_acceptance_rate": accepted / tokens if tokens else 0.0}


if __name__ == "__main__":      # vLLM's LLM must be created under the main guard (it spawns workers)
    main(sys.argv[1], sys.argv[2])
