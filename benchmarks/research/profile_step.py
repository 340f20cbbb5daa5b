"""One decode step under the torch profiler: how many torch ops it launches and where its
time goes (issue 12: "a profile of one decode step before and after, and the per-step
count of torch ops").

(In full: docs/07_benchmarks.md, "The benchmark modules in full".)
"""
from __future__ import annotations

import argparse
import collections
import random
import statistics
import time
from contextlib import contextmanager

import torch
from torch.profiler import ProfilerActivity, profile

import nanopaged.models.llama as llama
from benchmarks.report import print_profile, print_without
from benchmarks.trace import random_ids
from nanopaged import LLM, SamplingParams
from nanopaged.attention.torch_backend import TorchAttentionBackend
from nanopaged.models.demo_model import demo_model_path

GROUPS = {
    "matmul": ("aten::mm", "aten::addmm", "aten::linear", "aten::matmul", "mkldnn::_linear_pointwise",
               "nanopaged::linear_bf16"),
    "attention kernel": ("aten::_scaled_dot_product_flash_attention_for_cpu", "aten::scaled_dot_product_attention",
                         "aten::_scaled_dot_product_attention_math", "nanopaged::paged_attention"),
    "fused layer kernels": ("nanopaged::rms_norm", "nanopaged::add_rms_norm", "nanopaged::rotary_and_store",
                            "nanopaged::silu_and_mul"),
    "K/V gather": ("aten::index_select",),
    "K/V store": ("aten::index_copy_",),
    "sampling": ("aten::argmax", "aten::_log_softmax", "aten::log_softmax", "aten::softmax", "aten::multinomial"),
}
# mkldnn::_linear_pointwise: oneDNN's packed bfloat16 linears; nanopaged::: the C++ CPU kernels
# (nanopaged/cpu/csrc/), plain functions the profiler sees only through `labelled_kernels`
OP_PREFIXES = ("aten::", "mkldnn::", "nanopaged::")


@contextmanager
def decoding_engine(model: str, rows: int, seed: int = 0, dtype: str = "auto", **settings):
    """An engine with `rows` requests past their prompts: every further step is decode-only.
    The requests are aborted on the way out."""
    engine = LLM(model, cpu_threads=None, dtype=dtype, **settings).llm_engine
    rng = random.Random(seed)
    vocab = min(engine.runner.model_config.vocab_size, len(engine.tokenizer))
    for i in range(rows):
        prompt = random_ids(rng, rng.randint(32, 128), vocab)
        engine.add_request(f"profile-{i}", {"prompt_token_ids": prompt},
                           SamplingParams(temperature=0, max_tokens=1000, ignore_eos=True))
    scheduler = engine.scheduler
    while scheduler.waiting or any(r.num_computed_tokens < r.num_prompt_tokens for r in scheduler.running):
        engine.step()
    try:
        yield engine
    finally:
        for request_id in list(engine.output_processor.requests):
            engine.abort_request(request_id)


def step_ms(engine, steps: int = 7) -> float:
    times = []
    for _ in range(steps):
        start = time.perf_counter()
        engine.step()
        times.append(time.perf_counter() - start)
    return statistics.median(times) * 1e3


def profile_decode_step(model: str, rows: int, seed: int = 0, without: bool = False,
                        dtype: str = "auto", **settings) -> dict:
    """The step's time and profile; with `without`, also `times_without` on the same engine.
    `settings`: the engine's (cpu_kernels, quantization, ...)."""
    with decoding_engine(model, rows, seed, dtype, **settings) as engine:
        ms = step_ms(engine)
        with labelled_kernels(engine), profile(activities=[ProfilerActivity.CPU]) as prof:
            engine.step()
        fig = {"rows": rows, "step_ms": ms, **op_figures(prof.events())}
        if without:
            fig["without"] = times_without(engine, rows)
    return fig


