"""The serve workload: streaming clients against a running OpenAI-compatible server.

    python bench.py --workload serve                         # demo model, nanopaged vs transformers serve
    python -m benchmarks.serve --rate 4 --num-requests 32 --model /path/to/hf/folder

Requests arrive as a Poisson process at `--rate` per second (inf: all at once), each from
its own streaming client (the official `openai` client), with the same seeded prompts and
greedy settings for every server. Per request it records the time to the first text
(TTFT) and the time per output token after it (TPOT = (last - first) / (tokens - 1));
it reports request throughput, output tokens/s, and p50/p90/p99 of both. vLLM's
benchmarks/benchmark_serving.py measures the same figures.

The servers run as processes of their own, started and stopped here: `nanopaged serve`
and Hugging Face's `transformers serve --continuous-batching` (where it starts; if it does
not, the report says why). docs/benchmarks.md, "Server".
"""
from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import random
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
# Sized for about a minute on a 2-core CPU with the demo model, both servers, loading included.
DEFAULTS = dict(rate=4.0, num_requests=24, input_len=(16, 64), output_len=(16, 48))
PEERS = ("transformers",)
START_TIMEOUT_S = 180
# Prompt text: common words, so every tokenizer gives about one token each.
WORDS = ("the of and to in is was for on that with as by at from his her they this which have "
         "one all were when there been more their time would about if out up into some them "
         "could other than then only its over new also after first two most like these people "
         "year made work way may day many even back good well through great where much world").split()


# ==== servers as processes ====================================================================

@dataclass
class ServerProcess:
    """A server we started: its process, its base URL, its log file."""
    name: str
    process: subprocess.Popen
    base_url: str
    log: Path
    model_name: str

    def stop(self) -> None:
        """SIGTERM to its process group (it is our own session), SIGKILL after 15 s."""
        if self.process.poll() is None:
            os.killpg(self.process.pid, signal.SIGTERM)
            try:
                self.process.wait(timeout=15)
            except subprocess.TimeoutExpired:
                os.killpg(self.process.pid, signal.SIGKILL)
                self.process.wait()

    def __enter__(self) -> "ServerProcess":
        return self

    def __exit__(self, *exc) -> None:
        self.stop()


def start_nanopaged(model: str | None, engine_args: list[str] = (), served_model_name: str | None = None,
                    timeout_s: float = START_TIMEOUT_S) -> ServerProcess:
    """`python -m nanopaged.entrypoints.serve MODEL --port 0 ...`; ready when it prints its address."""
    log = Path(tempfile.mkstemp(prefix="nanopaged-serve-", suffix=".log")[1])
    cmd = [sys.executable, "-m", "nanopaged.entrypoints.serve", *([model] if model else []), "--host", "127.0.0.1",
           "--port", "0", *(["--served-model-name", served_model_name] if served_model_name else []),
           *engine_args]
    process = _spawn(cmd, log)
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        for line in log.read_text(errors="replace").splitlines():
            if line.startswith("nanopaged: serving "):
                name = line.split("'")[1]
                url = line.split(" at ", 1)[1].split()[0]           # http://127.0.0.1:PORT/v1
                return ServerProcess("nanopaged", process, url.removesuffix("/v1"), log, name)
        if process.poll() is not None:
            raise RuntimeError(f"nanopaged serve exited with {process.returncode}:\n{_tail(log)}")
        time.sleep(0.1)
    ServerProcess("nanopaged", process, "", log, "").stop()
    raise RuntimeError(f"nanopaged serve was not ready after {timeout_s} s:\n{_tail(log)}")


