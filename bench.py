"""bench.py: nanopaged's throughput and KV-memory efficiency, side by side with its peers.

    python bench.py                              # CPU-sized default, peers hf and hf-paged
    python bench.py --preset nano-vllm --random-weights qwen3-0.6b --device cuda
    python bench.py --json out.json --plot out.png

Throughput follows nano-vllm's bench.py: seeded random token-id prompts, input and output
lengths uniform in a range, `ignore_eos=True`, one warm-up, then output tokens / wall time
of the timed generation. Every peer runs in the same process on the same prompts and
lengths. Memory efficiency follows the paper (Fig. 2, section 6): the share of the KV slots
held that store a real token, for PagedAttention and for the reservation allocators it
replaced, on the same running set. docs/benchmarks.md explains every number.

The file reads top-down: settings, the trace, the model, one runner per engine, the
metrics, the table, main.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import random
import shutil
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import NamedTuple

import torch

from nanopaged import LLM, SamplingParams
from nanopaged.block_pool import cdiv
from nanopaged.demo_model import cache_dir, demo_model_path
from nanopaged.models import ModelConfig

# ==== settings ===========================================================================

# Sized so the whole default run (nanopaged + hf + hf-paged, loading and warm-ups included)
# takes about a minute with the demo model on a quiet 2-core CPU (measured: 56-59 s).
DEFAULTS = dict(num_requests=32, input_len=(32, 128), output_len=(16, 64))
# nano-vllm's bench.py: 256 requests, lengths uniform in 100..1024 (a GPU-sized run).
PRESETS = {"nano-vllm": dict(num_requests=256, input_len=(100, 1024), output_len=(100, 1024))}
PEERS = ("hf", "hf-paged", "vllm")
WORKLOADS = ("throughput", "shared-prefix", "sharing")
# shared-prefix: each request = one system prompt (--prefix-len) + its own question.
SHARED_PREFIX_DEFAULTS = dict(num_requests=64, input_len=(16, 48), output_len=(8, 16))

# Published, not measured here: nano-vllm's README (RTX 4070 Laptop, Qwen3-0.6B, 256
# requests, lengths 100..1024). Shown apart from measured figures, never in a ratio.
PUBLISHED = {
    "source": "nano-vllm README (GeeeekExplorer/nano-vllm)",
    "setup": "RTX 4070 Laptop GPU, Qwen3-0.6B, 256 requests, input/output 100-1024",
    "output_tokens_per_s": {"vllm": 1361.84, "nano-vllm": 1434.13},
}

# Random-weight models for machines with no model files: a config written inline, weights
# drawn once and cached. qwen3-0.6b is nano-vllm's benchmark shape; tiny-qwen3 is for tests.
RANDOM_CONFIGS = {
    "qwen3-0.6b": dict(hidden_size=1024, num_hidden_layers=28, num_attention_heads=16,
                       num_key_value_heads=8, head_dim=128, intermediate_size=3072,
                       vocab_size=151936, rope_theta=1_000_000.0, max_position_embeddings=40960,
                       tie_word_embeddings=True, rms_norm_eps=1e-6),
    "tiny-qwen3": dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                       num_key_value_heads=2, head_dim=32, intermediate_size=128,
                       vocab_size=49152, rope_theta=1_000_000.0, max_position_embeddings=2048,
                       tie_word_embeddings=True, rms_norm_eps=1e-6),
}

# What the issue asks nanopaged to reach; reported, met or not.
TARGETS = {"speedup_vs_hf": 3.0, "roofline_fraction": 0.5, "kv_utilization_paged": 0.9,
           "schedule_share": 0.05}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--workload", choices=WORKLOADS, default="throughput",
                   help="throughput (vs peers, default); shared-prefix (prefix caching on vs off); "
                        "sharing (KV saved by n > 1 and beam search)")
    p.add_argument("--prefix-len", type=int, default=256,
                   help="shared-prefix: tokens of the system prompt every request starts with")
    p.add_argument("--preset", choices=sorted(PRESETS), help="a named trace size (default: CPU-sized)")
    p.add_argument("--num-requests", type=int, help=f"default {DEFAULTS['num_requests']}")
    p.add_argument("--input-len", type=int, nargs=2, metavar=("MIN", "MAX"),
                   help=f"prompt tokens, uniform; default {DEFAULTS['input_len']}")
    p.add_argument("--output-len", type=int, nargs=2, metavar=("MIN", "MAX"),
                   help=f"output tokens, uniform; default {DEFAULTS['output_len']}")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--model", help="a local Hugging Face folder (default: the demo model)")
    p.add_argument("--random-weights", choices=sorted(RANDOM_CONFIGS), metavar="CONFIG",
                   help=f"build a model with random weights: {', '.join(RANDOM_CONFIGS)}")
    p.add_argument("--peers", "--peer", default="hf,hf-paged",
                   help=f"comma-separated, from {', '.join(PEERS)}; 'none' for none (default hf,hf-paged)")
    p.add_argument("--hf-batch-size", type=int, default=16, help="static batch size of the hf peer")
    p.add_argument("--threads", type=int,
                   help="torch CPU threads for every engine (default: torch's, one per core); "
                        "1 on a shared machine, where threads waiting for a busy core stall every op")
    # engine settings, passed through to nanopaged (and mirrored in the peers where they exist)
    for name in ("--max-num-seqs", "--max-num-batched-tokens", "--num-kv-blocks", "--block-size",
                 "--max-model-len"):
        p.add_argument(name, type=int, help="nanopaged engine setting (README); default: the engine's")
    p.add_argument("--dtype", help="auto, float32, bfloat16, float16 (all engines)")
    p.add_argument("--device", help="auto, cpu, cuda (all engines)")
    p.add_argument("--json", metavar="PATH", help="write every figure as JSON")
    p.add_argument("--plot", metavar="PATH", help="draw KV slots over time and throughput (matplotlib)")
    args = p.parse_args(argv)

    # A trace flag given on the command line wins over the preset, the preset over DEFAULTS.
    defaults = SHARED_PREFIX_DEFAULTS if args.workload == "shared-prefix" else DEFAULTS
    for name, value in {**defaults, **PRESETS.get(args.preset, {})}.items():
        if getattr(args, name) is None:
            setattr(args, name, value)
    args.peers = [] if args.peers == "none" else [x.strip() for x in args.peers.split(",") if x.strip()]
    for peer in args.peers:
        if peer not in PEERS:
            p.error(f"unknown peer {peer!r}; choose from {', '.join(PEERS)}")
    for name in ("input_len", "output_len"):
        lo, hi = getattr(args, name)
        if not 1 <= lo <= hi:
            p.error(f"--{name.replace('_', '-')} needs 1 <= MIN <= MAX, got {lo} {hi}")
    if args.num_requests < 1:
        p.error(f"--num-requests must be >= 1, got {args.num_requests}")
    if args.threads is not None and args.threads < 1:
        p.error(f"--threads must be >= 1, got {args.threads}")
    if args.model and args.random_weights:
        p.error("give --model or --random-weights, not both")
    return args


def engine_settings(args) -> dict:
    """The engine settings given on the command line (the rest keep nanopaged's defaults)."""
    names = ("max_num_seqs", "max_num_batched_tokens", "num_kv_blocks", "block_size",
             "max_model_len", "dtype", "device")
    return {n: getattr(args, n) for n in names if getattr(args, n) is not None}


# ==== the trace ==========================================================================

@dataclass
class Trace:
    prompts: list[list[int]]     # token ids
    output_lens: list[int]       # tokens each request must generate (ignore_eos)

    @property
    def num_prompt_tokens(self) -> int:
        return sum(map(len, self.prompts))

    @property
    def num_output_tokens(self) -> int:
        return sum(self.output_lens)


def make_trace(num_requests: int, input_len, output_len, seed: int, vocab_limit: int) -> Trace:
    """nano-vllm's trace: random token ids and uniform lengths, all from one seeded generator.

    Ids start at 3 so a prompt holds no special token (0, 1, 2 are unk/bos/eos in the demo
    tokenizer); `vocab_limit` keeps them inside both the model's and the tokenizer's vocab.
    """
    rng = random.Random(seed)
    prompts = [[rng.randrange(3, vocab_limit) for _ in range(rng.randint(*input_len))]
               for _ in range(num_requests)]
    return Trace(prompts, [rng.randint(*output_len) for _ in range(num_requests)])


# ==== the model ==========================================================================

def resolve_model(args) -> str:
    if args.random_weights:
        return str(build_random_model(args.random_weights))
    return str(args.model) if args.model else str(demo_model_path())


def build_random_model(name: str) -> Path:
    """A Hugging Face folder with `name`'s shape and random weights, made once and cached.

    The tokenizer is the demo model's (vocab 49152); a bigger model vocab (Qwen3: 151936)
    is kept for its true cost, and make_trace draws ids below the tokenizer's size.
    """
    folder = cache_dir() / "bench" / f"{name}-random"
    if (folder / "model.safetensors").is_file():
        return folder
    from transformers import AutoModelForCausalLM, Qwen3Config
    print(f"bench: writing random weights for {name} into {folder} (once)", file=sys.stderr)
    cfg = dict(RANDOM_CONFIGS[name])
    config = Qwen3Config(**cfg, bos_token_id=1, eos_token_id=2, pad_token_id=2,
                         architectures=["Qwen3ForCausalLM"])
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    tmp = folder.with_name(folder.name + f".tmp-{os.getpid()}")
    model.save_pretrained(tmp, safe_serialization=True)   # writes generation_config.json too
    demo = demo_model_path()
    for f in demo.iterdir():
        if f.name.startswith(("tokenizer", "chat_template", "special_tokens")):
            shutil.copy(f, tmp / f.name)
    shutil.rmtree(folder, ignore_errors=True)
    os.rename(tmp, folder)                                # a half-written folder is never used
    return folder


def vocab_limit(model_dir: str) -> int:
    from transformers import AutoTokenizer
    return min(ModelConfig.from_folder(model_dir).vocab_size,
               len(AutoTokenizer.from_pretrained(model_dir)))


# ==== runners: nanopaged =================================================================

# Every engine warms up on this prompt: ids 3..18 start no random prompt, so the warm-up
# leaves nothing in a prefix cache that the trace could hit.
WARMUP_PROMPT = {"prompt_token_ids": list(range(3, 19))}
# get_stats() counters that grow over the engine's life (the rest are peaks, ratios, sizes).
COUNTERS = ("num_steps", "num_preemptions", "prefix_cache_queries", "prefix_cache_hits",
            "num_prompt_tokens_computed", "num_generated_tokens", "model_time_s", "schedule_time_s")

@dataclass
class Run:
    """One engine's timed generation."""
    name: str
    wall_s: float
    output_tokens: int           # only the tokens each request asked for
    prompt_tokens: int
    num_requests: int
    extra: dict

    def figures(self) -> dict:
        return {"output_tokens_per_s": self.output_tokens / self.wall_s,
                "total_tokens_per_s": (self.output_tokens + self.prompt_tokens) / self.wall_s,
                "requests_per_s": self.num_requests / self.wall_s,
                "wall_s": self.wall_s, "output_tokens": self.output_tokens,
                "prompt_tokens": self.prompt_tokens, **self.extra}


def run_nanopaged(model_dir: str, trace: Trace, settings: dict) -> tuple[Run, dict, list, dict]:
    """Warm up, then step the engine through the trace and look at KV memory every step.

    This is LLM.generate's own loop (validate all, queue all, step until done) without the
    progress bar, so that after each step we can see which requests held blocks during it.
    The look costs O(running requests) per step; it is timed and stays inside wall_s.
    Returns the run, get_stats(), the per-step KV samples and the settings as resolved.
    """
    llm = LLM(model_dir, **settings)
    engine = llm.llm_engine
    llm.generate(WARMUP_PROMPT, SamplingParams(temperature=0, max_tokens=4, ignore_eos=True),
                 use_tqdm=False)
    # Count only the timed run. There is no reset hook yet: sums and peaks live in
    # engine.stats (start it afresh), counters kept elsewhere are subtracted below.
    engine.stats = type(engine.stats)()
    before = engine.get_stats()

    requests = [engine.make_request(f"bench-{i}", {"prompt_token_ids": p},
                                    SamplingParams(temperature=0, max_tokens=n, ignore_eos=True))
                for i, (p, n) in enumerate(zip(trace.prompts, trace.output_lens))]
    by_id = {r.request_id: r for r in requests}
    samples, look_s = [], 0.0
    start = time.perf_counter()
    for r in requests:
        engine.submit(r)
    while engine.has_unfinished_requests():
        outputs = engine.step()
        t = time.perf_counter()
        finished = [by_id[o.request_id] for o in outputs if o.finished]
        samples.append(kv_sample(t - start, engine.scheduler.running + finished, engine.config))
        look_s += time.perf_counter() - t
    wall = time.perf_counter() - start

    stats = engine.get_stats()
    for name in COUNTERS:
        stats[name] -= before.get(name, 0)
    run = Run("nanopaged", wall, sum(r.num_output_tokens for r in requests),
              trace.num_prompt_tokens, len(requests), {"kv_look_s": look_s})
    cfg = engine.config                      # defaults filled in by the engine
    resolved = {"block_size": cfg.block_size, "max_num_seqs": cfg.max_num_seqs,
                "max_num_batched_tokens": cfg.max_num_batched_tokens,
                "max_model_len": cfg.max_model_len, "num_kv_blocks": stats["num_kv_blocks"]}
    return run, stats, samples, resolved


class KVSample(NamedTuple):
    """KV slots in one step (tokens), for the requests that held blocks during it."""
    t: float                   # seconds into the timed run
    num_running: int
    stored: int                # tokens whose K/V is in the cache
    paged: int                 # slots of the blocks held
    reserve_needed: int        # slots if each reserved prompt + max_tokens
    reserve_max_len: int       # slots if each reserved max_model_len


def kv_sample(t: float, held_by: list, config) -> KVSample:
    """One step's KV figures for the requests that held blocks during it.

    After step() a request's num_computed_tokens counts this step's tokens and, allocation
    being on demand, it held exactly cdiv(num_computed_tokens, block_size) blocks (the same
    figures the engine's _record_memory takes). A reservation allocator would have held,
    for the same requests, max_model_len slots each, or prompt + max_tokens slots each.
    """
    bs = config.block_size
    stored = sum(r.num_computed_tokens for r in held_by)
    paged = sum(cdiv(r.num_computed_tokens, bs) for r in held_by) * bs
    reserve_max_len = len(held_by) * config.max_model_len
    reserve_needed = sum(r.num_prompt_tokens + r.max_tokens for r in held_by)
    return KVSample(t, len(held_by), stored, paged, reserve_needed, reserve_max_len)


# ==== runners: Hugging Face transformers ================================================

def load_hf(model_dir: str, settings: dict):
    from transformers import AutoModelForCausalLM
    from transformers.utils import logging as hf_logging
    hf_logging.set_verbosity_error()          # its warnings about unused sampling flags are noise here
    device, dtype = hf_device_dtype(settings)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype, attn_implementation="sdpa",
                                                 local_files_only=True)
    return model.to(device).eval()