@contextmanager
def labelled_kernels(engine):
    """nanopaged's C++ kernels are plain functions, not torch ops: while this is open each call is
    wrapped in a profiler range named nanopaged::<function>, so the profile counts and times it.
    Nothing changes outside it (the engine never pays for the labels)."""
    if engine.runner.fast_path.layers == "reference" and engine.runner.fast_path.linear != "dpbf16":
        yield
        return
    from nanopaged.cpu.build import cpu_ops
    ops = cpu_ops()
    names = [n for n in dir(ops) if not n.startswith("_") and callable(getattr(ops, n))]
    originals = {n: getattr(ops, n) for n in names}

    def labelled(name, fn):
        def call(*args):
            with torch.profiler.record_function(f"nanopaged::{name}"):
                return fn(*args)
        return call
    for n in names:
        setattr(ops, n, labelled(n, originals[n]))
    try:
        yield
    finally:
        for n, fn in originals.items():
            setattr(ops, n, fn)


# Each piece of a decoder layer, and the pass-through that stands in for it in `--without`.
PASS_THROUGH = {
    "attention": (TorchAttentionBackend, "forward", lambda self, q, k, v, k_cache, v_cache, meta, scale: q),
    "rmsnorm": (llama.RMSNorm, "forward", lambda self, x: x),
    "rotary": (llama, "apply_rotary", lambda x, rope: x),
    "silu_mul": (llama.MLP, "forward",
                 lambda self, x: self.down_proj(self.gate_up_proj(x)[:, :self.down_proj.in_features])),
}


def times_without(engine, rows: int) -> dict:
    """Decode step time (median of 7, unprofiled) with everything, then without each piece,
    then without all of them; the pieces are put back before returning."""
    originals = {name: getattr(owner, attr) for name, (owner, attr, _) in PASS_THROUGH.items()}

    def timed(names: list[str]) -> float:
        for name in names:
            owner, attr, stand_in = PASS_THROUGH[name]
            setattr(owner, attr, stand_in)
        try:
            return step_ms(engine)
        finally:
            for name in names:
                owner, attr, _ = PASS_THROUGH[name]
                setattr(owner, attr, originals[name])

    figures = {"rows": rows, "step_ms": timed([])}
    figures["without_ms"] = {name: timed([name]) for name in PASS_THROUGH}
    figures["without_all_ms"] = timed(list(PASS_THROUGH))
    return figures


def op_figures(events) -> dict:
    """Top-level aten ops (count by name) and self CPU time of all ops, grouped."""
    top = [e for e in events if e.name.startswith(OP_PREFIXES)
           and (e.cpu_parent is None or not e.cpu_parent.name.startswith(OP_PREFIXES))]
    group_of = {name: group for group, names in GROUPS.items() for name in names}
    self_ms = collections.Counter()
    for e in events:
        if e.name.startswith(OP_PREFIXES):
            self_ms[group_of.get(e.name, "other ops")] += e.self_cpu_time_total / 1e3
    return {"num_ops": len(top), "ops_by_name": dict(collections.Counter(e.name for e in top).most_common()),
            "self_ms_by_group": dict(self_ms.most_common())}


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rows", type=int, default=24, help="requests decoding together (default 24)")
    p.add_argument("--model", help="a Hugging Face folder (default: the demo model)")
    p.add_argument("--threads", type=int, help="torch CPU threads (default: torch's own)")
    p.add_argument("--dtype", default="auto", help="the engine's dtype (default auto); --without in bfloat16 "
                   "feeds garbage through the pass-throughs, whose huge values slow some kernels: time it in float32")
    p.add_argument("--cpu-kernels", default="auto", help="the engine's cpu_kernels: auto, fused, reference")
    p.add_argument("--cpu-linear", default="auto", help="the engine's cpu_linear: auto, packed, dpbf16, reference")
    p.add_argument("--quantization", help="the engine's quantization: gguf, int4, int8 (default: none)")
    p.add_argument("--without", action="store_true",
                   help="also time the step without each piece of the layer (unprofiled)")
    args = p.parse_args(argv)
    if args.rows < 1:
        p.error(f"--rows must be >= 1, got {args.rows}")
    if args.threads:
        torch.set_num_threads(args.threads)
    model = args.model or str(demo_model_path())
    fig = profile_decode_step(model, args.rows, without=args.without, dtype=args.dtype,
                              cpu_kernels=args.cpu_kernels, cpu_linear=args.cpu_linear, quantization=args.quantization)
    print_profile(fig)
    if args.without:
        print_without(fig["without"])
    return fig


if __name__ == "__main__":
    main()
