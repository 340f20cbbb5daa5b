"""The workloads beside throughput: a shared system prompt with prefix caching on and off,
and the KV blocks saved by sharing inside a request (n > 1 samples, beam search)."""
from __future__ import annotations

import json
import random
import time

from benchmarks.hooks import observing
from benchmarks.models import vocab_limit
from benchmarks.nanopaged_run import timed_generate, token_prompts, warm_up
from benchmarks.quality import DATA
from benchmarks.trace import make_trace, random_ids
from nanopaged import LLM, BeamSearchParams, SamplingParams


def run_shared_prefix(args, model_dir: str, settings: dict) -> dict:
    """One system prompt of --prefix-len tokens + a question per request, prefix caching on and off;
    the shared fraction, (n - 1) x prefix / total, is what a perfect cache never computes again."""
    vocab = vocab_limit(model_dir)
    rng = random.Random(args.seed)
    system = random_ids(rng, args.prefix_len, vocab)
    prompts = [system + random_ids(rng, rng.randint(*args.input_len), vocab) for _ in range(args.num_requests)]
    params = [SamplingParams(temperature=0, max_tokens=rng.randint(*args.output_len), ignore_eos=True)
              for _ in prompts]
    total = sum(len(p) for p in prompts)
    result = {"settings": {"model": model_dir, "num_requests": args.num_requests,
                           "prefix_len": args.prefix_len, "question_len": list(args.input_len),
                           "output_len": list(args.output_len), "seed": args.seed, **settings},
              "prompt_tokens": total,
              "shared_fraction": (len(prompts) - 1) * args.prefix_len / total}
    for caching in (True, False):
        llm = LLM(model_dir, enable_prefix_caching=caching, **settings)
        warm_up(llm, SamplingParams(max_tokens=4))
        llm.reset_stats()                    # count only the timed run
        run, outs = timed_generate(llm, token_prompts(prompts), params)
        stats = llm.get_stats()
        queries = stats["prefix_cache_queries"]
        result["on" if caching else "off"] = {
            "wall_s": run["wall_s"],
            "prefill_tokens_computed": stats["num_prompt_tokens_computed"],
            "hit_rate": stats["prefix_cache_hits"] / queries if queries else 0.0,
            "num_cached_tokens": sum(o.num_cached_tokens for o in outs),
            "output_tokens_per_s": run["output_tokens_per_s"],
        }
        result["outputs_" + ("on" if caching else "off")] = [o.outputs[0].token_ids for o in outs]
    on, off = result["on"], result["off"]
    result["prefill_reduction"] = 1 - on["prefill_tokens_computed"] / off["prefill_tokens_computed"]
    result["speedup"] = off["wall_s"] / on["wall_s"]
    result["identical_outputs"] = result.pop("outputs_on") == result.pop("outputs_off")
    return result


# The sharing traces, shaped like the paper's, and the savings it reports: benchmarks/data/sharing.json.
SHARING = json.loads((DATA / "sharing.json").read_text())


