"""The serve workload: streaming clients against a running OpenAI-compatible server, in the
shape of `vllm bench serve`."""
from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import random
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from dataclasses import dataclass, field
from importlib.metadata import version
from pathlib import Path

import torch

from benchmarks.figures import SERVE_TARGETS
from benchmarks.machine import machine_info, versions
from benchmarks.peers import ROOT, not_set_up, repo_env, side_python, vllm_job
from benchmarks.quality import DATA
from benchmarks.report import print_serve
from nanopaged.config import MAX_NUM_BATCHED_TOKENS, EngineConfig
from nanopaged.models.config import ModelConfig
from nanopaged.models.demo_model import demo_model_path

# Sized for a few minutes on a 2-core CPU with the demo model and the default peers, vLLM's start included.
DEFAULTS = dict(rate=(1.0, 4.0, math.inf), dataset=("random", "chat"), num_requests=24,
                input_len=(16, 64), output_len=(16, 48))
DATASETS = ("random", "chat", "chat8")      # chat8: the chat set behind 8 system prompts, in turn
# The servers, nanopaged first (the others are compared with it); --peers picks from the rest. dp2-RULE:
# nanopaged with two engine cores (one thread each on 2 cores) routing by RULE (data parallelism).
PEERS = ("nanopaged-in-process", "vllm", "transformers", "dp2-prefix-aware", "dp2-least-loaded", "dp2-round-robin")
SHORT_NAMES = {"in-process": "nanopaged-in-process"}
DEFAULT_PEERS = "in-process,vllm"
START_TIMEOUT_S = 180
VLLM_START_TIMEOUT_S = 900        # vLLM's CPU build compiles its model before /health answers
# Prompt text (benchmarks/data/serve_prompts.json): common words, so every tokenizer gives about one
# token each; the chat set's system prompt begins with the preamble.
PROMPT_TEXT = json.loads((DATA / "serve_prompts.json").read_text())
WORDS, SYSTEM_PREAMBLE = PROMPT_TEXT["words"].split(), PROMPT_TEXT["system_preamble"]
SYSTEM_WORDS = 300                # the chat set's shared system prompt, in words


# ==== servers as processes ====================================================================

@dataclass
class ServerProcess:
    """A server we started: its process, its base URL, its log file."""
    name: str
    process: subprocess.Popen
    base_url: str
    log: Path
    model_name: str
    about: dict = field(default_factory=dict)     # for the JSON: its command line, settings, version

    def stop(self) -> None:
        """SIGTERM to its process group (its own session), SIGKILL after 15 s."""
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
                    timeout_s: float = START_TIMEOUT_S, name: str = "nanopaged") -> ServerProcess:
    """`python -m nanopaged.entrypoints.serve MODEL --port 0 ...`; ready when it prints its address."""
    cmd = [sys.executable, "-m", "nanopaged.entrypoints.serve", *([model] if model else []), "--host", "127.0.0.1",
           "--port", "0", *(["--served-model-name", served_model_name] if served_model_name else []),
           *engine_args]
    server = spawn(name, cmd, "", "")

    def ready() -> bool:
        for line in server.log.read_text(errors="replace").splitlines():
            if line.startswith("nanopaged: serving "):
                server.model_name = line.split("'")[1]
                server.base_url = line.split(" at ", 1)[1].split()[0].removesuffix("/v1")   # http://127.0.0.1:PORT
                server.about |= {"ready": line, **ready_details(line)}
                return True
        return False
    return wait_ready(server, ready, timeout_s)


def ready_details(line: str) -> dict:
    """The KV blocks, block size and max_model_len nanopaged's ready line names; {} where it names none."""
    m = re.search(r"(\d+) KV blocks of (\d+) tokens, max_model_len (\d+)", line)
    return {} if m is None else dict(zip(("num_kv_blocks", "block_size", "max_model_len"), map(int, m.groups())))


def start_transformers(model: str, device: str = "cpu", dtype: str = "float32",
                       timeout_s: float = START_TIMEOUT_S) -> ServerProcess:
    """`transformers serve MODEL --continuous-batching`; ready when /health answers."""
    exe = shutil.which("transformers")
    if exe is None:
        raise RuntimeError("the `transformers` command is not installed (transformers[serving] >= 5)")
    port = free_port()
    cmd = [exe, "serve", model, "--continuous-batching", "--device", device, "--dtype", dtype,
           "--host", "127.0.0.1", "--port", str(port), "--log-level", "warning"]
    server = spawn("transformers", cmd, f"http://127.0.0.1:{port}", model)
    return wait_ready(server, lambda: get(server.base_url + "/health", 2) is not None, timeout_s)


