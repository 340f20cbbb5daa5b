"""bench.py: nanopaged's throughput and KV-memory efficiency, side by side with its peers.

    python bench.py                              # CPU-sized default, peers hf and hf-paged
    python bench.py --preset nano-vllm --random-weights qwen3-0.6b --device cuda
    python bench.py --json out.json --plot out.png
    python bench.py --workload spec --peers vllm # speculative decoding: repeating, agent, JSON (benchmarks/spec.py)
    python bench.py --workload lora --peers vllm # many LoRA adapters in one batch (benchmarks/lora.py)
    python bench.py --random-weights olmoe-1b-7b --peers vllm   # a mixture of experts (benchmarks/moe.py)
    python bench.py --workload overlap           # async scheduling on vs off: each step's phases (benchmarks/overlap.py)
    python bench.py --workload ray               # a dataset through Ray Data replicas (benchmarks/ray_data.py)
    python bench.py --workload multimodal        # chat requests with shared images, vs vLLM (benchmarks/multimodal.py)
    python bench.py --workload disk-prefix       # the disk tier: TTFT after a restart (benchmarks/disk_prefix.py)

Throughput follows nano-vllm's bench.py: seeded random token-id prompts, input and output
lengths uniform in a range, `ignore_eos=True`, one warm-up, then output tokens / wall time
of the timed generation. Every peer runs on the same prompts and lengths: the Hugging Face
peers in this process, vLLM, llama.cpp and CTranslate2 each in its own environment. Memory efficiency follows the paper (Fig. 2, section 6): the share of the KV slots
held that store a real token, for PagedAttention and for the reservation allocators it
replaced, on the same running set. docs/07_benchmarks.md explains every number.

The file reads top-down: settings and arguments, the trace, the timed run of each engine,
the table and JSON. The pieces live in benchmarks/ (its __init__ lists them): the model,
the peers, the memory models, the roofline, the other workloads, the report.
"""
from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch

from benchmarks.disk_prefix import print_disk_prefix, run_disk_prefix
from benchmarks.figures import PUBLISHED, overhead_figures, ratios, target_figures
from benchmarks.machine import machine_info, versions
from benchmarks.memory import memory_figures
from benchmarks.models import MOE_CONFIGS, RANDOM_CONFIGS, VLM_CONFIGS, resolve_model, vocab_limit
from benchmarks.multimodal import run_multimodal
from benchmarks.nanopaged_run import batch_invariance_cost, quantized_vs_dense, resolved_settings, run_nanopaged
from benchmarks.noise import noise_figures
from benchmarks.overlap import run_overlap
from benchmarks.hybrid import run_hybrid
from benchmarks.peers import PEERS, hf_device_dtype, run_peer
from benchmarks.lora import run_lora
from benchmarks.moe import run_moe
from benchmarks.report import (plot, print_cascade, print_hybrid, print_lora, print_moe, print_multimodal,
                               print_overlap, print_shared_prefix, print_sharing, print_spec, print_structured,
                               print_table)
from benchmarks.quality import quality_figures, text_ids
from benchmarks.roofline import kernel_peak_flops, roofline_figures
from benchmarks.single_stream import single_stream_figures, single_stream_length
from benchmarks.spec import WORKLOADS as SPEC_WORKLOADS, run_spec
from benchmarks.structured import run_structured
from benchmarks.trace import make_trace, trace_settings
from benchmarks.workloads import run_cascade, run_shared_prefix, run_sharing
from nanopaged import EngineConfig
from nanopaged.config import CPU_LINEARS, QUANTIZATIONS
from nanopaged.engine.input_processor import load_tokenizer

# ==== settings ===========================================================================

# Sized so the whole default run (nanopaged + hf + hf-paged, loading and warm-ups included)
# takes about 1.5 minutes with the demo model on a quiet 2-core CPU (measured 2026-12-01: 80 s).
DEFAULTS = dict(num_requests=32, input_len=(32, 128), output_len=(16, 64))
# nano-vllm's bench.py: 256 requests, lengths uniform in 100..1024 (a GPU-sized run).
PRESETS = {"nano-vllm": dict(num_requests=256, input_len=(100, 1024), output_len=(100, 1024))}
WORKLOADS = ("throughput", "shared-prefix", "cascade", "sharing", "structured", "spec", "lora", "moe", "overlap",
             "hybrid", "multimodal", "disk-prefix",
             "serve", "ray")      # serve: benchmarks/serve.py, ray: benchmarks/ray_data.py, each its own flags