def start_transformers(model: str, device: str = "cpu", dtype: str = "float32",
                       timeout_s: float = START_TIMEOUT_S) -> ServerProcess:
    """`transformers serve MODEL --continuous-batching` on `device`, offline; ready when
    /health answers. Raises RuntimeError saying why it did not start."""
    exe = shutil.which("transformers")
    if exe is None:
        raise RuntimeError("the `transformers` command is not installed (transformers[serving] >= 5)")
    port = free_port()
    log = Path(tempfile.mkstemp(prefix="transformers-serve-", suffix=".log")[1])
    cmd = [exe, "serve", model, "--continuous-batching", "--device", device, "--dtype", dtype,
           "--host", "127.0.0.1", "--port", str(port), "--log-level", "warning"]
    process = _spawn(cmd, log)
    server = ServerProcess("transformers", process, f"http://127.0.0.1:{port}", log, model)
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise RuntimeError(f"transformers serve exited with {process.returncode}:\n{_tail(log)}")
        try:
            with urllib.request.urlopen(server.base_url + "/health", timeout=2) as r:
                if r.status == 200:
                    return server
        except OSError:
            time.sleep(0.2)
    server.stop()
    raise RuntimeError(f"transformers serve was not ready after {timeout_s} s:\n{_tail(log)}")


def _spawn(cmd: list[str], log: Path) -> subprocess.Popen:
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1",
           "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}
    with open(log, "wb") as out:            # a file, not a pipe: a chatty server can never block
        return subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, env=env, cwd=ROOT,
                                start_new_session=True)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _tail(log: Path, lines: int = 15) -> str:
    return "\n".join(log.read_text(errors="replace").splitlines()[-lines:])


# ==== the load ================================================================================

@dataclass
class RequestResult:
    ok: bool
    text: str = ""
    ttft_s: float | None = None       # arrival -> first text
    latency_s: float = 0.0            # arrival -> last chunk
    output_tokens: int = 0
    error: str | None = None
    chunk_times: list[float] = field(default_factory=list, repr=False)


def make_prompts(num_requests: int, input_len: tuple[int, int], output_len: tuple[int, int],
                 seed: int) -> list[tuple[str, int]]:
    """(prompt text of about input_len words, max_tokens) per request, seeded."""
    rng = random.Random(seed)
    return [(" ".join(rng.choice(WORDS) for _ in range(rng.randint(*input_len))).capitalize(),
             rng.randint(*output_len)) for _ in range(num_requests)]


async def stream_one(client, model: str, prompt: str, max_tokens: int, extra_body: dict) -> RequestResult:
    """One streamed greedy completion: its text, TTFT, latency and output tokens (from the
    usage the stream ends with; the count of text chunks where a server sends none)."""
    start, first, pieces, chunks, usage = time.perf_counter(), None, [], [], None
    try:
        stream = await client.completions.create(model=model, prompt=prompt, max_tokens=max_tokens,
                                                 temperature=0, stream=True, extra_body=extra_body)
        async for chunk in stream:
            now = time.perf_counter()
            if chunk.usage is not None:
                usage = chunk.usage
            text = chunk.choices[0].text if chunk.choices else ""
            if text:
                first = first if first is not None else now
                pieces.append(text)
                chunks.append(now)
    except Exception as e:            # a failed request is counted and reported, not fatal
        return RequestResult(False, error=f"{type(e).__name__}: {e}", latency_s=time.perf_counter() - start)
    end = time.perf_counter()
    tokens = usage.completion_tokens if usage is not None else len(chunks)
    return RequestResult(True, "".join(pieces), None if first is None else first - start, end - start,
                         tokens, chunk_times=chunks)


async def run_load(base_url: str, model: str, prompts: list[tuple[str, int]], rate: float, seed: int,
                   extra_body: dict | None = None) -> tuple[list[RequestResult], float]:
    """Every request on its own streaming client, arriving as a Poisson process at `rate`/s."""
    from openai import AsyncOpenAI
    client = AsyncOpenAI(base_url=base_url + "/v1", api_key="none", max_retries=0, timeout=600)
    rng = random.Random(seed + 1)
    extra_body = extra_body or {}

    async def arrive(delay: float, prompt: str, max_tokens: int) -> RequestResult:
        await asyncio.sleep(delay)
        return await stream_one(client, model, prompt, max_tokens, extra_body)

    delays, t = [], 0.0
    for _ in prompts:
        delays.append(t)
        t += 0.0 if math.isinf(rate) else rng.expovariate(rate)
    start = time.perf_counter()
    results = await asyncio.gather(*(arrive(d, p, m) for d, (p, m) in zip(delays, prompts)))
    duration = time.perf_counter() - start
    await client.close()
    return list(results), duration


