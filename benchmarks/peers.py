"""The peers, each on the same trace: Hugging Face static batching and transformers' own
continuous batching over a paged cache in this process; vLLM's CPU engine, llama.cpp and CTranslate2
each in its own environment (scripts/setup_*_peer.sh), in a subprocess (run_side)."""
from __future__ import annotations

import json
import os
import subprocess
import tempfile
import time
from pathlib import Path

import torch

from benchmarks import ctranslate2_peer, llamacpp_peer, vllm_peer
from benchmarks.memory import hf_static_kv_utilization
from benchmarks.trace import WARMUP_PROMPT, Run, Trace
from nanopaged import EngineConfig
from nanopaged.models.config import ModelConfig
from nanopaged.models.demo_model import cache_dir

PEERS = ("hf", "hf-paged", "vllm", "llama.cpp", "ctranslate2")
ROOT = Path(__file__).resolve().parent.parent
SIDE_TIMEOUT_S = 1800     # vLLM compiles for about two minutes before its first step
# The peers that run in an environment of their own, and its name: scripts/setup_{name}_peer.sh builds
# it, --{name}-python names its python.
SIDE = {"vllm": "vllm", "llama.cpp": "llamacpp", "ctranslate2": "ctranslate2"}


def run_peer(name: str, model_dir: str, trace: Trace, args, settings: dict, config: EngineConfig,
             resolved: dict, single_stream: dict | None = None, perplexity_ids: list[int] | None = None) -> dict:
    """One peer's figures, or why it did not run; every peer follows what nanopaged resolved (`config`,
    `resolved`). vLLM and llama.cpp also time `single_stream`, llama.cpp scores `perplexity_ids`."""
    python = side_python(args, name) if name in SIDE else None
    if name in SIDE and python is None:
        return {"skipped": not_set_up(name)}
    try:
        if name == "hf":
            return run_hf_sweep(model_dir, trace, config, args.hf_batch_sizes)
        if name == "hf-paged":
            return run_hf_paged(model_dir, trace, config, resolved).figures()
        if name == "llama.cpp":
            return run_llamacpp(model_dir, trace, config, python, single_stream, perplexity_ids)
        if name == "ctranslate2":
            return run_ctranslate2(model_dir, trace, resolved, python, args.ctranslate2_compute_type.split(","))
        return run_vllm(model_dir, trace, config, resolved, python, single_stream)
    except Exception as e:                   # a peer failing is a result to report, not a crash
        return {"skipped": f"{type(e).__name__}: {e}"}


# ---- Hugging Face transformers ------------------------------------------------------------

def hf_device_dtype(config: EngineConfig) -> tuple[str, torch.dtype]:
    """The device and torch dtype nanopaged resolved ('auto': CUDA + bfloat16, else CPU + float32)."""
    return config.device, getattr(torch, config.dtype)


def load_hf(model_dir: str, config: EngineConfig):
    from transformers import AutoModelForCausalLM
    from transformers.utils import logging as hf_logging
    hf_logging.set_verbosity_error()          # its warnings about unused sampling flags are noise here
    device, dtype = hf_device_dtype(config)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype, attn_implementation="sdpa",
                                                 local_files_only=True)
    return model.to(device).eval()


def run_hf_sweep(model_dir: str, trace: Trace, config: EngineConfig, batch_sizes: list[int]) -> dict:
    """The hf peer at each static batch size; its figures are those of the fastest, so
    nanopaged is compared with Hugging Face at its best on this trace (`sweep` keeps all)."""
    model = load_hf(model_dir, config)
    runs = [run_hf_static(model, trace, b).figures() for b in batch_sizes]
    best = max(runs, key=lambda f: f["output_tokens_per_s"])
    return {**best, "sweep": {str(f["batch_size"]): f["output_tokens_per_s"] for f in runs}}


def run_hf_static(model, trace: Trace, batch_size: int) -> Run:
    """The reservation-style baseline: static batches, left-padded, each decoding until its longest
    request is done; a request counts only the tokens it asked for (the rest is `padding_waste`)."""
    pad = model.generation_config.pad_token_id or 0
    batches = [range(i, min(i + batch_size, len(trace.prompts)))
               for i in range(0, len(trace.prompts), batch_size)]
    hf_generate(model, [WARMUP_PROMPT["prompt_token_ids"]], 4, pad)
    start, produced = time.perf_counter(), 0
    for b in batches:
        longest_output = max(trace.output_lens[i] for i in b)
        generated = hf_generate(model, [trace.prompts[i] for i in b], longest_output, pad)
        produced += sum(min(generated, trace.output_lens[i]) for i in b)   # what each request asked for
    wall = time.perf_counter() - start
    held = sum(len(b) * (max(len(trace.prompts[i]) for i in b) + max(trace.output_lens[i] for i in b))
               for b in batches)
    real = trace.num_prompt_tokens + trace.num_output_tokens
    return Run("hf", wall, produced, trace.num_prompt_tokens, len(trace.prompts),
               {"batch_size": batch_size, "padding_waste": 1 - real / held,
                "kv_utilization": hf_static_kv_utilization(trace, batches)})