# shared-prefix: each request = one system prompt (--prefix-len) + its own question.
SHARED_PREFIX_DEFAULTS = dict(num_requests=64, input_len=(16, 48), output_len=(8, 16), prefix_len=256)
# cascade: decode steps of 32 rows on one 1,024-token prefix, shared blocks read once or not.
CASCADE_DEFAULTS = dict(num_requests=32, input_len=(16, 48), output_len=(64, 64), prefix_len=1024)
# multimodal: 16 chat requests sharing 4 images, each answered with exactly --output-len's MAX tokens.
MULTIMODAL_DEFAULTS = {**DEFAULTS, "num_requests": 16, "output_len": (32, 32)}
# disk-prefix: 20 chat turns behind five system prompts of 2,048 tokens (benchmarks/disk_prefix.py).
DISK_PREFIX_DEFAULTS = dict(num_requests=20, input_len=(16, 48), output_len=(1, 1), prefix_len=2048)
# The other workloads: how each runs and how it prints.
OTHER_WORKLOADS = {"shared-prefix": (run_shared_prefix, print_shared_prefix),
                   "cascade": (run_cascade, print_cascade),
                   "sharing": (run_sharing, print_sharing),
                   "structured": (run_structured, print_structured),
                   "spec": (run_spec, print_spec),
                   "lora": (run_lora, print_lora),
                   "moe": (run_moe, print_moe),
                   "overlap": (run_overlap, print_overlap),
                   "hybrid": (run_hybrid, print_hybrid),
                   "multimodal": (run_multimodal, print_multimodal),
                   "disk-prefix": (run_disk_prefix, print_disk_prefix)}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--workload", choices=WORKLOADS, default="throughput",
                   help="throughput (vs peers, default); shared-prefix (prefix caching on vs off); "
                        "cascade (decode steps with shared prefixes read once vs not); "
                        "sharing (KV saved by n > 1 and beam search); spec (speculative decoding: "
                        "benchmarks/spec.py); lora (1, 4, 16 adapters mixed vs the base model: benchmarks/lora.py); "
                        "moe (a mixture of experts against its active-weight floor: benchmarks/moe.py, the workload "
                        "of --random-weights olmoe-1b-7b and qwen3-30b-a3b-12l); overlap (async scheduling on vs "
                        "off: benchmarks/overlap.py); hybrid (a hybrid's K/V and state per request, and a prefix "
                        "hit's time to first token: benchmarks/hybrid.py); multimodal (chat requests sharing "
                        "images, vs vLLM: benchmarks/multimodal.py, the workload of --random-weights smolvlm-256m); "
                        "disk-prefix (the prefix cache's disk tier: TTFT after a restart, pool vs disk vs miss, "
                        "the write cost: benchmarks/disk_prefix.py)")
    p.add_argument("--disk-lengths", default="256,1024,2048",
                   help="disk-prefix: prompt lengths of its miss / pool hit / disk hit rows (default %(default)s)")
    p.add_argument("--num-images", type=int, default=4,
                   help="multimodal: the images the requests draw from, each used at least once (default 4)")
    p.add_argument("--overlap-requests", type=int, default=256,
                   help="overlap: requests of 16 output tokens in its third workload (default 256)")
    p.add_argument("--prefix-len", type=int,
                   help="shared-prefix, cascade, hybrid: tokens of the system prompt every request starts with "
                        "(default 256, cascade 1024, hybrid and disk-prefix 2048)")
    # spec (benchmarks/spec.py): its workloads, prompts and configurations; its trace takes the trace flags below
    p.add_argument("--spec-workloads", default="repeating,agent,json,trace",
                   help="spec: which of repeating, agent, json, trace to run, comma-separated (default all)")
    p.add_argument("--num-prompts", type=int, default=32, help="spec: repeating chat prompts (default 32, at most 54)")
    p.add_argument("--concurrency", default="1,4,16,32",
                   help="spec: the repeating prompts at once, comma-separated; 1 (one at a time) always runs "
                        "(default 1,4,16,32)")
    p.add_argument("--spec-max-tokens", type=int,
                   help="spec: max_tokens of every prompt (default: its passage's tokens + 16)")
    p.add_argument("--ngram-k", default="3,5",
                   help="spec: n-gram num_speculative_tokens, comma-separated (default 3,5)")
    p.add_argument("--suffix-k", default="16",
                   help="spec: suffix decoding's num_speculative_tokens, comma-separated (default 16; vLLM's "
                        "defaults otherwise)")
    p.add_argument("--agent-prompts", type=int, default=32,
                   help="spec: agent-like requests, run one at a time in order (default 32, at most 32)")
    p.add_argument("--json-prompts", type=int, default=16,
                   help="spec: JSON-schema requests (the agent's tool call under its schema; default 16)")
    p.add_argument("--prompt-lookup-max", type=int, default=4, help="spec: n-gram prompt_lookup_max (default 4)")
    p.add_argument("--prompt-lookup-min", type=int, default=2, help="spec: n-gram prompt_lookup_min (default 2)")
    p.add_argument("--draft-layers", type=int, default=6,
                   help="spec: decoder layers the layer-truncated self-draft keeps (default 6)")
    p.add_argument("--draft-k", type=int, default=3, help="spec: the draft model's num_speculative_tokens (default 3)")
    p.add_argument("--preset", choices=sorted(PRESETS), help="a named trace size (default: CPU-sized)")
    p.add_argument("--num-requests", type=int, help=f"default {DEFAULTS['num_requests']}")
    p.add_argument("--input-len", type=int, nargs=2, metavar=("MIN", "MAX"),
                   help=f"prompt tokens, uniform; default {DEFAULTS['input_len']}")
    p.add_argument("--output-len", type=int, nargs=2, metavar=("MIN", "MAX"),
                   help=f"output tokens, uniform; default {DEFAULTS['output_len']}")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--model", help="a local Hugging Face folder (default: the demo model)")
    p.add_argument("--random-weights", choices=sorted({*RANDOM_CONFIGS, *MOE_CONFIGS, *VLM_CONFIGS}),
                   metavar="CONFIG", help="build a model with random weights: "
                                          f"{', '.join([*RANDOM_CONFIGS, *MOE_CONFIGS, *VLM_CONFIGS])}")
    p.add_argument("--peers", "--peer",
                   help=f"comma-separated, from {', '.join(PEERS)}; 'none' for none (default hf,hf-paged; "
                        "spec: none, vllm the one it takes)")
    p.add_argument("--hf-batch-sizes", "--hf-batch-size", default="8,16,32",
                   help="static batch sizes the hf peer is timed at, comma-separated; it is "
                        "reported at its fastest (default 8,16,32)")
    p.add_argument("--noise", action="store_true",
                   help="time nanopaged and the hf peer again beside a busy process on one core, "
                        "and report the share of their quiet output tokens/s each keeps")
    p.add_argument("--threads", type=int,
                   help="torch CPU threads for every engine (default: torch's, one per core); "
                        "1 on a shared machine, where threads waiting for a busy core stall every op")
    # engine settings, passed through to nanopaged (and mirrored in the peers where they exist)
    for name in ("--max-num-seqs", "--max-num-batched-tokens", "--num-kv-blocks", "--block-size",
                 "--max-model-len", "--tensor-parallel-size"):
        p.add_argument(name, type=int, help="nanopaged engine setting (docs/settings.md); default: the engine's")
    p.add_argument("--cpu-linear", choices=CPU_LINEARS,
                   help="nanopaged's CPU linear kernel: packed (oneDNN bfloat16 on packed weights), dpbf16 "
                        "(nanopaged's, on AVX512-BF16), amx (nanopaged's, on AMX's tiles), reference (F.linear); "
                        "auto (the engine's default): by the CPU's flags")
    p.add_argument("--cpu-kernels", choices=["auto", "fused", "reference"],
                   help="nanopaged's CPU layer kernels: fused (C++ norms, rotary + K/V store, SiLU, decode "
                        "attention), reference (torch ops); auto (the engine's default): fused with packed linears")
    p.add_argument("--batch-invariant", action=argparse.BooleanOptionalAction, default=None,
                   help="nanopaged's batch_invariant (default: the engine's, on where its kernels hold it); the "
                        "run times the trace without it too where that changes the kernels")
    p.add_argument("--disable-cascade-attn", action="store_true", default=None,
                   help="nanopaged: rows that share their first blocks read them row by row (default: once)")
    p.add_argument("--kv-cache-dtype", choices=["auto", "fp8", "fp8_e4m3", "fp8_e5m2", "int8"],
                   help="nanopaged's kv_cache_dtype: auto (the model's dtype, the engine's default) or a byte per value")
    p.add_argument("--quantization", choices=[q for q in QUANTIZATIONS if q],
                   help="nanopaged's quantization of the decoder layers (default: none); gguf runs the GGUF file's "
                        "own 4-bit blocks (the demo model's Q4_1); w8a8 quantizes each row too, per token")
    p.add_argument("--llamacpp-python", metavar="PATH",
                   help="the python of llama.cpp's side environment (default: $NANOPAGED_LLAMACPP_PYTHON, else "
                        "the one scripts/setup_llamacpp_peer.sh builds)")
    p.add_argument("--vllm-python", metavar="PATH",
                   help="the python of vLLM's side environment (default: $NANOPAGED_VLLM_PYTHON, else the one "
                        "scripts/setup_vllm_peer.sh builds)")
    p.add_argument("--ctranslate2-python", metavar="PATH",
                   help="the python of CTranslate2's side environment (default: $NANOPAGED_CTRANSLATE2_PYTHON, else "
                        "the one scripts/setup_ctranslate2_peer.sh builds)")
    p.add_argument("--ctranslate2-compute-type", default="auto",
                   help="the ctranslate2 peer's compute types, comma-separated, e.g. auto,float32; it is reported at "
                        "its fastest (default auto: the best the CPU supports, int8 weights first)")
    p.add_argument("--cpu-threads", choices=["auto", "none"],
                   help="nanopaged's CPU threads: auto (the engine's default) follows the free cores; "
                        "none keeps torch's count fixed")
    p.add_argument("--dtype", help="auto, float32, bfloat16, float16 (all engines)")
    p.add_argument("--device", help="auto, cpu, cuda (all engines)")
    p.add_argument("--json", metavar="PATH", help="write every figure as JSON")
    p.add_argument("--plot", metavar="PATH", help="draw KV slots over time and throughput (matplotlib)")
    args = p.parse_args(argv)

    # A trace flag given on the command line wins over the preset, the preset over DEFAULTS.
    if args.random_weights in VLM_CONFIGS:
        args.workload = "multimodal"
    if args.workload == "multimodal" and not (args.model or args.random_weights):
        args.random_weights = "smolvlm-256m"
    defaults = {"shared-prefix": SHARED_PREFIX_DEFAULTS, "cascade": CASCADE_DEFAULTS,
                "multimodal": MULTIMODAL_DEFAULTS, "disk-prefix": DISK_PREFIX_DEFAULTS}.get(args.workload, DEFAULTS)
    for name, value in {**defaults, **PRESETS.get(args.preset, {})}.items():
        if getattr(args, name) is None:
            setattr(args, name, value)
    if args.random_weights in MOE_CONFIGS:
        args.workload = "moe"           # too large for the throughput workload's many engines and the hf peers
    if args.workload == "moe" and args.random_weights not in MOE_CONFIGS:
        p.error(f"--workload moe takes --random-weights {' or '.join(MOE_CONFIGS)}")
    if args.peers is None:
        args.peers = {"spec": "none", "lora": "none", "moe": "none", "multimodal": "vllm"}.get(args.workload,
                                                                                              "hf,hf-paged")
    args.peers = [] if args.peers == "none" else [x.strip() for x in args.peers.split(",") if x.strip()]
    for peer in args.peers:
        if peer not in PEERS:
            p.error(f"unknown peer {peer!r}; choose from {', '.join(PEERS)}")
    if args.workload in ("spec", "lora", "moe", "multimodal") and set(args.peers) - {"vllm"}:
        p.error(f"--workload {args.workload} takes --peers vllm or none, got {','.join(args.peers)}")
    for name in ("ngram_k", "suffix_k", "concurrency", "disk_lengths"):
        try:
            setattr(args, name, [int(x) for x in getattr(args, name).split(",")])
        except ValueError:
            p.error(f"--{name.replace('_', '-')} takes integers separated by commas, got {getattr(args, name)!r}")
        if min(getattr(args, name)) < 1:
            p.error(f"--{name.replace('_', '-')} needs values >= 1, got {getattr(args, name)}")
    args.spec_workloads = [x.strip() for x in args.spec_workloads.split(",") if x.strip()]
    if not args.spec_workloads or set(args.spec_workloads) - set(SPEC_WORKLOADS):
        p.error(f"--spec-workloads takes {', '.join(SPEC_WORKLOADS)}, got {','.join(args.spec_workloads)!r}")
    for name in ("num_prompts", "spec_max_tokens", "prompt_lookup_max", "prompt_lookup_min",
                 "draft_layers", "draft_k", "agent_prompts", "json_prompts"):
        if getattr(args, name) is not None and getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")
    if args.prompt_lookup_min > args.prompt_lookup_max:
        p.error("--prompt-lookup-min must be at most --prompt-lookup-max")
    try:
        args.hf_batch_sizes = [int(x) for x in args.hf_batch_sizes.split(",")]
    except ValueError:
        p.error(f"--hf-batch-sizes takes integers separated by commas, got {args.hf_batch_sizes!r}")
    if min(args.hf_batch_sizes) < 1:
        p.error(f"--hf-batch-sizes must all be >= 1, got {args.hf_batch_sizes}")
    for name in ("input_len", "output_len"):
        lo, hi = getattr(args, name)
        if not 1 <= lo <= hi:
            p.error(f"--{name.replace('_', '-')} needs 1 <= MIN <= MAX, got {lo} {hi}")
    if args.num_requests < 1:
        p.error(f"--num-requests must be >= 1, got {args.num_requests}")
    if args.workload == "multimodal" and not 1 <= args.num_images <= args.num_requests:
        p.error(f"--num-images needs 1 <= IMAGES <= --num-requests ({args.num_requests}), got {args.num_images}")
    if args.threads is not None and args.threads < 1:
        p.error(f"--threads must be >= 1, got {args.threads}")
    if args.model and args.random_weights:
        p.error("give --model or --random-weights, not both")
    return args


