"""Tensor parallelism's figures: per-rank weight and KV bytes, bytes sent per step, throughput."""
from __future__ import annotations

import argparse

from benchmarks.models import RANDOM_CONFIGS, build_random_model, vocab_limit
from benchmarks.report import print_tensor_parallel_head, tensor_parallel_row
from benchmarks.nanopaged_run import greedy, timed_generate, token_prompts, warm_up
from benchmarks.trace import make_trace
from nanopaged import LLM, SamplingParams

def measure(model_dir: str, size: int, args) -> dict:
    llm = LLM(model_dir, tensor_parallel_size=size, num_kv_blocks=args.num_kv_blocks)
    runner = llm.llm_engine.runner
    memory = getattr(runner, "memory", None) or [
        [sum(p.nbytes for p in runner.model.parameters()), runner.kv_cache.nbytes]]
    trace = make_trace(args.num_requests, args.input_len, args.output_len, args.seed, vocab_limit(model_dir))
    warm_up(llm, SamplingParams(max_tokens=4))
    sent_before, steps_before = getattr(runner, "bytes_sent", 0), getattr(runner, "steps_sent", 0)
    wall = timed_generate(llm, token_prompts(trace.prompts), [greedy(n) for n in trace.output_lens])[0]["wall_s"]
    steps = getattr(runner, "steps_sent", 0) - steps_before
    sent = getattr(runner, "bytes_sent", 0) - sent_before
    if size > 1:
        runner.shutdown()
    return {"size": size, "memory": memory, "wall_s": wall, "out_tok_s": trace.num_output_tokens / wall,
            "bytes_per_step": sent / steps if steps else 0.0, "steps": steps}


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="python -m benchmarks.research.tensor_parallel")
    p.add_argument("--random-weights", choices=sorted(RANDOM_CONFIGS), default="qwen3-0.6b")
    p.add_argument("--sizes", type=int, nargs="+", default=[1, 2])
    p.add_argument("--num-requests", type=int, default=16)
    p.add_argument("--input-len", type=int, nargs=2, default=(32, 128))
    p.add_argument("--output-len", type=int, nargs=2, default=(16, 64))
    p.add_argument("--num-kv-blocks", type=int, default=256)
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    model_dir = str(build_random_model(args.random_weights))
    print_tensor_parallel_head(args)
    for size in args.sizes:
        print(tensor_parallel_row(measure(model_dir, size, args)), flush=True)


if __name__ == "__main__":
    main()