def hf_device_dtype(settings: dict) -> tuple[str, torch.dtype]:
    """The same device and dtype nanopaged resolves ('auto': CUDA + bfloat16, else CPU + float32)."""
    from nanopaged.model_runner import resolve_device, resolve_dtype
    device = resolve_device(settings.get("device", "auto"))
    return str(device), resolve_dtype(settings.get("dtype", "auto"), device)


def run_hf_static(model_dir: str, trace: Trace, settings: dict, batch_size: int) -> Run:
    """The reservation-style baseline: static batches, left-padded to the longest prompt.

    Each batch decodes until its longest request is done (min_new_tokens = max_new_tokens
    bans EOS, as ignore_eos does); a request counts only the tokens it asked for, so the
    rows a finished request keeps decoding are padded compute, measured as `padding_waste`.
    """
    model = load_hf(model_dir, settings)
    pad = model.generation_config.pad_token_id or 0
    batches = [range(i, min(i + batch_size, len(trace.prompts)))
               for i in range(0, len(trace.prompts), batch_size)]
    hf_generate(model, [WARMUP_PROMPT["prompt_token_ids"]], 4, pad)
    start = time.perf_counter()
    for b in batches:
        hf_generate(model, [trace.prompts[i] for i in b], max(trace.output_lens[i] for i in b), pad)
    wall = time.perf_counter() - start
    held = sum(len(b) * (max(len(trace.prompts[i]) for i in b) + max(trace.output_lens[i] for i in b))
               for b in batches)
    real = trace.num_prompt_tokens + trace.num_output_tokens
    return Run("hf", wall, trace.num_output_tokens, trace.num_prompt_tokens, len(trace.prompts),
               {"batch_size": batch_size, "padding_waste": 1 - real / held,
                "kv_utilization": hf_static_kv_utilization(trace, batches)})