def start_vllm(python: Path, model: str, settings: dict, timeout_s: float = VLLM_START_TIMEOUT_S) -> ServerProcess:
    """vLLM's OpenAI server from its own environment, with vllm_settings; ready when /health answers."""
    port = free_port()
    cmd = [str(python), "-m", "vllm.entrypoints.openai.api_server", "--model", model, "--served-model-name", model,
           "--host", "127.0.0.1", "--port", str(port), "--dtype", settings["dtype"],
           "--max-model-len", str(settings["max_model_len"]), "--max-num-seqs", str(settings["max_num_seqs"]),
           "--max-num-batched-tokens", str(settings["max_num_batched_tokens"]),
           "--kv-cache-memory-bytes", str(settings["kv_cache_bytes"]), "--enable-prefix-caching",
           "--seed", "0", "--uvicorn-log-level", "warning"]
    # The CPU backend sizes its KV cache from VLLM_CPU_KVCACHE_SPACE (GiB); VLLM_HOST_IP keeps its
    # engine's internal sockets on loopback (it takes the host's address otherwise).
    env = {"VLLM_CPU_KVCACHE_SPACE": str(settings["kv_cache_gib"]), "VLLM_HOST_IP": "127.0.0.1"}
    server = spawn("vllm", cmd, f"http://127.0.0.1:{port}", model, env, {"settings": settings})
    wait_ready(server, lambda: get(server.base_url + "/health", 2) is not None, timeout_s)
    server.about["version"] = json.loads(get(server.base_url + "/version") or "{}").get("version")
    # Which cores its model runs on: on a small host vLLM keeps one for its front end by default.
    server.about["cpu_binding"] = re.findall(r"core ids=\[[^\]]*\]|reserved_cpus=\[[^\]]*\]",
                                             server.log.read_text(errors="replace"))
    return server


def vllm_settings(model: str, dtype: str, ready: dict, engine_args: list[str], device: str = "cpu") -> dict:
    """vLLM's settings matched to what nanopaged resolved (its ready line, the flags given it), as
    peers.py's vllm_job matches the offline peer; vLLM keeps its own block size (multiples of 32 on CPU)."""
    if not ready:
        raise RuntimeError("no nanopaged settings to match: nanopaged did not start, or its ready line named "
                           "no KV blocks, block size and max_model_len")
    resolved = {**ready, "dtype": dtype,
                "max_num_seqs": int(flag_value(engine_args, "--max-num-seqs", EngineConfig.max_num_seqs)),
                "max_num_batched_tokens": int(flag_value(engine_args, "--max-num-batched-tokens",
                                                         MAX_NUM_BATCHED_TOKENS[device]))}
    job = vllm_job(model, ModelConfig.from_folder(model), resolved, [], [])
    return {**{k: job[k] for k in ("dtype", "max_model_len", "max_num_seqs", "max_num_batched_tokens")},
            "kv_cache_bytes": job["kv_cache_bytes"], "kv_cache_gib": max(1, math.ceil(job["kv_cache_bytes"] / 2**30)),
            "nanopaged_block_size": resolved["block_size"]}


def flag_value(flags: list[str], name: str, default):
    """The value of the last `name V` or `name=V` in a list of command-line flags, else `default`."""
    value = default
    for i, f in enumerate(flags):
        if f == name and i + 1 < len(flags):
            value = flags[i + 1]
        elif f.startswith(name + "="):
            value = f.split("=", 1)[1]
    return value


def get(url: str, timeout_s: float = 5) -> str | None:
    """The text a server answers a GET with (status 200), None where it does not."""
    try:
        with urllib.request.urlopen(url, timeout=timeout_s) as r:
            return r.read().decode() if r.status == 200 else None
    except OSError:
        return None


