"""Parallel layouts side by side on one host, each rank on one thread: one process, tensor parallelism (TP=2),
pipeline parallelism (PP=2) with one batch at a time and with micro-batches; then experts across ranks
(EP=2) against experts sliced (TP=2) on a mixture of experts.

    python -m benchmarks.research.parallel [--dense smollm2-135m-8h] [--moe olmoe-1b-7b-quarter]

Per layout: memory per rank (weights + K/V, as a share of one process's), bytes crossing ranks per step
(TP: the step message and every all-reduce and gather, counted on rank 0; PP: step messages and hidden
states between stages, the logit rows' normed hidden states back), output tokens/s, each rank's bubble (a
pipeline's stage: 1 - busy / wall; TP's ranks run in lockstep: none measured) and whether its greedy tokens
equal one process's.
Shapes (benchmarks/data/model_shapes.json): the demo model's with 8 query and 2 KV heads of 64, since its
9 and 3 do not split in two; OLMoE-1B-7B's at a quarter (hidden 512, expert width 256, 4 of 16 layers,
its 64 experts and top-8 kept). docs/09_tensor_parallel.md.
"""
from __future__ import annotations

import argparse
import os

import torch

from benchmarks.models import build_random_model, vocab_limit
from benchmarks.nanopaged_run import greedy, timed_generate, token_prompts, warm_up
from benchmarks.trace import make_trace
from nanopaged import LLM

DENSE_LAYOUTS = {"1": {}, "TP=2": {"tensor_parallel_size": 2},
                 "PP=2, 1 batch": {"pipeline_parallel_size": 2, "max_concurrent_batches": 1},
                 "PP=2, 2 batches": {"pipeline_parallel_size": 2}}
MOE_LAYOUTS = {"1": {}, "TP=2, experts sliced": {"tensor_parallel_size": 2},
               "EP=2": {"tensor_parallel_size": 2, "enable_expert_parallel": True}}


class Counted:
    """Wraps rank 0's collectives (TP) to count the bytes each one moves."""

    def __init__(self, group) -> None:
        self.bytes = 0
        for name in ("all_reduce", "gather_to_driver"):
            setattr(group, name, self.counting(getattr(group, name)))

    def counting(self, collective):
        def counted(x):
            self.bytes += x.nbytes
            return collective(x)
        return counted


def measure(model_dir: str, layout: dict, trace, args) -> dict:
    settings = dict(layout)
    batches = settings.pop("max_concurrent_batches", None)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)           # the one process's thread; ranks take cores // LOCAL_WORLD_SIZE = 1
    llm = LLM(model_dir, dtype=args.dtype, num_kv_blocks=args.num_kv_blocks, cpu_threads=None, **settings)
    runner = llm.llm_engine.runner
    try:
        if batches:
            runner.max_concurrent_batches = batches          # the batch queue reads it every step
        tensor_only = bool(settings) and "pipeline_parallel_size" not in settings
        counted = Counted(runner.group) if tensor_only else None
        warm_up(llm)
        llm.reset_stats()
        sent = getattr(runner, "bytes_sent", 0)
        if counted:
            counted.bytes = 0
        timing, outs = timed_generate(llm, token_prompts(trace.prompts), [greedy(n) for n in trace.output_lens])
        stats = llm.get_stats()
        pipeline = stats.get("pipeline_parallel")      # installed only under pipeline parallelism
        memory = getattr(runner, "memory", None) or [[sum(p.nbytes for p in runner.model.parameters()),
                                                      runner.kv_cache.nbytes]]
        if pipeline is not None:
            per_step, bubble = pipeline["bytes_between_stages_per_batch"], pipeline["bubble"]
        else:
            steps = stats["num_steps"]
            moved = getattr(runner, "bytes_sent", 0) - sent + (counted.bytes if counted else 0)
            per_step, bubble = (moved / steps if steps else 0.0), None
        return {"memory": memory, "bytes_per_step": per_step, "out_tok_s": timing["output_tokens_per_s"],
                "bubble": bubble, "steps": stats["num_steps"], "tokens": [o.outputs[0].token_ids for o in outs]}
    finally:
        if settings:
            runner.shutdown()
        torch.set_num_threads(threads)


def table(title: str, model_dir: str, layouts: dict, args) -> None:
    trace = make_trace(args.num_requests, args.input_len, args.output_len, args.seed, vocab_limit(model_dir))
    print(f"\n{title}: {args.num_requests} requests, input {args.input_len[0]}-{args.input_len[1]}, output "
          f"{args.output_len[0]}-{args.output_len[1]} tokens, {args.dtype}, {args.num_kv_blocks} KV blocks")
    print("| layout | memory per rank (% of one process) | bytes crossing ranks per step | out tok/s | "
          "bubble per rank | greedy tokens equal to 1 |")
    print("|---|---|---|---|---|---|")
    whole = None
    for name, layout in layouts.items():
        r = measure(model_dir, layout, trace, args)
        whole = whole or r
        total = sum(map(sum, whole["memory"]))
        memory = " / ".join(f"{sum(m) / 2**20:.1f} MiB ({sum(m) / total:.0%})" for m in r["memory"])
        bubble = " / ".join(f"{b:.0%}" for b in r["bubble"]) if r["bubble"] is not None else "-"
        equal = "yes" if r["tokens"] == whole["tokens"] else "NO"
        print(f"| {name} | {memory} | {r['bytes_per_step']:,.0f} | {r['out_tok_s']:.1f} | {bubble} | {equal} |",
              flush=True)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="python -m benchmarks.research.parallel")
    p.add_argument("--dense", default="smollm2-135m-8h", help="a dense shape of benchmarks/data/model_shapes.json")
    p.add_argument("--moe", default="olmoe-1b-7b-quarter", help="a mixture-of-experts shape, for EP=2 against TP=2")
    p.add_argument("--num-requests", type=int, default=32)   # enough to share out: a short tail
    p.add_argument("--input-len", type=int, nargs=2, default=(32, 64))
    p.add_argument("--output-len", type=int, nargs=2, default=(32, 64))
    p.add_argument("--num-kv-blocks", type=int, default=512)
    p.add_argument("--dtype", default="float32", help="float32: greedy tokens comparable bit for bit")
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    # every rank one thread: a rank takes cores // LOCAL_WORLD_SIZE (tensor_parallel/parallel_state.py)
    before = os.environ.get("LOCAL_WORLD_SIZE")
    os.environ["LOCAL_WORLD_SIZE"] = str(os.cpu_count() or 1)
    try:
        table(f"{args.dense} (random weights)", str(build_random_model(args.dense)), DENSE_LAYOUTS, args)
        table(f"{args.moe} (random weights)", str(build_random_model(args.moe)), MOE_LAYOUTS, args)
    finally:
        if before is None:
            del os.environ["LOCAL_WORLD_SIZE"]
        else:
            os.environ["LOCAL_WORLD_SIZE"] = before


if __name__ == "__main__":
    main()