@torch.inference_mode()
def hf_generate(model, prompts: list[list[int]], max_new_tokens: int, pad: int) -> None:
    longest = max(map(len, prompts))
    ids = torch.tensor([[pad] * (longest - len(p)) + p for p in prompts], device=model.device)
    mask = torch.tensor([[0] * (longest - len(p)) + [1] * len(p) for p in prompts], device=model.device)
    model.generate(input_ids=ids, attention_mask=mask, do_sample=False, pad_token_id=pad,
                   max_new_tokens=max_new_tokens, min_new_tokens=max_new_tokens)


def hf_static_kv_utilization(trace: Trace, batches) -> float:
    """Real tokens / slots of HF's padded cache, summed over its decode steps (a model of the trace).

    At decode step t a batch's cache is batch x (longest prompt + t) slots; request i stores
    min(p_i + t, p_i + o_i) real tokens (after it is done, its row is waste).
    """
    stored = held = 0
    for b in batches:
        longest, steps = max(len(trace.prompts[i]) for i in b), max(trace.output_lens[i] for i in b)
        for t in range(1, steps + 1):
            held += len(b) * (longest + t)
            stored += sum(len(trace.prompts[i]) + min(t, trace.output_lens[i]) for i in b)
    return stored / held


def run_hf_paged(model_dir: str, trace: Trace, settings: dict, engine: dict) -> Run:
    """transformers' own continuous batching over a paged KV cache (`generate_batch`'s engine).

    We drive its manager directly rather than call `model.generate_batch`, because that takes
    one max_new_tokens for all requests and the trace gives each its own. The KV cache gets
    nanopaged's block size and block count, so both engines have the same KV budget.
    """
    from transformers import GenerationConfig
    from transformers.generation import ContinuousBatchingConfig
    model = load_hf(model_dir, settings)
    gen = GenerationConfig(do_sample=False, max_new_tokens=max(trace.output_lens), eos_token_id=-1)
    cb = ContinuousBatchingConfig(page_size=engine["block_size"], num_blocks=engine["num_kv_blocks"],
                                  max_batch_tokens=engine["max_num_batched_tokens"],
                                  max_requests_per_batch=engine["max_num_seqs"])
    with model.continuous_batching_context_manager(generation_config=gen, continuous_batching_config=cb,
                                                   warmup=False) as manager:
        cb_generate(manager, [WARMUP_PROMPT["prompt_token_ids"]], [4])
        start = time.perf_counter()
        results = cb_generate(manager, trace.prompts, trace.output_lens)
        wall = time.perf_counter() - start
    out = sum(min(len(r.generated_tokens), n) for r, n in zip(results, trace.output_lens))
    return Run("hf-paged", wall, out, trace.num_prompt_tokens, len(results),
               {"attn_implementation": model.config._attn_implementation})