def figures(results: list[RequestResult], duration_s: float) -> dict:
    ok = [r for r in results if r.ok]
    ttft = [r.ttft_s for r in ok if r.ttft_s is not None]
    tpot = [(r.latency_s - r.ttft_s) / (r.output_tokens - 1) for r in ok
            if r.ttft_s is not None and r.output_tokens > 1]
    out_tokens = sum(r.output_tokens for r in ok)
    return {"completed": len(ok), "failed": len(results) - len(ok),
            "errors": sorted({r.error for r in results if not r.ok})[:3],
            "duration_s": duration_s, "requests_per_s": len(ok) / duration_s,
            "output_tokens": out_tokens, "output_tokens_per_s": out_tokens / duration_s,
            **{f"ttft_ms_{k}": v for k, v in percentiles(ttft).items()},
            **{f"tpot_ms_{k}": v for k, v in percentiles(tpot).items()}}


def percentiles(xs: list[float]) -> dict:
    """p50, p90, p99 in milliseconds (nearest rank); NaN for no data."""
    if not xs:
        return {"p50": math.nan, "p90": math.nan, "p99": math.nan}
    xs = sorted(xs)
    pick = lambda q: 1000 * xs[min(len(xs) - 1, max(0, math.ceil(q * len(xs)) - 1))]  # noqa: E731
    return {"p50": pick(0.5), "p90": pick(0.9), "p99": pick(0.99)}


def bench_server(server: ServerProcess, prompts, rate: float, seed: int) -> dict:
    """One warm-up request, then the timed load."""
    asyncio.run(run_load(server.base_url, server.model_name, prompts[:1], math.inf, seed))
    results, duration = asyncio.run(run_load(server.base_url, server.model_name, prompts, rate, seed))
    return {**figures(results, duration), "texts": [r.text for r in results]}


# ==== the run =================================================================================

def run(args) -> dict:
    """Every server on the same prompts and arrivals; the figures of each, or why it was skipped."""
    from nanopaged.models.demo_model import demo_model_path
    model = str(args.model) if args.model else str(demo_model_path())
    prompts = make_prompts(args.num_requests, tuple(args.input_len), tuple(args.output_len), args.seed)
    result = {"workload": "serve", "settings": {
        "model": model, "rate": args.rate, "num_requests": args.num_requests,
        "input_len_words": list(args.input_len), "output_len": list(args.output_len), "seed": args.seed,
        "sampling": "greedy (temperature 0), streamed, EOS honoured"}, "servers": {}}
    # The same device and dtype for both: nanopaged's defaults (float32 on CPU, bfloat16 on CUDA).
    device = args.device if args.device != "auto" else ("cuda" if _cuda() else "cpu")
    dtype = "float32" if device == "cpu" else "bfloat16"
    result["settings"].update(device=device, dtype=dtype)
    with start_nanopaged(model, ["--device", device, "--dtype", dtype, *args.engine_args]) as server:
        result["servers"]["nanopaged"] = bench_server(server, prompts, args.rate, args.seed)
    for peer in args.peers:
        try:
            with start_transformers(model, device, dtype) as server:
                result["servers"][peer] = bench_server(server, prompts, args.rate, args.seed)
        except RuntimeError as e:
            result["servers"][peer] = {"skipped": str(e)}
    from benchmarks.machine import machine_info, versions
    from importlib.metadata import version
    result["machine"] = machine_info(device)
    result["versions"] = {**versions(), **{p: version(p) for p in ("fastapi", "uvicorn", "openai")}}
    texts = {name: r.pop("texts") for name, r in result["servers"].items() if "texts" in r}
    if len(texts) == 2:                  # same greedy prompts: how many answers agree exactly
        a, b = texts.values()
        result["same_text"] = sum(x == y for x, y in zip(a, b))
    return result