@torch.inference_mode()
def hf_generate(model, prompts: list[list[int]], max_new_tokens: int, pad: int) -> int:
    """One static batch, left-padded; the tokens each row generated."""
    longest = max(map(len, prompts))
    ids = torch.tensor([[pad] * (longest - len(p)) + p for p in prompts], device=model.device)
    mask = torch.tensor([[0] * (longest - len(p)) + [1] * len(p) for p in prompts], device=model.device)
    out = model.generate(input_ids=ids, attention_mask=mask, do_sample=False, pad_token_id=pad,
                         max_new_tokens=max_new_tokens, min_new_tokens=max_new_tokens)
    return out.shape[1] - longest


def run_hf_paged(model_dir: str, trace: Trace, config: EngineConfig, engine: dict) -> Run:
    """transformers' own continuous batching over a paged KV cache of nanopaged's blocks; its manager is
    driven directly, since `generate_batch` takes one max_new_tokens for all requests."""
    from transformers import GenerationConfig
    from transformers.generation import ContinuousBatchingConfig
    model = load_hf(model_dir, config)
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


# ---- the side environments (vLLM, llama.cpp, CTranslate2) ----------------------------------------------

def side_python(args, peer: str) -> Path | None:
    """The python of a peer's environment (scripts/setup_{name}_peer.sh): --{name}-python, else
    $NANOPAGED_{NAME}_PYTHON, else the script's default folder; None where there is none."""
    name = SIDE[peer]
    for candidate in (getattr(args, f"{name}_python", None), os.environ.get(f"NANOPAGED_{name.upper()}_PYTHON"),
                      Path.home() / ".cache" / "nanopaged" / f"{name}-peer" / "bin" / "python"):
        if candidate and Path(candidate).is_file():
            return Path(candidate)
    return None


def not_set_up(peer: str) -> str:
    """What a peer's row says when its environment is missing."""
    name = SIDE[peer]
    return f"no {peer} environment: run `bash scripts/setup_{name}_peer.sh` (or give --{name}-python)"


def run_side(python: Path, script, job: dict) -> dict:
    """A peer's script (benchmarks/*_peer.py) run on `job` as a module (`python -m`) in its own
    environment, the repository on its path: its result."""
    with tempfile.TemporaryDirectory() as tmp:
        path_in, path_out = Path(tmp) / "job.json", Path(tmp) / "result.json"
        path_in.write_text(json.dumps(job))
        env = repo_env({"OMP_NUM_THREADS": str(torch.get_num_threads())})
        done = subprocess.run([str(python), "-m", script.__name__, str(path_in), str(path_out)], env=env,
                              capture_output=True, text=True, timeout=SIDE_TIMEOUT_S)
        if done.returncode != 0 or not path_out.exists():
            tail = (done.stderr or done.stdout).strip().splitlines()[-3:]
            raise RuntimeError(f"exited with {done.returncode}: {' | '.join(tail)}")
        return json.loads(path_out.read_text())