def cb_generate(manager, prompts, output_lens) -> list:
    ids = [manager.add_request(p, request_id=f"bench-{time.monotonic_ns()}-{i}", max_new_tokens=n,
                               eos_token_id=-1)       # -1: no EOS, as ignore_eos
           for i, (p, n) in enumerate(zip(prompts, output_lens))]
    results = {}
    while len(results) < len(ids):
        r = manager.get_result(timeout=1)
        if r is not None and r.is_finished():
            if r.error is not None:
                raise RuntimeError(f"transformers continuous batching failed: {r.error}")
            results[r.request_id] = r
        elif r is None and not manager.is_running():
            raise RuntimeError("transformers continuous batching stopped before finishing")
    return [results[i] for i in ids]


# ==== runners: vLLM ======================================================================

def run_vllm(model_dir: str, trace: Trace, settings: dict) -> Run:
    """vLLM's offline API on the same prompts; only where `import vllm` works."""
    from vllm import LLM as VLLM, SamplingParams as VParams
    from vllm.inputs import TokensPrompt
    kwargs = {k: v for k, v in settings.items() if k in ("max_num_seqs", "max_num_batched_tokens",
                                                         "block_size", "max_model_len", "dtype")}
    if "num_kv_blocks" in settings:
        kwargs["num_gpu_blocks_override"] = settings["num_kv_blocks"]
    llm = VLLM(model_dir, **kwargs)
    llm.generate([TokensPrompt(**WARMUP_PROMPT)], VParams(max_tokens=4), use_tqdm=False)
    prompts = [TokensPrompt(prompt_token_ids=p) for p in trace.prompts]
    params = [VParams(temperature=0, max_tokens=n, ignore_eos=True) for n in trace.output_lens]
    start = time.perf_counter()
    outs = llm.generate(prompts, params, use_tqdm=False)
    wall = time.perf_counter() - start
    return Run("vllm", wall, sum(len(o.outputs[0].token_ids) for o in outs),
               trace.num_prompt_tokens, len(outs), {})


