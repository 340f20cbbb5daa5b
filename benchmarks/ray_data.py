"""The ray workload: one dataset through Ray Data replicas, against plain LLM.generate."""
from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from contextlib import contextmanager, nullcontext
from pathlib import Path

import torch

from benchmarks.machine import machine_info, versions
from benchmarks.models import vocab_limit
from benchmarks.nanopaged_run import timed_generate, token_prompts, warm_up
from benchmarks.report import print_ray
from benchmarks.serve import free_port
from benchmarks.trace import make_trace
from nanopaged import LLM, SamplingParams
from nanopaged.llm import model_folder


# ---- a Ray node, as `ray start` makes one (the tests start theirs with it too) --------------------
def ray_start(ip: str, log: Path, num_cpus: int, resources: dict | None = None,
              head_address: str | None = None) -> subprocess.Popen:
    """One node: `ray start --block` (its processes in one process group) on a loopback address of its
    own (Ray turns 127.0.0.1 into the host's network address, and each node needs one)."""
    ray_cli = str(Path(sys.executable).with_name("ray"))
    ports = ["--dashboard-agent-listen-port", "--dashboard-agent-grpc-port", "--metrics-export-port",
             "--runtime-env-agent-port"]       # each node its own: two nodes on one host would share the defaults
    cmd = [ray_cli, "start", "--block", "--node-ip-address", ip, "--num-cpus", str(num_cpus),
           "--resources", json.dumps(resources or {}), "--object-store-memory", str(200 * 2**20),
           "--disable-usage-stats", *[x for p in ports for x in (p, str(free_port()))]]
    cmd += ["--address", head_address] if head_address else ["--head", "--port", str(free_port()),
                                                             "--include-dashboard", "false"]
    return subprocess.Popen(cmd, stdout=log.open("w"), stderr=subprocess.STDOUT, start_new_session=True,
                            env={**os.environ, "RAY_USAGE_STATS_ENABLED": "0"})


def wait_for(condition, timeout_s: float, what: str, logs=()) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if condition():
            return
        time.sleep(0.25)
    raise TimeoutError(f"{what} not within {timeout_s} s:\n" + "\n".join(p.read_text()[-2000:] for p in logs))


@contextmanager
def ray_cluster(log_dir: Path, nodes: list[dict], timeout_s: float = 90):
    """A cluster of `nodes` ({"num_cpus", "resources"}), the first the head, this process the driver;
    yields the head's address and kills every node on the way out."""
    import ray          # the [ray] extra: only this workload needs it
    started = []
    try:
        head_log = log_dir / "node0.log"
        started.append(ray_start("127.0.0.2", head_log, **nodes[0]))
        wait_for(lambda: "ray start --address=" in head_log.read_text() or started[0].poll() is not None,
                 timeout_s, "the head node", [head_log])
        port = head_log.read_text().split("ray start --address='127.0.0.2:", 1)[1].split("'", 1)[0]
        address = f"127.0.0.2:{port}"
        for i, node in enumerate(nodes[1:], start=1):
            started.append(ray_start(f"127.0.0.{2 + i}", log_dir / f"node{i}.log", head_address=address, **node))
        ray.init(address=address, _node_ip_address="127.0.0.2", log_to_driver=False)
        wait_for(lambda: sum(n["Alive"] for n in ray.nodes()) == len(nodes), timeout_s, "every node",
                 [log_dir / f"node{i}.log" for i in range(len(nodes))])
        yield address
    finally:
        ray.shutdown()
        for node in started:
            os.killpg(node.pid, signal.SIGKILL)     # the node's raylet, object store and workers with it
            node.wait(30)


# ---- the runs ------------------------------------------------------------------------------------
def dataset_rows(trace) -> list[dict]:
    return [{"id": i, "prompt_token_ids": p,
             "sampling_params": {"temperature": 0.0, "max_tokens": n, "ignore_eos": True}}
            for i, (p, n) in enumerate(zip(trace.prompts, trace.output_lens))]


def run_generate(model: str, engine_kwargs: dict, rows: list[dict], cores: int) -> dict:
    torch.set_num_threads(cores)
    llm = LLM(model, **engine_kwargs, cpu_threads=None)
    warm_up(llm, SamplingParams(max_tokens=4))
    params = [SamplingParams(**r["sampling_params"]) for r in rows]
    run, outs = timed_generate(llm, token_prompts([r["prompt_token_ids"] for r in rows]), params)
    wall = run["wall_s"]
    return {"run": "generate", "replicas": 1, "threads": cores, "generation_s": wall, "wall_s": wall,
            "rows_per_s": len(rows) / wall, "output_tokens_per_s": run["output_tokens_per_s"],
            "output_tokens": run["output_tokens"],
            "tokens": {r["id"]: list(o.outputs[0].token_ids) for r, o in zip(rows, outs)}}