def spawn(name: str, cmd: list[str], base_url: str, model_name: str, env: dict | None = None,
          about: dict | None = None) -> ServerProcess:
    """`cmd` in a session of its own, offline, its output in a log file (a chatty server never blocks on it)."""
    log = Path(tempfile.mkstemp(prefix=f"{name}-serve-", suffix=".log")[1])
    with open(log, "wb") as out:
        process = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, cwd=ROOT, start_new_session=True,
                                   env=repo_env({"HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", **(env or {})}))
    command = " ".join([*(f"{k}={v}" for k, v in (env or {}).items()), *cmd])
    return ServerProcess(name, process, base_url, log, model_name, {"command": command, **(about or {})})


def wait_ready(server: ServerProcess, ready, timeout_s: float) -> ServerProcess:
    """The server once `ready()`; a RuntimeError with its log's tail if it exits or times out."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if ready():
            return server
        if server.process.poll() is not None:
            raise RuntimeError(f"{server.name} exited with {server.process.returncode}:\n{_tail(server.log)}")
        time.sleep(0.2)
    server.stop()
    raise RuntimeError(f"{server.name} was not ready after {timeout_s} s:\n{_tail(server.log)}")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _tail(log: Path, lines: int = 15) -> str:
    return "\n".join(log.read_text(errors="replace").splitlines()[-lines:])


# ==== the prompts =============================================================================

def make_prompts(num_requests: int, input_len: tuple[int, int], output_len: tuple[int, int],
                 seed: int, dataset: str = "random", system_seed: int = 0) -> list[tuple[str | list[dict], int]]:
    """(prompt, max_tokens) per request, seeded: random, a text of about input_len words; chat, messages:
    the shared system prompt (chat8: one of 8, in turn), then a user message of about input_len words."""
    rng = random.Random(seed)
    out = []
    for _ in range(num_requests):
        text = " ".join(rng.choice(WORDS) for _ in range(rng.randint(*input_len))).capitalize()
        max_tokens = rng.randint(*output_len)
        if dataset in ("chat", "chat8"):
            system = system_prompt(system_seed + (len(out) % 8 if dataset == "chat8" else 0))
            text = [{"role": "system", "content": system},
                    {"role": "user", "content": text + "?"}]
        out.append((text, max_tokens))
    return out


def system_prompt(seed: int = 0, words: int = SYSTEM_WORDS) -> str:
    """The preamble, then seeded notes to about `words` words; its seed is not a rate's, so every
    request of every rate, on every server, begins with it."""
    rng = random.Random(f"system prompt {seed}")
    notes = " ".join(rng.choice(WORDS) for _ in range(words - len(SYSTEM_PREAMBLE.split())))
    return f"{SYSTEM_PREAMBLE}\n\nNotes: {notes}."


# ==== the load ================================================================================

@dataclass
class RequestResult:
    ok: bool
    text: str | None = None           # None for a failed request (two failures are no identical answer)
    chunk_times: list[float] = field(default_factory=list, repr=False)   # arrival -> each chunk with text
    latency_s: float = 0.0            # arrival -> the stream's end
    output_tokens: int = 0
    tokens_from_usage: bool = False   # output_tokens from the usage chunk (else: text chunks counted)
    error: str | None = None

    @property
    def ttft_s(self) -> float | None:
        return self.chunk_times[0] if self.chunk_times else None


async def stream_one(client, model: str, prompt: str | list[dict], max_tokens: int, extra_body: dict) -> RequestResult:
    """One streamed greedy request (a completion for a text, a chat completion for messages): the time
    of every chunk that carries text; output tokens from the final usage, else the text chunks counted."""
    chat = not isinstance(prompt, str)
    start, pieces, times, usage = time.perf_counter(), [], [], None
    common = dict(model=model, max_tokens=max_tokens, temperature=0, stream=True,
                  stream_options={"include_usage": True}, extra_body=extra_body)
    try:
        if chat:
            stream = await client.chat.completions.create(messages=prompt, **common)
        else:
            stream = await client.completions.create(prompt=prompt, **common)
        async for chunk in stream:
            now = time.perf_counter()
            if chunk.usage is not None:
                usage = chunk.usage
            text = chunk_text(chunk, chat)
            if text:                  # a chat stream's first chunk (the role) and the usage chunk carry none
                pieces.append(text)
                times.append(now - start)
    except Exception as e:            # a failed request is counted and reported, not fatal
        return RequestResult(False, error=f"{type(e).__name__}: {e}", latency_s=time.perf_counter() - start)
    tokens = usage.completion_tokens if usage is not None else len(times)
    return RequestResult(True, "".join(pieces), times, time.perf_counter() - start, tokens, usage is not None)


def chunk_text(chunk, chat: bool) -> str:
    if not chunk.choices:
        return ""
    return (chunk.choices[0].delta.content if chat else chunk.choices[0].text) or ""


def arrival_times(n: int, rate: float, seed: int) -> list[float]:
    """When each of n requests is sent: a Poisson process at `rate`/s; all at 0 for inf."""
    rng, times, t = random.Random(seed), [], 0.0
    for _ in range(n):
        times.append(t)
        t += 0.0 if math.isinf(rate) else rng.expovariate(rate)
    return times


async def run_load(base_url: str, model: str, prompts: list[tuple], rate: float, seed: int,
                   extra_body: dict | None = None) -> tuple[list[RequestResult], float]:
    """Every request on its own streaming client, arriving as a Poisson process at `rate`/s."""
    from openai import AsyncOpenAI     # the [serve] extra: only this workload needs it
    client = AsyncOpenAI(base_url=base_url + "/v1", api_key="none", max_retries=0, timeout=600)
    extra_body = extra_body or {}

    async def arrive(delay: float, prompt, max_tokens: int) -> RequestResult:
        await asyncio.sleep(delay)
        return await stream_one(client, model, prompt, max_tokens, extra_body)

    delays = arrival_times(len(prompts), rate, seed + 1)
    start = time.perf_counter()
    results = await asyncio.gather(*(arrive(d, p, m) for d, (p, m) in zip(delays, prompts)))
    duration = time.perf_counter() - start
    await client.close()
    return list(results), duration


# ==== the figures =============================================================================

def figures(results: list[RequestResult], duration_s: float) -> dict:
    """One run's requests, throughputs, and TTFT, TPOT and ITL percentiles in ms (ITL pooled)."""
    ok = [r for r in results if r.ok]
    ttft = [r.ttft_s for r in ok if r.ttft_s is not None]
    tpot = [(r.chunk_times[-1] - r.chunk_times[0]) / (r.output_tokens - 1) for r in ok
            if r.chunk_times and r.output_tokens > 1]
    itl = [b - a for r in ok for a, b in zip(r.chunk_times, r.chunk_times[1:])]
    out_tokens = sum(r.output_tokens for r in ok)
    counted = {r.tokens_from_usage for r in ok}
    return {"completed": len(ok), "failed": len(results) - len(ok),
            "errors": sorted({r.error for r in results if not r.ok})[:3],
            "duration_s": duration_s, "requests_per_s": len(ok) / duration_s,
            "output_tokens": out_tokens, "output_tokens_per_s": out_tokens / duration_s,
            "output_tokens_from": ("usage" if counted == {True} else "text chunks" if counted == {False}
                                   else "usage where given, else text chunks" if counted else None),
            **{f"ttft_ms_{k}": v for k, v in percentiles(ttft).items()},
            **{f"tpot_ms_{k}": v for k, v in percentiles(tpot).items()},
            **{f"itl_ms_{k}": v for k, v in percentiles(itl).items()}}