def run_peer(name: str, model_dir: str, trace: Trace, args, settings: dict, resolved: dict) -> dict:
    """One peer's figures, or why it did not run (the table says so instead of a number)."""
    if name == "vllm":
        try:
            import vllm  # noqa: F401
        except ImportError:
            return {"skipped": "vllm is not installed here; its published figures are shown apart"}
    try:
        if name == "hf":
            return run_hf_static(model_dir, trace, settings, args.hf_batch_size).figures()
        if name == "hf-paged":
            return run_hf_paged(model_dir, trace, settings, resolved).figures()
        return run_vllm(model_dir, trace, settings).figures()
    except Exception as e:                   # a peer failing is a result to report, not a crash
        return {"skipped": f"{type(e).__name__}: {e}"}


# ==== metrics ============================================================================

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


def measure_matmul_flops(device: str, dtype: torch.dtype) -> float:
    """Best FLOP/s of square matmuls on this machine: the ceiling the model's matmuls work under."""
    best = 0.0
    for n in (1024, 2048):
        a = torch.randn(n, n, device=device, dtype=dtype)
        b = torch.randn(n, n, device=device, dtype=dtype)
        for _ in range(4):
            _sync(device)
            t = time.perf_counter()
            a @ b
            _sync(device)
            best = max(best, 2 * n ** 3 / (time.perf_counter() - t))
    return best