def engine_settings(args) -> dict:
    """The engine settings given on the command line (the rest keep nanopaged's defaults)."""
    names = ("max_num_seqs", "max_num_batched_tokens", "num_kv_blocks", "block_size",
             "max_model_len", "dtype", "device", "cpu_threads", "cpu_linear", "cpu_kernels", "tensor_parallel_size",
             "quantization", "batch_invariant", "kv_cache_dtype", "disable_cascade_attn")
    settings = {n: getattr(args, n) for n in names if getattr(args, n) is not None}
    if settings.get("cpu_threads") == "none":
        settings["cpu_threads"] = None
    return settings


def size_gpu_kv_cache(args, settings: dict, device: str) -> dict:
    """On a GPU, each engine's KV cache holds the whole trace and no more. The bench builds several
    engines in one process (the timed run, one request at a time, the variants), and an engine sized
    from gpu_memory_utilization takes what the others hold as used: the second would get nothing.
    On CPU the engine's own default already is a fixed budget."""
    if "num_kv_blocks" in settings or device != "cuda":
        return settings
    block = settings.get("block_size", 16)
    longest = (getattr(args, "prefix_len", None) or 0) + args.input_len[1] + args.output_len[1]
    per_request = -(-longest // block)
    return {**settings, "num_kv_blocks": args.num_requests * per_request}


# ==== the trace, the timed runs, the figures =============================================

def throughput(args, model_dir: str, settings: dict) -> tuple[dict, list]:
    """nanopaged and each peer on one trace; every figure, and nanopaged's per-step KV samples."""
    trace = make_trace(args.num_requests, args.input_len, args.output_len, args.seed,
                       vocab_limit(model_dir))

    run, stats, samples, config = run_nanopaged(model_dir, trace, settings)
    dense = quantized_vs_dense(model_dir, trace, settings, run) if settings.get("quantization") else None
    invariance = batch_invariance_cost(model_dir, trace, settings, run)
    device, dtype = hf_device_dtype(config)
    group = config.quantization_group_size
    peak_after_engine = kernel_peak_flops(config.model_config, device, dtype, stats["cpu_linear"], stats["quantization"],
                                          group)[0]   # the roofline's ceiling, timed twice
    resolved = resolved_settings(config, stats)
    one = {"prompt": trace.prompts[0], "output_tokens": single_stream_length(trace)}
    quality_ids = None
    if config.quantization or "llama.cpp" in args.peers:   # as much of the text as the context holds
        quality_ids = text_ids(load_tokenizer(config.tokenizer))[:config.max_model_len - 1]
    peers = {name: run_peer(name, model_dir, trace, args, settings, config, resolved, one, quality_ids)
             for name in args.peers}
    if "token_ids" in peers.get("vllm", {}):      # do the engines agree? (greedy: they should, mostly)
        theirs = peers["vllm"].pop("token_ids")
        peers["vllm"]["identical_outputs"] = sum(a == b for a, b in zip(run.token_ids, theirs))

    engine = run.figures()
    result = {
        "engine": engine,
        "peers": peers,
        "ratios": ratios(engine, peers),
        "published": PUBLISHED,
        "overhead": overhead_figures(stats, run),
        "roofline": roofline_figures(config.model_config, trace, run, device, dtype, (peak_after_engine,),
                                     linear=stats["cpu_linear"], stats=stats, group_size=group),
        "single_stream": single_stream_figures(model_dir, trace, settings, config, peers),
        "machine": machine_info(device),
        "versions": versions(),
        "settings": {"model": model_dir, **trace_settings(args), "peers": args.peers,
                     "hf_batch_sizes": args.hf_batch_sizes,
                     "noise": args.noise,
                     "threads": torch.get_num_threads(),
                     "random_weights": args.random_weights, "dtype": config.dtype,
                     "sampling": "greedy, ignore_eos", **resolved},
    }
    if quality_ids:
        result["quality"] = quality_figures(model_dir, settings, quality_ids, peers.get("llama.cpp"))
    if dense:
        result["dense"] = dense
    result["batch_invariance"] = invariance
    if args.noise:
        result["noise"] = noise_figures(model_dir, trace, settings, config, engine, peers.get("hf"))
    result["kv_utilization"], result["memory"] = memory_figures(
        stats, samples, trace, resolved["max_model_len"], resolved["max_num_seqs"])
    result["targets"] = target_figures(result)
    return result, samples


# ==== table, JSON, main ==================================================================

def write_json(result: dict, path: str | None) -> None:
    if path:
        Path(path).write_text(json.dumps(result, indent=2) + "\n")
        print(f"\nJSON written to {path}")


def main(argv: list[str] | None = None) -> dict:
    pre = argparse.ArgumentParser(add_help=False)
    pre.add_argument("--workload")
    known, rest = pre.parse_known_args(argv)
    if known.workload == "serve":      # a server under streaming clients: its own flags (--help lists them)
        from benchmarks import serve
        return serve.main(rest)
    if known.workload == "ray":        # a dataset through Ray Data replicas: its own flags too
        from benchmarks import ray_data
        return ray_data.main(rest)
    args = parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    settings = engine_settings(args)
    model_dir = resolve_model(args)
    settings = size_gpu_kv_cache(args, settings, EngineConfig(model_dir, **settings).device)
    if args.workload != "throughput":
        run, show = OTHER_WORKLOADS[args.workload]
        result = {"workload": args.workload, **run(args, model_dir, settings),
                  "machine": machine_info(EngineConfig(model_dir, **settings).device),
                  "versions": versions()}
        show(result)
        write_json(result, args.json)
        return result
    result, samples = throughput(args, model_dir, settings)
    print_table(result)
    write_json(result, args.json)
    if args.plot:
        plot(result, samples, args.plot)
    return result


if __name__ == "__main__":
    main()