def percentiles(xs: list[float]) -> dict:
    """p50, p90, p99 of seconds, in milliseconds (nearest rank); NaN for no data."""
    if not xs:
        return {"p50": math.nan, "p90": math.nan, "p99": math.nan}
    xs = sorted(xs)
    pick = lambda q: 1000 * xs[min(len(xs) - 1, max(0, math.ceil(q * len(xs)) - 1))]  # noqa: E731
    return {"p50": pick(0.5), "p90": pick(0.9), "p99": pick(0.99)}


def rate_label(rate: float) -> str:
    """A rate as the JSON's key: '4', '0.5', 'inf'."""
    return "inf" if math.isinf(rate) else f"{rate:g}"


def target_figures(servers: dict, datasets: list[str]) -> dict:
    """Issue 40's two targets per prompt set, nanopaged against vLLM."""
    def runs(name: str, dataset: str) -> dict:
        return servers.get(name, {}).get("datasets", {}).get(dataset, {})
    return {d: {"saturated_throughput_vs_vllm": throughput_target(runs("nanopaged", d), runs("vllm", d)),
                "ttft_p99_where_vllm_passes_2s": ttft_target(runs("nanopaged", d), runs("vllm", d))}
            for d in datasets}


def throughput_target(ours: dict, theirs: dict) -> dict:
    """All at once (the inf rate): nanopaged's output tokens/s over vLLM's, at least 1.5."""
    goal = SERVE_TARGETS["saturated_vs_vllm"]
    out = {"target": f">= {goal}x vllm's output tokens/s at rate inf", "value": None}
    if "inf" not in ours or "inf" not in theirs:
        why = "vllm did not run" if not theirs else "nanopaged did not run" if not ours else "no inf rate measured"
        return {**out, "status": "not measured", "why": why}
    a, b = ours["inf"]["output_tokens_per_s"], theirs["inf"]["output_tokens_per_s"]
    if not b:
        return {**out, "status": "not measured", "why": "vllm produced no tokens", "nanopaged": a, "vllm": b}
    return {**out, "value": a / b, "nanopaged": a, "vllm": b, "status": "met" if a / b >= goal else "missed"}