def _sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def trace_flops(m: ModelConfig, trace: Trace) -> dict:
    """Model FLOPs the trace needs, counting what nanopaged computes.

    Every token: 2 x (weights of the decoder layers). Logits (2 x vocab x hidden) only for
    the tokens that are sampled, one per output token. Attention, causal: 4 x layers x heads
    x head_dim x (context length) per token (QK^T and PV). Embedding lookups and norms: none.
    """
    q, kv = m.num_attention_heads * m.head_dim, m.num_key_value_heads * m.head_dim
    layer = m.hidden_size * (2 * q + 2 * kv) + 3 * m.hidden_size * m.intermediate_size
    linear = 2 * m.num_hidden_layers * layer * (trace.num_prompt_tokens + trace.num_output_tokens)
    logits = 2 * m.vocab_size * m.hidden_size * trace.num_output_tokens
    ctx = sum(n * (n + 1) // 2 for n in (len(p) + o for p, o in zip(trace.prompts, trace.output_lens)))
    attention = 4 * m.num_hidden_layers * q * ctx
    return {"linear": linear, "logits": logits, "attention": attention,
            "total": linear + logits + attention}


def roofline_figures(m: ModelConfig, trace: Trace, run: Run, device: str, dtype: torch.dtype) -> dict:
    peak = measure_matmul_flops(device, dtype)
    flops = trace_flops(m, trace)
    tokens = trace.num_prompt_tokens + trace.num_output_tokens
    per_token = flops["total"] / tokens
    return {"matmul_flops_per_s": peak, "flops_per_token": per_token,
            "flops_share": {k: v / flops["total"] for k, v in flops.items() if k != "total"},
            "roofline_tokens_per_s": peak / per_token,
            "fraction": (tokens / run.wall_s) / (peak / per_token)}


def ratios(engine: dict, peers: dict) -> dict:
    """nanopaged's output tokens/s over each measured peer's (published figures never enter)."""
    return {f"engine_vs_{name}": engine["output_tokens_per_s"] / p["output_tokens_per_s"]
            for name, p in peers.items() if "output_tokens_per_s" in p}


def target_figures(result: dict) -> dict:
    got = {"speedup_vs_hf": result["ratios"].get("engine_vs_hf"),
           "roofline_fraction": result["roofline"]["fraction"],
           "kv_utilization_paged": result["kv_utilization"]["paged"],
           "schedule_share": result["overhead"]["schedule_share"]}
    out = {}
    for name, goal in TARGETS.items():
        value = got[name]
        lower_is_better = name == "schedule_share"
        met = None if value is None else (value <= goal if lower_is_better else value >= goal)
        out[name] = {"value": value, "target": goal, "met": met,
                     "lower_is_better": lower_is_better}
    return out


def machine_info(device: str) -> dict:
    cpu = platform.processor() or "?"
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    info = {"cpu": cpu, "cpu_cores": os.cpu_count(), "torch_threads": torch.get_num_threads(),
            "platform": platform.platform(), "device": device}
    if device.startswith("cuda"):
        info["gpu"] = torch.cuda.get_device_name()
    return info


def versions() -> dict:
    import transformers
    import nanopaged
    out = {"python": platform.python_version(), "torch": torch.__version__,
           "transformers": transformers.__version__, "nanopaged": nanopaged.__version__}
    try:
        import vllm
        out["vllm"] = vllm.__version__
    except ImportError:
        pass
    return out


# ==== table and plot =====================================================================

def print_table(r: dict) -> None:
    s, e = r["settings"], r["engine"]
    print(f"\n{s['num_requests']} requests, input {s['input_len'][0]}-{s['input_len'][1]}, "
          f"output {s['output_len'][0]}-{s['output_len'][1]} tokens, seed {s['seed']}, "
          f"model {Path(s['model']).name}, {r['machine']['cpu']} ({r['machine']['cpu_cores']} cores, "
          f"{s['threads']} torch threads)")
    print(f"\n{'engine (measured, this run)':30} {'out tok/s':>10} {'total tok/s':>12} {'req/s':>7} "
          f"{'wall s':>8} {'vs nanopaged':>13}")
    rows = {"nanopaged": e, **r["peers"]}
    for name, f in rows.items():
        if "skipped" in f:
            print(f"{name:30} not run: {f['skipped']}")
            continue
        rel = e["output_tokens_per_s"] / f["output_tokens_per_s"]
        print(f"{name:30} {f['output_tokens_per_s']:10.1f} {f['total_tokens_per_s']:12.1f} "
              f"{f['requests_per_s']:7.2f} {f['wall_s']:8.2f} {rel:12.2f}x")
    if "hf" in r["peers"] and "padding_waste" in r["peers"]["hf"]:
        print(f"  hf static batches of {r['peers']['hf']['batch_size']}: "
              f"{r['peers']['hf']['padding_waste']:.1%} of the token slots computed were padding")
    pub = r["published"]
    print(f"\npublished, NOT measured here ({pub['setup']}):")
    for name, v in pub["output_tokens_per_s"].items():
        print(f"  {name:28} {v:10.2f} out tok/s")

    k, m = r["kv_utilization"], r["memory"]
    print(f"\nKV utilization (tokens stored / slots held, every step):")
    print(f"  paged (nanopaged)             {k['paged']:7.1%}")
    print(f"  reserve prompt + max_tokens   {k['reserve_prompt_plus_max_tokens']:7.1%}")
    print(f"  reserve max_model_len         {k['reserve_max_model_len']:7.1%}   "
          f"(max_model_len {s['max_model_len']})")
    if "hf" in r["peers"] and "kv_utilization" in r["peers"]["hf"]:
        print(f"  hf static padded cache        {r['peers']['hf']['kv_utilization']:7.1%}")
    mr = m["max_num_running"]
    print(f"  most requests at once, {m['kv_budget_tokens']} KV slots: paged {mr['paged']} "
          f"(bound by {mr['paged_bound_by']}), reserve prompt+max {mr['reserve_prompt_plus_max_tokens']}, "
          f"reserve max_model_len {mr['reserve_max_model_len']}")
    hit = m["prefix_cache_hit_rate"]
    print(f"  preemptions {m['num_preemptions']}, KV usage peak {m['peak_kv_usage']:.1%} "
          f"mean {m['mean_kv_usage']:.1%}, prefix hit rate "
          f"{'n/a (no lookups)' if hit is None else f'{hit:.1%}'}")

    o, rf = r["overhead"], r["roofline"]
    print(f"\nengine step: {o['step_ms']:.1f} ms = scheduler+block pool {o['schedule_ms_per_step']:.2f} ms "
          f"({o['schedule_share']:.1%}) + model {o['model_ms_per_step']:.1f} ms; "
          f"outside step(): {o['other_share_of_wall']:.1%} of wall")
    print(f"roofline: matmul {rf['matmul_flops_per_s'] / 1e9:.1f} GFLOP/s, {rf['flops_per_token'] / 1e6:.0f} "
          f"MFLOP/token -> {rf['roofline_tokens_per_s']:.0f} tok/s; nanopaged reaches {rf['fraction']:.1%}")

    print("\ntargets:")
    for name, t in r["targets"].items():
        if t["value"] is None:
            print(f"  {name:22} n/a")
            continue
        sign = "<=" if t["lower_is_better"] else ">="
        print(f"  {name:22} {t['value']:8.3f}  target {sign} {t['target']}  "
              f"{'met' if t['met'] else 'MISSED'}")


def plot(r: dict, samples: list, path: str) -> None:
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print(f"--plot {path}: matplotlib is not installed (pip install matplotlib); no plot drawn",
              file=sys.stderr)
        return
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(13, 4.5))
    t = [s.t for s in samples]
    for field, label in (("reserve_max_len", "reserve max_model_len"),
                         ("reserve_needed", "reserve prompt + max_tokens"),
                         ("paged", "paged: slots in blocks held"), ("stored", "tokens stored")):
        ax1.plot(t, [getattr(s, field) for s in samples], label=label)
    ax1.set_yscale("log")
    ax1.set(xlabel="seconds into the timed run", ylabel="KV slots (tokens)",
            title="KV memory held for the same running requests")
    ax1.legend(fontsize=8)
    measured = {"nanopaged": r["engine"], **{k: v for k, v in r["peers"].items() if "skipped" not in v}}
    ax2.bar(list(measured), [v["output_tokens_per_s"] for v in measured.values()])
    ax2.set(ylabel="output tokens/s", title="throughput, measured in this run")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    print(f"plot written to {path}")


