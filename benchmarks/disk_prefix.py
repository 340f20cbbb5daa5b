"""The disk tier (docs/03_prefix_caching.md, "The disk tier"): a chat set behind five long system prompts.

- restart: the set sent one request at a time (time to first token, alone) by a fresh process with an empty
  folder (cold), then by a second fresh process after the first filled it (warm);
- within one process, at a few prompt lengths: a miss (computed), a pool hit (the same prompt again) and a disk
  hit (a second engine in the process, its pool empty, the same folder): also what preemption would weigh, a
  prompt's K/V read back against computed again;
- the write cost: the default trace's output tokens/s with the tier on (an empty folder, every full block
  written) and off, the two engines taking turns, each at its fastest of DISK_ROUNDS rounds (and the medians).
"""
from __future__ import annotations

import json
import os
import random
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from benchmarks.models import vocab_limit
from benchmarks.nanopaged_run import greedy, timed_generate, token_prompts, warm_up
from benchmarks.report import host, table, verdict
from benchmarks.trace import make_trace, random_ids
from nanopaged import LLM
from nanopaged.kv_disk.extension import KVDisk

NUM_SYSTEM_PROMPTS = 5
DISK_ROUNDS = 5
TRACE = dict(num_requests=32, input_len=(32, 128), output_len=(16, 64))     # bench.py's default trace (DEFAULTS)
ROOT = Path(__file__).resolve().parents[1]


def chat_set(args, vocab: int) -> list[list[int]]:
    """--num-requests turns over five system prompts of --prefix-len tokens, in turn: the first five requests are
    each prompt's first turn."""
    rng = random.Random(args.seed)
    systems = [random_ids(rng, args.prefix_len, vocab) for _ in range(NUM_SYSTEM_PROMPTS)]
    return [systems[i % NUM_SYSTEM_PROMPTS] + random_ids(rng, rng.randint(*args.input_len), vocab)
            for i in range(args.num_requests)]


def ttfts(llm: LLM, prompts: list[list[int]]) -> list[float]:
    """Each prompt alone, one after another: seconds to its first token."""
    out = []
    for prompt in prompts:
        start = time.perf_counter()
        llm.generate({"prompt_token_ids": prompt}, greedy(1), use_tqdm=False)
        out.append(time.perf_counter() - start)
    return out


def child() -> None:
    """A fresh process: {model, settings, folder, prompts} on stdin, its TTFTs and tier figures on stdout."""
    job = json.loads(sys.stdin.read())
    llm = LLM(job["model"], **job["settings"], kv_cache_disk_dir=job["folder"])
    warm_up(llm)
    llm.reset_stats()
    seconds = ttfts(llm, job["prompts"])
    llm.llm_engine.find(KVDisk).flush(600)
    stats = llm.get_stats()
    print(json.dumps({"ttft_s": seconds, "kv_disk": stats["kv_disk"],
                      "prompt_tokens_computed": stats["num_prompt_tokens_computed"]}))