def repo_env(extra: dict) -> dict:
    """This process's environment with `extra`, and the repository first on PYTHONPATH."""
    return {**os.environ, **extra,
            "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}


# ---- vLLM ---------------------------------------------------------------------------------

def run_vllm_side(args, job: dict) -> dict:
    """benchmarks/vllm_peer.py on `job` in vLLM's environment: its result, or {"error": why not}."""
    python = side_python(args, "vllm")
    if python is None:
        return {"error": not_set_up("vllm")}
    try:
        return run_side(python, vllm_peer, job)
    except RuntimeError as e:
        return {"error": str(e)}


def vllm_job(model_dir: str, m: ModelConfig, resolved: dict, prompts: list[list[int]], output_lens: list[int]) -> dict:
    """The job benchmarks/vllm_peer.py runs: these prompts with nanopaged's resolved dtype, KV bytes
    and batch limits; vLLM keeps its own block size (its CPU attention takes multiples of 32 only)."""
    slots = resolved["num_kv_blocks"] * resolved["block_size"]
    kv_bytes = slots * m.kv_bytes_per_token(getattr(torch, resolved["dtype"]).itemsize)
    # vLLM refuses a max_model_len whose one request would not fit its KV cache (nanopaged checks each
    # request instead): cap it at what the same bytes hold, in whole 128-token blocks, with 5% to spare.
    return {"model": model_dir, "prompts": prompts, "output_lens": output_lens, "dtype": resolved["dtype"],
            "kv_cache_bytes": kv_bytes, "max_model_len": min(resolved["max_model_len"], int(slots * 0.95) // 128 * 128),
            **{k: resolved[k] for k in ("block_size", "max_num_seqs", "max_num_batched_tokens")}}


def run_vllm(model_dir: str, trace: Trace, config: EngineConfig, resolved: dict, python: Path,
             single_stream: dict | None = None) -> dict:
    """vLLM's CPU engine on the same trace, in its own environment and process (vllm_job's settings)."""
    job = {**vllm_job(model_dir, config.model_config, resolved, trace.prompts, trace.output_lens),
           "single_stream": single_stream}
    out = run_side(python, vllm_peer, job)
    run = Run("vllm", out["wall_s"], out["output_tokens"], trace.num_prompt_tokens, len(trace.prompts),
              {"version": out["vllm"], "load_s": out["load_s"], "kv_cache_bytes": job["kv_cache_bytes"],
               "block_size": out["block_size"], "max_model_len": job["max_model_len"]})
    return {**run.figures(), "token_ids": out["token_ids"],
            **({"decode_tokens_per_s": out["decode_tokens_per_s"]} if "decode_tokens_per_s" in out else {})}


# ---- llama.cpp ----------------------------------------------------------------------------

def run_llamacpp(model_dir: str, trace: Trace, config: EngineConfig, python: Path, single_stream: dict,
                 perplexity_ids: list[int] | None = None) -> dict:
    """llama.cpp on the model's own GGUF file: the trace one request at a time, one request's decode speed,
    and the perplexity of `perplexity_ids` when given."""
    from nanopaged.models.demo_model import find_gguf
    gguf = find_gguf(model_dir)        # a ValueError (the row says it) for a folder with no GGUF
    longest = max(len(p) + n for p, n in [*zip(trace.prompts, trace.output_lens),
                                          (single_stream["prompt"], single_stream["output_tokens"])])
    job = {"gguf": gguf, "threads": torch.get_num_threads(), "eos": config.model_config.eos_token_ids[0],
           "n_ctx": max(longest, len(perplexity_ids or [])) + 8,
           "prompts": trace.prompts, "output_lens": trace.output_lens, "single_stream": single_stream,
           "perplexity_ids": perplexity_ids}
    out = run_side(python, llamacpp_peer, job)
    run = Run("llama.cpp", out["wall_s"], out["output_tokens"], trace.num_prompt_tokens, len(trace.prompts),
              {"version": out["version"], "one_request_at_a_time": True, "gguf": Path(gguf).name})
    return {**run.figures(), "decode_tokens_per_s": out["decode_tokens_per_s"],
            **({"perplexity": out["perplexity"]} if "perplexity" in out else {})}


# ---- CTranslate2 --------------------------------------------------------------------------

def run_ctranslate2(model_dir: str, trace: Trace, resolved: dict, python: Path, compute_types: list[str]) -> dict:
    """CTranslate2 on the trace at each compute type asked, in calls of at most max_num_seqs requests;
    reported at the fastest (`sweep` keeps all)."""
    job = {"model": model_dir, "cache_dir": str(cache_dir() / "bench" / "ctranslate2"),
           "compute_types": [c.strip() for c in compute_types if c.strip()], "threads": torch.get_num_threads(),
           "max_batch_size": resolved["max_num_seqs"], "prompts": trace.prompts, "output_lens": trace.output_lens}
    out = run_side(python, ctranslate2_peer, job)
    runs = [Run("ctranslate2", r["wall_s"], r["output_tokens"], trace.num_prompt_tokens, len(trace.prompts),
                {"version": out["version"], "compute_type": r["compute_type"], "num_calls": r["num_calls"],
                 "max_batch_size": job["max_batch_size"], "load_s": r["load_s"]}).figures() for r in out["runs"]]
    best = max(runs, key=lambda f: f["output_tokens_per_s"])
    return {**best, "supported_compute_types": out["supported"],
            "sweep": {f["compute_type"]: f["output_tokens_per_s"] for f in runs}}