def ttft_target(ours: dict, theirs: dict) -> dict:
    """At the lowest measured rate where vLLM's p99 TTFT passes 2 s, nanopaged's below 1 s."""
    limit, goal = SERVE_TARGETS["vllm_ttft_p99_ms"], SERVE_TARGETS["ttft_p99_ms"]
    out = {"target": f"p99 TTFT < {goal:.0f} ms where vllm's first passes {limit:.0f} ms", "value": None, "rate": None}
    if not theirs or not ours:
        return {**out, "status": "not measured", "why": "vllm did not run" if not theirs else "nanopaged did not run"}
    past = [r for r in sorted(theirs, key=float) if theirs[r]["ttft_ms_p99"] > limit]
    vllm_p99 = {r: theirs[r]["ttft_ms_p99"] for r in sorted(theirs, key=float)}
    if not past:
        return {**out, "status": "not reached: raise the rates", "vllm_ttft_ms_p99": vllm_p99}
    rate = past[0]
    if rate not in ours or math.isnan(ours[rate]["ttft_ms_p99"]):
        return {**out, "rate": rate, "status": "not measured", "why": f"nanopaged has no TTFT at rate {rate}",
                "vllm_ttft_ms_p99": vllm_p99}
    value = ours[rate]["ttft_ms_p99"]
    return {**out, "rate": rate, "value": value, "vllm": theirs[rate]["ttft_ms_p99"], "vllm_ttft_ms_p99": vllm_p99,
            "status": "met" if value < goal else "missed"}


def same_texts(a: list[str | None], b: list[str | None]) -> int:
    """How many answers two servers gave identically (a failed request matches nothing)."""
    return sum(x is not None and x == y for x, y in zip(a, b))


# ==== the run =================================================================================

def bench_server(server: ServerProcess, workloads: dict, seed: int) -> tuple[dict, dict]:
    """Every prompt set on one server, its warm-up then each rate: ({set: warm-up}, {set: {rate: figures}})."""
    warmups, out = {}, {}
    for dataset, (warmup, rates) in workloads.items():
        start = time.perf_counter()
        results, _ = asyncio.run(run_load(server.base_url, server.model_name, warmup, math.inf, seed))
        warmups[dataset] = {"ok": results[0].ok, "s": time.perf_counter() - start, "error": results[0].error}
        out[dataset] = {}
        for rate, prompts in rates:
            before = prefix_counts(server.base_url)
            results, duration = asyncio.run(run_load(server.base_url, server.model_name, prompts, rate, seed))
            out[dataset][rate_label(rate)] = {**figures(results, duration), "texts": [r.text for r in results],
                                              "prefix_hit_rate": hit_rate(before, prefix_counts(server.base_url))}
    return warmups, out


def prefix_counts(base_url: str) -> tuple[float, float] | None:
    """nanopaged's prefix-cache (hits, queries) so far, from /metrics; None from another server."""
    metrics = get(base_url + "/metrics", 10) or ""
    found = dict(re.findall(r"^nanopaged:prefix_cache_(hits|queries)_total (\S+)$", metrics, re.MULTILINE))
    return (float(found["hits"]), float(found["queries"])) if len(found) == 2 else None