def run_ray(model: str, engine_kwargs: dict, rows: list[dict], replicas: int, threads: int,
            batch_size: int, max_concurrent_batches: int) -> dict:
    import ray
    from nanopaged.extras.ray_data import EngineProcessorConfig, build_processor
    config = EngineProcessorConfig(model_source=model, engine_kwargs=engine_kwargs, concurrency=replicas,
                                   cpus_per_replica=threads, batch_size=batch_size,
                                   max_concurrent_batches=max_concurrent_batches)
    started = time.time()
    out = list(build_processor(config)(ray.data.from_items(rows)).iter_rows())
    ended = time.time()
    first_row_in = min(r["replica"]["busy_since_unix"] for r in out)
    generation = ended - first_row_in
    tokens = sum(r["num_generated_tokens"] for r in out)
    loads = {(r["replica"]["node_id"], r["replica"]["pid"]): r["replica"]["load_s"] for r in out}
    return {"run": f"ray {replicas} x {threads}", "replicas": replicas, "threads": threads,
            "generation_s": generation, "wall_s": ended - started, "rows_per_s": len(out) / generation,
            "output_tokens_per_s": tokens / generation, "output_tokens": tokens,
            "replica_load_s": sorted(loads.values()), "errors": sum(r["error"] is not None for r in out),
            "tokens": {r["id"]: list(r["generated_tokens"]) for r in out}}


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", help="a model folder or .gguf (default: the demo model)")
    p.add_argument("--num-rows", type=int, default=64)
    p.add_argument("--input-len", type=int, nargs=2, default=(32, 128), metavar=("MIN", "MAX"))
    p.add_argument("--output-len", type=int, nargs=2, default=(32, 64), metavar=("MIN", "MAX"))
    p.add_argument("--dtype", default="auto")
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--max-concurrent-batches", type=int, default=32,
                   help="batches in flight per replica (default 32: 256 rows, as many as generate runs at once)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", metavar="PATH")
    args = p.parse_args(argv)
    if args.num_rows < 1 or not 1 <= args.input_len[0] <= args.input_len[1] or \
            not 1 <= args.output_len[0] <= args.output_len[1]:
        p.error("--num-rows >= 1, and lengths with 1 <= MIN <= MAX")
    model = model_folder(args.model)
    engine_kwargs = {"dtype": args.dtype}
    cores = os.cpu_count() or 1
    trace = make_trace(args.num_rows, args.input_len, args.output_len, args.seed, vocab_limit(model))
    rows = dataset_rows(trace)
    runs = [run_generate(model, engine_kwargs, rows, cores)]
    import ray
    with tempfile.TemporaryDirectory(prefix="nanopaged-ray-") as logs, \
            (nullcontext() if ray.is_initialized() else ray_cluster(Path(logs), [{"num_cpus": cores}])):
        context = ray.data.DataContext.get_current()
        context.enable_progress_bars = False
        context.wait_for_min_actors_s = 600    # rows flow once every replica is up, so each gets its share
        for replicas, threads in ((1, cores), (cores, 1)):
            runs.append(run_ray(model, engine_kwargs, rows, replicas, threads, args.batch_size,
                                args.max_concurrent_batches))
    base, base_tokens = runs[0], runs[0]["tokens"]
    for run in runs:
        run["same_tokens_as_generate"] = run.pop("tokens") == base_tokens      # greedy: batch invariance
        run["overhead_vs_generate"] = run["generation_s"] / base["generation_s"] - 1
    result = {"workload": "ray", "rows": args.num_rows, "input_len": list(args.input_len),
              "output_len": list(args.output_len), "dtype": args.dtype, "batch_size": args.batch_size,
              "max_concurrent_batches": args.max_concurrent_batches, "runs": runs,
              "machine": machine_info("cpu"), "versions": {**versions(), "ray": ray_version()}}
    print_ray(result)
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=2) + "\n")
    return result


def ray_version() -> str:
    import ray
    return ray.__version__


if __name__ == "__main__":
    main()