# ==== other workloads: prefix caching, and sharing inside a request ======================

def run_shared_prefix(args, model_dir: str, settings: dict) -> dict:
    """The same shared-prefix trace with prefix caching on and off, in one process.

    Every request is one system prompt of --prefix-len tokens plus its own question. The
    'shared fraction' is the share of all prompt tokens that repeat an earlier request's
    system prompt, (n - 1) x prefix / total: what a perfect cache never computes again.
    """
    vocab = vocab_limit(model_dir)
    rng = random.Random(args.seed)
    system = [rng.randrange(3, vocab) for _ in range(args.prefix_len)]
    prompts = [system + [rng.randrange(3, vocab) for _ in range(rng.randint(*args.input_len))]
               for _ in range(args.num_requests)]
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
        llm.generate(WARMUP_PROMPT, SamplingParams(max_tokens=4), use_tqdm=False)
        before = llm.get_stats()
        start = time.perf_counter()
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
        wall = time.perf_counter() - start
        after = llm.get_stats()
        queries = after["prefix_cache_queries"] - before["prefix_cache_queries"]
        result["on" if caching else "off"] = {
            "wall_s": wall,
            "prefill_tokens_computed": after["num_prompt_tokens_computed"] - before["num_prompt_tokens_computed"],
            "hit_rate": (after["prefix_cache_hits"] - before["prefix_cache_hits"]) / queries if queries else 0.0,
            "num_cached_tokens": sum(o.num_cached_tokens for o in outs),
            "output_tokens_per_s": sum(len(o.outputs[0].token_ids) for o in outs) / wall,
        }
        result["outputs_" + ("on" if caching else "off")] = [o.outputs[0].token_ids for o in outs]
    on, off = result["on"], result["off"]
    result["prefill_reduction"] = 1 - on["prefill_tokens_computed"] / off["prefill_tokens_computed"]
    result["speedup"] = off["wall_s"] / on["wall_s"]
    result["identical_outputs"] = result.pop("outputs_on") == result.pop("outputs_off")
    return result


def print_shared_prefix(r: dict) -> None:
    s = r["settings"]
    print(f"\nshared prefix: {s['num_requests']} requests = {s['prefix_len']}-token system prompt + "
          f"{s['question_len'][0]}-{s['question_len'][1]}-token question, output {s['output_len'][0]}-"
          f"{s['output_len'][1]} tokens; {r['prompt_tokens']} prompt tokens, shared fraction "
          f"{r['shared_fraction']:.1%}")
    print(f"{'prefix caching':<16}{'wall s':>9}{'prefill tokens':>16}{'hit rate':>10}{'out tok/s':>11}")
    for key in ("on", "off"):
        x = r[key]
        print(f"{key:<16}{x['wall_s']:>9.2f}{x['prefill_tokens_computed']:>16}{x['hit_rate']:>10.1%}"
              f"{x['output_tokens_per_s']:>11.1f}")
    print(f"prefill tokens computed fall by {r['prefill_reduction']:.1%} (shared fraction "
          f"{r['shared_fraction']:.1%}); speedup {r['speedup']:.2f}x (target 2x); "
          f"outputs identical: {r['identical_outputs']}")