def hit_rate(before, after) -> float | None:
    if before is None or after is None or after[1] == before[1]:
        return None
    return (after[0] - before[0]) / (after[1] - before[1])


def start_server(name: str, model: str, device: str, dtype: str, args, ready: dict) -> ServerProcess:
    """Start one of the servers (vLLM matched to `ready`, nanopaged's resolved settings); RuntimeError if not."""
    flags = ["--device", device, "--dtype", dtype, *args.engine_args]
    if name == "nanopaged":
        return start_nanopaged(model, flags)
    if name == "nanopaged-in-process":
        return start_nanopaged(model, [*flags, "--engine-in-process"], name=name)
    if name.startswith("dp2-"):
        return start_nanopaged(model, [*flags, "--data-parallel-size", "2", "--dp-routing", name[4:]], name=name)
    if name == "vllm":
        python = side_python(args, "vllm")
        if python is None:
            raise RuntimeError(not_set_up("vllm"))
        if device != "cpu":
            raise RuntimeError("the vllm peer is vLLM's CPU build (scripts/setup_vllm_peer.sh); --device cpu only")
        return start_vllm(python, model, vllm_settings(model, dtype, ready, args.engine_args, device))
    return start_transformers(model, device, dtype)


def run(args) -> dict:
    """Every server on the same prompts and arrivals; the figures of each, or why it was skipped."""
    model = str(args.model) if args.model else str(demo_model_path())
    inputs, outputs = tuple(args.input_len), tuple(args.output_len)
    workloads = {d: (make_prompts(1, inputs, outputs, args.seed - 1, d, args.seed),
                     [(rate, make_prompts(args.num_requests, inputs, outputs, args.seed + i, d, args.seed))
                      for i, rate in enumerate(args.rate)]) for d in args.dataset}
    result = {"workload": "serve", "settings": {
        "model": model, "rates": [rate_label(r) for r in args.rate], "datasets": args.dataset,
        "num_requests": args.num_requests, "input_len_words": list(args.input_len),
        "output_len": list(args.output_len), "seed": args.seed, "system_prompt_words": SYSTEM_WORDS,
        "sampling": "greedy (temperature 0), streamed, EOS honoured",
        "percentiles": "nearest rank"}, "servers": {}}
    # The same device and dtype for all: --dtype, else what nanopaged resolves for this model and device.
    device = args.device if args.device != "auto" else ("cuda" if torch.cuda.is_available() else "cpu")
    dtype = args.dtype or default_dtype(model, device)
    result["settings"].update(device=device, dtype=dtype)
    ready = {}
    for name in ("nanopaged", *args.peers):
        try:
            with start_server(name, model, device, dtype, args, ready) as server:
                ready = ready or {k: server.about[k] for k in ("num_kv_blocks", "block_size", "max_model_len")
                                  if k in server.about}
                warmups, runs = bench_server(server, workloads, args.seed)
                result["servers"][name] = {"server": server.about, "warmup": warmups, "datasets": runs}
        except Exception as e:             # a server that does not start is a result to report, not a crash
            result["servers"][name] = {"skipped": str(e) if isinstance(e, RuntimeError) else f"{type(e).__name__}: {e}"}
    result["machine"] = machine_info(device)
    result["versions"] = {**versions(), **{p: version(p) for p in ("fastapi", "uvicorn", "openai")}}
    if result["servers"].get("vllm", {}).get("server", {}).get("version"):
        result["versions"]["vllm"] = result["servers"]["vllm"]["server"]["version"]
    result["same_text"] = compare_texts(result["servers"], args.dataset)
    result["targets"] = target_figures(result["servers"], args.dataset)
    return result


def compare_texts(servers: dict, datasets: list[str]) -> dict:
    """Per set and peer, how many greedy answers equal nanopaged's on the same prompts (each run also
    gets same_text_as_nanopaged); every run loses its texts."""
    ours = {(d, rate): r.pop("texts", None) for d, runs in servers.get("nanopaged", {}).get("datasets", {}).items()
            for rate, r in runs.items()}
    out = {d: {} for d in datasets}
    for name, s in servers.items():
        for d, runs in s.get("datasets", {}).items():
            for rate, r in runs.items():
                texts, mine = r.pop("texts", None), ours.get((d, rate))
                if texts is not None and mine is not None:
                    r["same_text_as_nanopaged"] = same_texts(mine, texts)
                    count = out[d].setdefault(name, {"identical": 0, "of": 0})
                    count["identical"] += r["same_text_as_nanopaged"]
                    count["of"] += len(texts)
    return out