def _cuda() -> bool:
    import torch
    return torch.cuda.is_available()


def print_report(result: dict) -> None:
    s = result["settings"]
    print(f"\nserve: {s['num_requests']} streamed requests, Poisson arrivals at {s['rate']}/s, "
          f"prompts {s['input_len_words'][0]}-{s['input_len_words'][1]} words, max_tokens "
          f"{s['output_len'][0]}-{s['output_len'][1]}, greedy; model {s['model']}, {s['device']} {s['dtype']}")
    head = (f"{'server':<14}{'done':>6}{'req/s':>8}{'out tok/s':>11}"
            f"{'TTFT p50/p90/p99 ms':>24}{'TPOT p50/p90/p99 ms':>24}")
    print(head)
    print("-" * len(head))
    for name, r in result["servers"].items():
        if "skipped" in r:
            print(f"{name:<14} skipped: {r['skipped'].splitlines()[0]}")
            continue
        ttft = "/".join(f"{r[f'ttft_ms_{p}']:.0f}" for p in ("p50", "p90", "p99"))
        tpot = "/".join(f"{r[f'tpot_ms_{p}']:.1f}" for p in ("p50", "p90", "p99"))
        print(f"{name:<14}{r['completed']:>6}{r['requests_per_s']:>8.2f}{r['output_tokens_per_s']:>11.1f}"
              f"{ttft:>24}{tpot:>24}")
        if r["failed"]:
            print(f"{'':<14}{r['failed']} failed: {r['errors']}")
    if "same_text" in result:
        print(f"greedy answers identical on both servers: {result['same_text']} of {s['num_requests']}")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", help="a local Hugging Face folder (default: the demo model)")
    p.add_argument("--rate", type=float, default=DEFAULTS["rate"], help="requests per second; inf: all at once")
    p.add_argument("--num-requests", type=int, default=DEFAULTS["num_requests"])
    p.add_argument("--input-len", type=int, nargs=2, default=DEFAULTS["input_len"], metavar=("MIN", "MAX"),
                   help="prompt words (about one token each), uniform")
    p.add_argument("--output-len", type=int, nargs=2, default=DEFAULTS["output_len"], metavar=("MIN", "MAX"),
                   help="max_tokens, uniform")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--peers", default="transformers", help="'transformers' or 'none'")
    p.add_argument("--device", default="auto", choices=["auto", "cpu", "cuda"],
                   help="for both servers (auto: cuda if available); float32 on cpu, bfloat16 on cuda")
    p.add_argument("--engine-args", default="",
                   help="extra flags for nanopaged serve, e.g. --engine-args='--block-size 16'")
    p.add_argument("--json", metavar="PATH", help="write the figures as JSON")
    args = p.parse_args(argv)
    args.peers = [] if args.peers == "none" else [x.strip() for x in args.peers.split(",") if x.strip()]
    for peer in args.peers:
        if peer not in PEERS:
            p.error(f"unknown peer {peer!r}; choose from {', '.join(PEERS)} or none")
    if args.num_requests < 1 or not args.rate > 0:
        p.error("--num-requests must be >= 1 and --rate > 0")
    for name in ("input_len", "output_len"):
        lo, hi = getattr(args, name)
        if not 1 <= lo <= hi:
            p.error(f"--{name.replace('_', '-')} needs 1 <= MIN <= MAX, got {lo} {hi}")
    args.engine_args = args.engine_args.split()
    return args


def main(argv: list[str] | None = None) -> dict:
    args = parse_args(argv)
    result = run(args)
    print_report(result)
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=2) + "\n")
    return result


if __name__ == "__main__":
    main()