# Parallel sampling and beam search traces, shaped like the paper's (section 6.3): Alpaca has
# short prompts and outputs (means 19 / 58 tokens), ShareGPT long ones (161 / 338). Scaled
# down so a CPU run takes minutes; the saving depends on the lengths, not on the model.
SHARING_TRACES = {"alpaca-like": ((8, 32), (32, 96)), "sharegpt-like": ((96, 256), (96, 256))}
PAPER_SAVINGS = {("parallel", "alpaca-like"): "6.1-9.8%", ("parallel", "sharegpt-like"): "16.2-30.5%",
                 ("beam", "alpaca-like"): "37.6-55.2%", ("beam", "sharegpt-like"): "44.3-66.3%"}


def run_sharing(args, model_dir: str, settings: dict) -> dict:
    """KV blocks saved by sharing: n samples forked from one prompt, and beams that fork.

    Saving = 1 - blocks in use / blocks the same block tables would hold unshared, averaged
    over the run's steps (get_stats()["kv_sharing_saving"]); prefix caching is off so only
    sharing inside a request counts (the paper's Fig. 15 measure).
    """
    from nanopaged import BeamSearchParams
    vocab = vocab_limit(model_dir)
    result = {"settings": {"model": model_dir, "num_prompts": args.num_requests, "seed": args.seed,
                           "traces": {k: {"input_len": list(i), "output_len": list(o)}
                                      for k, (i, o) in SHARING_TRACES.items()}},
              "rows": []}
    for trace_name, (in_len, out_len) in SHARING_TRACES.items():
        trace = make_trace(args.num_requests, in_len, out_len, args.seed, vocab)
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
                                   "paper": PAPER_SAVINGS[(kind, trace_name)]})
    return result


def print_sharing(r: dict) -> None:
    print(f"\nKV memory saved by sharing ({r['settings']['num_prompts']} prompts per trace, "
          "prefix caching off; paper: vLLM, section 6.3, over widths 2-6)")
    print(f"{'trace':<15}{'kind':<10}{'width':>6}{'saving':>9}{'mean blocks':>13}{'paper':>13}")
    for row in r["rows"]:
        print(f"{row['trace']:<15}{row['kind']:<10}{row['width']:>6}{row['saving']:>9.1%}"
              f"{row['mean_blocks_used']:>13.1f}{row['paper']:>13}")


# ==== main ===============================================================================

def main(argv: list[str] | None = None) -> dict:
    args = parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    settings = engine_settings(args)
    model_dir = resolve_model(args)
    if args.workload != "throughput":
        run, show = {"shared-prefix": (run_shared_prefix, print_shared_prefix),
                     "sharing": (run_sharing, print_sharing)}[args.workload]
        result = {"workload": args.workload, **run(args, model_dir, settings),
                  "machine": machine_info(hf_device_dtype(settings)[0]), "versions": versions()}
        show(result)
        if args.json:
            Path(args.json).write_text(json.dumps(result, indent=2) + "\n")
            print(f"\nJSON written to {args.json}")
        return result
    trace = make_trace(args.num_requests, args.input_len, args.output_len, args.seed,
                       vocab_limit(model_dir))

    run, stats, samples, resolved = run_nanopaged(model_dir, trace, settings)
    peers = {name: run_peer(name, model_dir, trace, args, settings, resolved) for name in args.peers}

    device, dtype = hf_device_dtype(settings)
    engine = run.figures()
    result = {
        "engine": engine,
        "peers": peers,
        "ratios": ratios(engine, peers),
        "published": PUBLISHED,
        "overhead": overhead_figures(stats, run),
        "roofline": roofline_figures(ModelConfig.from_folder(model_dir), trace, run, device, dtype),
        "machine": machine_info(device),
        "versions": versions(),
        "settings": {"model": model_dir, "num_requests": args.num_requests,
                     "input_len": list(args.input_len), "output_len": list(args.output_len),
                     "seed": args.seed, "peers": args.peers, "hf_batch_size": args.hf_batch_size,
                     "threads": torch.get_num_threads(),
                     "random_weights": args.random_weights, "dtype": str(dtype).removeprefix("torch."),
                     "sampling": "greedy, ignore_eos", **resolved},
    }
    result["kv_utilization"], result["memory"] = memory_figures(
        stats, samples, trace, resolved["max_model_len"], resolved["max_num_seqs"])
    result["targets"] = target_figures(result)
    print_table(result)
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=2) + "\n")
        print(f"\nJSON written to {args.json}")
    if args.plot:
        plot(result, samples, args.plot)
    return result


if __name__ == "__main__":
    main()