def default_dtype(model: str, device: str) -> str:
    """The dtype nanopaged resolves for this model on this device (a folder it cannot read: its fallback)."""
    try:
        return EngineConfig(model, device=device).dtype
    except ValueError:
        return "float32" if device == "cpu" else "bfloat16"


def positive_rate(text: str) -> float:
    """A --rate value: requests per second, > 0; inf for all at once."""
    try:
        rate = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a number: {text!r}")
    if not rate > 0:                    # also refuses nan
        raise argparse.ArgumentTypeError(f"must be > 0 (or inf), got {text!r}")
    return rate


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", help="a local Hugging Face folder (default: the demo model)")
    p.add_argument("--rate", type=positive_rate, nargs="+", default=list(DEFAULTS["rate"]), metavar="RATE",
                   help="requests per second, one or more (inf: all at once); each server runs each, lowest first")
    p.add_argument("--dataset", nargs="+", choices=DATASETS, default=list(DEFAULTS["dataset"]),
                   help="random: completions of random common words; chat: chat completions after one shared "
                        "system prompt; chat8: after one of 8 system prompts, in turn (data parallelism's routing)")
    p.add_argument("--num-requests", type=int, default=DEFAULTS["num_requests"], help="per rate")
    p.add_argument("--input-len", type=int, nargs=2, default=DEFAULTS["input_len"], metavar=("MIN", "MAX"),
                   help="prompt (chat: user message) words, about one token each, uniform")
    p.add_argument("--output-len", type=int, nargs=2, default=DEFAULTS["output_len"], metavar=("MIN", "MAX"),
                   help="max_tokens, uniform")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--peers", default=DEFAULT_PEERS,
                   help=f"comma-separated, from {', '.join(PEERS)} (in-process for short); 'none' for nanopaged "
                        f"alone (default: {DEFAULT_PEERS})")
    p.add_argument("--vllm-python", metavar="PATH",
                   help="the python of vLLM's side environment (default: $NANOPAGED_VLLM_PYTHON, else the one "
                        "scripts/setup_vllm_peer.sh builds)")
    p.add_argument("--device", default="auto", choices=["auto", "cpu", "cuda"],
                   help="for every server (auto: cuda if available); float32 on cpu, bfloat16 on cuda")
    p.add_argument("--dtype", choices=["float32", "bfloat16"],
                   help="for every server (default: nanopaged's own for the model and device: bfloat16 on cuda "
                        "and on a CPU with bf16 matrix units, where its fast kernels run; else float32)")
    p.add_argument("--engine-args", default="",
                   help="extra flags for nanopaged serve, e.g. --engine-args='--max-num-seqs 64' (vLLM follows "
                        "--max-num-seqs and --max-num-batched-tokens)")
    p.add_argument("--json", metavar="PATH", help="write the figures as JSON")
    args = p.parse_args(argv)
    names = [] if args.peers == "none" else [x.strip() for x in args.peers.split(",") if x.strip()]
    args.peers = list(dict.fromkeys(SHORT_NAMES.get(x, x) for x in names))
    for peer in args.peers:
        if peer not in PEERS:
            p.error(f"unknown peer {peer!r}; choose from {', '.join(PEERS)}, in-process or none")
    args.rate = sorted(set(args.rate))
    args.dataset = list(dict.fromkeys(args.dataset))
    if args.num_requests < 1:
        p.error("--num-requests must be >= 1")
    for name in ("input_len", "output_len"):
        lo, hi = getattr(args, name)
        if not 1 <= lo <= hi:
            p.error(f"--{name.replace('_', '-')} needs 1 <= MIN <= MAX, got {lo} {hi}")
    args.engine_args = args.engine_args.split()
    return args


def main(argv: list[str] | None = None) -> dict:
    args = parse_args(argv)
    result = run(args)
    print_serve(result)
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=2) + "\n")
    return result


if __name__ == "__main__":
    main()