def in_fresh_process(model_dir: str, settings: dict, folder: str, prompts: list) -> dict:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    job = json.dumps({"model": model_dir, "settings": settings, "folder": folder, "prompts": prompts})
    done = subprocess.run([sys.executable, "-c", "from benchmarks.disk_prefix import child; child()"], input=job,
                          capture_output=True, text=True, env=env, cwd=ROOT, check=False)
    if done.returncode:
        raise RuntimeError(f"the disk-prefix child process failed:\n{done.stderr[-3000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def percentiles(seconds: list[float]) -> dict:
    ordered = sorted(seconds)
    return {"p50_ms": 1e3 * statistics.median(ordered),
            "p99_ms": 1e3 * ordered[min(len(ordered) - 1, round(0.99 * (len(ordered) - 1)))]}


def restart(args, model_dir: str, settings: dict, folder: str, prompts: list) -> dict:
    runs = {name: in_fresh_process(model_dir, settings, folder, prompts) for name in ("cold", "warm")}
    first = slice(0, NUM_SYSTEM_PROMPTS)
    return {name: {"all": percentiles(run["ttft_s"]), "first_turns": percentiles(run["ttft_s"][first]),
                   **{name: run["kv_disk"][name] for name in ("blocks_read", "blocks_written", "blocks_not_written")},
                   "prompt_tokens_computed": run["prompt_tokens_computed"]}
            for name, run in runs.items()}


def tiers(args, model_dir: str, settings: dict, folder: str, vocab: int) -> dict:
    """At each length: a miss, a pool hit and a disk hit, one prompt each; ms to the first token."""
    rng = random.Random(args.seed + 1)
    writer, reader = (LLM(model_dir, **settings, kv_cache_disk_dir=folder) for _ in range(2))
    for llm in (writer, reader):
        warm_up(llm)
    rows = {}
    for length in args.disk_lengths:
        prompt = random_ids(rng, length, vocab)
        miss = ttfts(writer, [prompt])[0]
        pool = ttfts(writer, [prompt])[0]
        writer.llm_engine.find(KVDisk).flush(600)
        disk = ttfts(reader, [prompt])[0]
        rows[length] = {"miss_ms": 1e3 * miss, "pool_hit_ms": 1e3 * pool, "disk_hit_ms": 1e3 * disk}
    for llm in (writer, reader):
        llm.llm_engine.find(KVDisk).flush(600)
    rows_written = writer.get_stats()["kv_disk"]
    return {"lengths": rows, "write_seconds_per_block": rows_written["write_seconds"] /
            max(1, rows_written["blocks_written"])}


def write_cost(args, model_dir: str, settings: dict, folder: str, vocab: int) -> dict:
    trace = make_trace(TRACE["num_requests"], TRACE["input_len"], TRACE["output_len"], args.seed, vocab)
    prompts, params = token_prompts(trace.prompts), list(map(greedy, trace.output_lens))
    runs = {"off": [], "on": []}
    for round_ in range(DISK_ROUNDS):
        for mode in ("off", "on"):
            tier = {"kv_cache_disk_dir": str(Path(folder) / f"round{round_}")} if mode == "on" else {}
            llm = LLM(model_dir, **settings, **tier)       # on: an empty folder, so every full block is written
            warm_up(llm)
            llm.reset_stats()
            run, _ = timed_generate(llm, prompts, params)
            if tier:            # the writer finishes after the clock stops: the folder is removed after this
                llm.llm_engine.find(KVDisk).flush(600)
                figures = llm.get_stats()["kv_disk"]
                run |= {name: figures[name] for name in ("blocks_written", "blocks_not_written")}
            runs[mode].append(run)
            del llm
    best = {mode: max(done, key=lambda run: run["output_tokens_per_s"]) for mode, done in runs.items()}
    median = {mode: statistics.median(run["output_tokens_per_s"] for run in done) for mode, done in runs.items()}
    return {**best, "ratio": best["on"]["output_tokens_per_s"] / best["off"]["output_tokens_per_s"],
            "median_ratio": median["on"] / median["off"]}


def run_disk_prefix(args, model_dir: str, settings: dict) -> dict:
    vocab = vocab_limit(model_dir)
    prompts = chat_set(args, vocab)
    with tempfile.TemporaryDirectory(prefix="nanopaged-disk-prefix-") as folder:
        return {"settings": {"model": model_dir, "num_requests": args.num_requests, "prefix_len": args.prefix_len,
                             "system_prompts": NUM_SYSTEM_PROMPTS, "question_len": list(args.input_len),
                             "disk_lengths": args.disk_lengths, "trace": TRACE, **settings},
                "restart": restart(args, model_dir, settings, str(Path(folder) / "restart"), prompts),
                "tiers": tiers(args, model_dir, settings, str(Path(folder) / "tiers"), vocab),
                "write_cost": write_cost(args, model_dir, settings, str(Path(folder) / "trace"), vocab)}


def print_disk_prefix(r: dict) -> None:
    s = r["settings"]
    print(f"\ndisk tier: {s['num_requests']} chat turns behind {s['system_prompts']} system prompts of "
          f"{s['prefix_len']:,} tokens, one at a time, ms to the first token; {host(r['machine'])}")
    table(("process", 34), [("p50 ms", 10, ".1f"), ("p99 ms", 10, ".1f"), ("read", 7, ",d"), ("written", 9, ",d"),
                            ("not written", 13, ",d")],
          {f"{name}, {which.replace('_', ' ')}": [f[which]["p50_ms"], f[which]["p99_ms"], f["blocks_read"],
                                                  f["blocks_written"], f["blocks_not_written"]]
           for name, f in r["restart"].items() for which in ("first_turns", "all")})
    print("\none process: a miss, a pool hit, a disk hit (a second engine, its pool empty), ms to the first token")
    table(("prompt tokens", 16), [("miss", 10, ".1f"), ("pool hit", 10, ".1f"), ("disk hit", 10, ".1f"),
                                  ("miss/disk", 11, ".1f")],
          {f"{length:,}": [f["miss_ms"], f["pool_hit_ms"], f["disk_hit_ms"], f["miss_ms"] / f["disk_hit_ms"]]
           for length, f in r["tiers"]["lengths"].items()})
    w = r["write_cost"]
    print(f"\nthe trace with the tier on (every full block written, {w['on']['blocks_written']:,} blocks) and off: "
          f"{w['on']['output_tokens_per_s']:.1f} vs {w['off']['output_tokens_per_s']:.1f} out tok/s, "
          f"ratio {w['ratio']:.3f} (of the medians of {DISK_ROUNDS} rounds: {w['median_ratio']:.3f})")
    cold, warm = r["restart"]["cold"]["first_turns"]["p50_ms"], r["restart"]["warm"]["first_turns"]["p50_ms"]
    print(f"targets (issue 60): TTFT after a restart, warm >= 5x lower than cold: {cold / warm:.1f}x "
          f"{verdict(cold >= 5 * warm)}; the trace within 3% with the tier on: {w['ratio']:.3f} "
          f"{verdict(w['ratio'] >= 0.97)}")