def run_sharing(args, model_dir: str, settings: dict) -> dict:
    """KV blocks saved by n samples and beams that fork (get_stats()["kv_sharing_saving"], the paper's
    Fig. 15 measure); prefix caching is off, so only sharing inside a request counts."""
    vocab = vocab_limit(model_dir)
    result = {"settings": {"model": model_dir, "num_prompts": args.num_requests, "seed": args.seed,
                           "traces": SHARING["traces"]}, "rows": []}
    for trace_name, lengths in SHARING["traces"].items():
        trace = make_trace(args.num_requests, lengths["input_len"], lengths["output_len"], args.seed, vocab)
        prompts = [{"prompt_token_ids": p} for p in trace.prompts]
        for kind, width in [("parallel", w) for w in (2, 4, 6)] + [("beam", w) for w in (2, 4, 6)]:
            llm = LLM(model_dir, **{"enable_prefix_caching": False, **settings})
            start = time.perf_counter()
            if kind == "parallel":
                llm.generate(prompts, [SamplingParams(n=width, temperature=1.0, seed=args.seed + i,
                                                      max_tokens=o, ignore_eos=True)
                                       for i, o in enumerate(trace.output_lens)], use_tqdm=False)
            else:   # beams run to the trace's mean output length
                mean_out = sum(trace.output_lens) // len(trace.output_lens)
                llm.beam_search(prompts, BeamSearchParams(beam_width=width, max_tokens=mean_out,
                                                          ignore_eos=True))
            stats = llm.get_stats()
            result["rows"].append({"trace": trace_name, "kind": kind, "width": width,
                                   "saving": stats["kv_sharing_saving"],
                                   "mean_blocks_used": stats["mean_kv_blocks_used"],
                                   "peak_blocks_used": stats["peak_kv_blocks_used"],
                                   "wall_s": time.perf_counter() - start,
                                   "paper": SHARING["paper_savings"][kind][trace_name]})
    return result


# Shared prefixes read once (issue 37): the decode steps of rows whose block tables begin alike.
CASCADE_ROUNDS = 3


def decode_step_times(times: list[float]):
    """A step observer: how long each step whose rows all decode spent in the model and the sampler."""
    def observe(record) -> None:
        if all(n == 1 for _, n in record.scheduler_output.scheduled):
            times.append(record.times[2] - record.times[1])
    return observe


def run_cascade(args, model_dir: str, settings: dict) -> dict:
    """Decode steps with shared prefixes read once (the default) and not, on a system prompt + questions
    and on n = 8 samples, and the system prompt with its own copies (docs/07_benchmarks.md)."""
    vocab = vocab_limit(model_dir)
    rng = random.Random(args.seed)
    system = random_ids(rng, args.prefix_len, vocab)
    out_len = args.output_len[1]
    workloads = {
        "system prompt": ([{"prompt_token_ids": system + random_ids(rng, rng.randint(*args.input_len), vocab)}
                           for _ in range(args.num_requests)],
                          SamplingParams(temperature=0, max_tokens=out_len, ignore_eos=True)),
        "n = 8 samples": ([{"prompt_token_ids": random_ids(rng, args.prefix_len, vocab)}
                           for _ in range(max(1, args.num_requests // 8))],
                          SamplingParams(n=8, temperature=1.0, seed=args.seed, max_tokens=out_len, ignore_eos=True)),
    }
    engines = {"read once": {}, "plain": {"disable_cascade_attn": True},
               "own copies": {"enable_prefix_caching": False}}
    llms = {name: LLM(model_dir, **{**settings, **extra}) for name, extra in engines.items()}
    result = {"settings": {"model": model_dir, "num_requests": args.num_requests, "prefix_len": args.prefix_len,
                           "question_len": list(args.input_len), "output_len": out_len, "seed": args.seed,
                           "rounds": CASCADE_ROUNDS, **settings},
              "workloads": {}}
    for work, (prompts, params) in workloads.items():
        best, tokens = {}, {}
        names = [n for n in engines if work == "system prompt" or n != "own copies"]
        for llm in llms.values():
            warm_up(llm, SamplingParams(max_tokens=4))
        for _ in range(CASCADE_ROUNDS):
            for name in names:
                times = []
                with observing(llms[name], decode_step_times(times)):
                    outs = llms[name].generate(prompts, params, use_tqdm=False)
                mean = sum(times) / len(times)
                best[name] = min(best.get(name, mean), mean)
                tokens[name] = [c.token_ids for o in outs for c in o.outputs]
        result["workloads"][work] = {
            "rows": len(prompts) * params.n,
            "decode_step_ms": {n: 1e3 * t for n, t in best.items()},
            "speedup": best["plain"] / best["read once"],
            "identical_outputs": all(tokens[n] == tokens["read once"] for n in names),
        }
    return result
