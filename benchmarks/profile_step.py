"""One decode step under the torch profiler: how many torch ops it launches and where its
time goes (issue 12: "a profile of one decode step before and after, and the per-step
count of torch ops").

    python -m benchmarks.profile_step [--rows 24] [--model DIR] [--threads 2]

It queues `--rows` requests with prompts of the default trace's lengths, steps until every
one of them decodes, times a few decode-only steps, then profiles one more. Ops are
counted at the top level (an aten op called from Python, not the ones it calls inside),
and their self time is grouped into what a reader can act on: the matmuls, attention
(gathering K/V from the blocks and the attention kernel), storing K/V, and the rest.
"""
from __future__ import annotations

import argparse
import collections
import random
import statistics
import time

import torch
from torch.profiler import ProfilerActivity, profile

from nanopaged import LLM, SamplingParams
from nanopaged.extras.demo_model import demo_model_path

GROUPS = {
    "matmul": ("aten::mm", "aten::addmm", "aten::linear", "aten::matmul"),
    "attention kernel": ("aten::_scaled_dot_product_flash_attention_for_cpu", "aten::scaled_dot_product_attention",
                         "aten::_scaled_dot_product_attention_math"),
    "K/V gather": ("aten::index_select",),
    "K/V store": ("aten::index_copy_",),
    "sampling": ("aten::argmax", "aten::_log_softmax", "aten::log_softmax", "aten::softmax", "aten::multinomial"),
}


def profile_decode_step(model: str, rows: int, seed: int = 0) -> dict:
    llm = LLM(model, cpu_threads=None)
    engine = llm.llm_engine
    rng = random.Random(seed)
    vocab = min(engine.runner.model_config.vocab_size, len(engine.tokenizer))
    for i in range(rows):
        prompt = [rng.randrange(3, vocab) for _ in range(rng.randint(32, 128))]
        engine.add_request(f"profile-{i}", {"prompt_token_ids": prompt},
                           SamplingParams(temperature=0, max_tokens=1000, ignore_eos=True))
    scheduler = engine.scheduler
    while scheduler.waiting or any(r.num_computed_tokens < r.num_prompt_tokens for r in scheduler.running):
        engine.step()
    times = []
    for _ in range(7):
        start = time.perf_counter()
        engine.step()
        times.append(time.perf_counter() - start)
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        engine.step()
    for request_id in list(engine.output_processor.requests):
        engine.abort_request(request_id)
    return {"rows": rows, "step_ms": statistics.median(times) * 1e3, **op_figures(prof.events())}


def op_figures(events) -> dict:
    """Top-level aten ops (count by name) and self CPU time of all ops, grouped."""
    top = [e for e in events if e.name.startswith("aten::")
           and (e.cpu_parent is None or not e.cpu_parent.name.startswith("aten::"))]
    group_of = {name: group for group, names in GROUPS.items() for name in names}
    self_ms = collections.Counter()
    for e in events:
        if e.name.startswith("aten::"):
            self_ms[group_of.get(e.name, "other ops")] += e.self_cpu_time_total / 1e3
    return {"num_ops": len(top), "ops_by_name": dict(collections.Counter(e.name for e in top).most_common()),
            "self_ms_by_group": dict(self_ms.most_common())}


def print_profile(fig: dict, top: int = 12) -> None:
    print(f"decode step, {fig['rows']} rows: {fig['step_ms']:.1f} ms (median of 7, unprofiled); "
          f"{fig['num_ops']} torch ops launched")
    total = sum(fig["self_ms_by_group"].values())
    for group, ms in fig["self_ms_by_group"].items():
        print(f"  {group:17s} {ms:7.1f} ms  {ms / total:6.1%}")
    print("  most launched: " + ", ".join(f"{n.removeprefix('aten::')} {c}"
                                           for n, c in list(fig["ops_by_name"].items())[:top]))


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rows", type=int, default=24, help="requests decoding together (default 24)")
    p.add_argument("--model", help="a Hugging Face folder (default: the demo model)")
    p.add_argument("--threads", type=int, help="torch CPU threads (default: torch's own)")
    args = p.parse_args(argv)
    if args.rows < 1:
        p.error(f"--rows must be >= 1, got {args.rows}")
    if args.threads:
        torch.set_num_threads(args.threads)
    fig = profile_decode_step(args.model or str(demo_model_path()), args.rows)
    print_profile(fig)
    return fig


if __name__ == "__main__":
    main()
