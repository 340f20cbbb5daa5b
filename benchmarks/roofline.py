"""The roofline: the multiply-add rate of the kernel the engine's matmuls run on, the FLOPs the trace needs, and
the share of the tokens/s that ceiling allows which nanopaged reaches; and the trace floor, the fastest this machine
could run nanopaged's own steps, each bound by its bytes or by its arithmetic, summed per kind of step."""
from __future__ import annotations

import time

import torch

from benchmarks.trace import Run, StepTiming, Trace
from nanopaged.models.config import ModelConfig
from nanopaged.cpu.linear import KERNELS
from nanopaged.cpu.quantized_linear import quantized_linear

DECODE_KINDS = (("1 row", 1), ("2-8 rows", 8), ("9-32 rows", 32), (">32 rows", float("inf")))


def roofline_figures(m: ModelConfig, trace: Trace, run: Run, device: str, dtype: torch.dtype,
                     earlier_peaks: tuple[float, ...] = (), linear: str = "reference", stats: dict | None = None,
                     group_size: int = 32) -> dict:
    """The ceiling is the highest of `earlier_peaks` and a timing now (a busy moment only lowers it);
    `stats`' quantization and kv_cache_dtype set the kernel and the bytes the floor streams."""
    stats = stats or {}
    peak, kernel = kernel_peak_flops(m, device, dtype, linear, stats.get("quantization"), group_size)
    peak = max(peak, *earlier_peaks)
    rows = sorted({s.num_rows for s in run.steps if step_kind(s) != "prompt chunk"})
    flops, tokens = trace_flops(m, trace), trace.num_prompt_tokens + trace.num_output_tokens
    per_token = sum(flops.values()) / tokens
    return {"kernel": kernel, "kernel_flops_per_s": peak, "flops_per_token": per_token,
            "flops_share": {k: v / sum(flops.values()) for k, v in flops.items()},
            "roofline_tokens_per_s": peak / per_token,
            "fraction": (tokens / run.wall_s) / (peak / per_token),
            "floor": floor_figures(m, run, peak, dtype, stats,
                                   own_matmul_seconds(m, rows, device, dtype, linear=linear))}


def kernel_peak_flops(m: ModelConfig, device: str, dtype: torch.dtype, linear: str = "reference",
                      quantized: dict | None = None, group_size: int = 32, rows: int = 256,
                      repeat: int = 5, tries: int = 5) -> tuple[float, str]:
    """FLOP/s and name of the kernel the run's linears use, timed through the engine's own layer of the
    MLP's shape at `rows` rows (docs/07_benchmarks.md, "Roofline")."""
    method = (quantized or {}).get("quantization")
    if device != "cpu" or (method is None and linear not in KERNELS):
        return measure_matmul_flops(device, dtype), f"torch matmul {str(dtype).removeprefix('torch.')}"
    dense = torch.nn.Linear(m.hidden_size, m.intermediate_size, bias=False, dtype=dtype)
    if method:
        bits = 4 if 8 * quantized["quantized_bytes"] < 6 * quantized["weights_replaced"] else 8
        built = method if method in ("int4", "int8", "w8a8") else f"int{bits}"     # gguf: blocks of its bits
        layer, kernel = quantized_linear(built, dense, group_size, None), f"{method} ({quantized['kernel']})"
    else:
        layer, kernel = KERNELS[linear](dense), linear
    x = torch.randn(rows, m.hidden_size, dtype=dtype)
    with torch.inference_mode():
        seconds = best_seconds(lambda: [layer(x) for _ in range(repeat)], tries)
    return repeat * 2 * rows * m.hidden_size * m.intermediate_size / seconds, kernel


def floor_figures(m: ModelConfig, run: Run, peak: float, dtype: torch.dtype, stats: dict,
                  own: dict[int, float] | None = None) -> dict:
    """The trace floor: per step, max(its bytes / the read rate, its FLOPs / `peak`), summed and by kind of
    step, with decode steps' `own` matmul seconds by row count (docs/07_benchmarks.md, "The trace floor")."""
    weight_bytes = stored_weight_bytes(m, dtype, stats.get("quantization"))
    kv_bytes = kv_token_bytes(m, stats.get("kv_cache_dtype"), dtype)
    bandwidth = read_bytes_per_s(weight_bytes)
    steps = []
    for s in run.steps:
        bytes_s = (weight_bytes + kv_bytes * s.context_tokens) / bandwidth
        flops_s = sum(step_flops(m, s).values()) / peak
        own_s = None if step_kind(s) == "prompt chunk" else (own or {}).get(s.num_rows, 0.0)
        steps.append((step_kind(s), s.model_s, max(bytes_s, flops_s), bytes_s >= flops_s, own_s))
    floor, kinds = sum(x[2] for x in steps), by_kind(steps)
    decode = [k for name, k in kinds.items() if name != "prompt chunk"]
    decode_s = sum(k["model_s"] for k in decode)
    return {"read_bytes_per_s": bandwidth, "weight_bytes": weight_bytes, "kv_bytes_per_token": kv_bytes,
            "kernel_flops_per_s": peak, "seconds": floor, "model_s": sum(s.model_s for s in run.steps),
            "wall_s": run.wall_s, "fraction": floor / run.wall_s if run.wall_s else 0.0,
            "weight_bound_steps": sum(x[3] for x in steps), "num_steps": len(steps), "by_step_kind": kinds,
            "decode_vs_own_matmuls": sum(k["own_matmuls_s"] for k in decode) / decode_s if decode_s else None}


def by_kind(steps: list[tuple[str, float, float, bool, float | None]]) -> dict:
    """(kind, model s, floor s, bound by bytes, own matmuls s or None) per step -> figures per kind."""
    out = {}
    for name in ("prompt chunk", *dict(DECODE_KINDS)):
        mine = [x for x in steps if x[0] == name]
        if mine:
            model_s, floor_s, by_bytes = (sum(x[i] for x in mine) for i in (1, 2, 3))
            out[name] = {"num_steps": len(mine), "model_s": model_s, "floor_s": floor_s,
                         "share": floor_s / model_s if model_s else 0.0, "bytes_bound_steps": by_bytes,
                         "bound_by": "bytes" if 2 * by_bytes > len(mine) else "arithmetic",
                         "own_matmuls_s": None if name == "prompt chunk" else sum(x[4] for x in mine)}
    return out


def step_kind(s: StepTiming) -> str:
    """"prompt chunk" for a step with more tokens than rows, else the first DECODE_KINDS that holds its rows."""
    if s.num_tokens > s.num_rows:
        return "prompt chunk"
    return next(name for name, most in DECODE_KINDS if s.num_rows <= most)


def step_weights(m: ModelConfig) -> int:
    """Weights one step streams: every decoder layer's matmuls and the lm_head."""
    return m.num_hidden_layers * layer_weights(m) + m.vocab_size * m.hidden_size


def stored_weight_bytes(m: ModelConfig, dtype: torch.dtype, quantized: dict | None) -> int:
    """step_weights' bytes as the engine holds them: the quantized linears at their packed size
    (codes and scales), the rest in the model's dtype."""
    replaced = quantized.get("weights_replaced", 0) if quantized else 0
    return (step_weights(m) - replaced) * dtype.itemsize + (quantized.get("quantized_bytes", 0) if quantized else 0)


def kv_token_bytes(m: ModelConfig, kv_cache_dtype: str | None, dtype: torch.dtype) -> int:
    """Bytes of K and V one token of context takes in the cache (get_stats()'s kv_cache_dtype: the
    torch dtype's name): the model's dtype, one byte a value in fp8, and int8's 4-byte scale per row."""
    if kv_cache_dtype in (None, str(dtype).removeprefix("torch.")):
        return m.kv_bytes_per_token(dtype.itemsize)
    scales = 2 * m.num_hidden_layers * m.num_key_value_heads * 4 if kv_cache_dtype == "int8" else 0
    return m.kv_bytes_per_token(1) + scales


def step_flops(m: ModelConfig, s: StepTiming) -> dict:
    """A step's FLOPs: the layers' matmuls for every new token, the logits for every sampled row,
    attention over every (query, key) pair the step computes (QK^T and PV); embeddings and norms: none."""
    q = m.num_attention_heads * m.head_dim
    return {"linear": 2 * m.num_hidden_layers * layer_weights(m) * s.num_tokens,
            "logits": 2 * m.vocab_size * m.hidden_size * s.num_sampled,
            "attention": 4 * m.num_hidden_layers * q * s.attention_pairs}


def copy_bytes_per_s(num_bytes: int, tries: int = 3) -> float:
    """Bytes read per second by a plain copy of num_bytes (it also writes as many)."""
    src = torch.randn(num_bytes // 4)
    dst = torch.empty_like(src)
    return num_bytes / best_seconds(lambda: dst.copy_(src), tries)


def read_bytes_per_s(num_bytes: int, tries: int = 3) -> float:
    """Bytes read per second by a sum over num_bytes (it writes nothing), the best over fresh buffers: on
    a VM one buffer can read far slower than the next."""
    return num_bytes / min(best_seconds(torch.rand(num_bytes // 4).sum, tries) for _ in range(tries))


def measure_matmul_flops(device: str, dtype: torch.dtype, tries: int = 4) -> float:
    """Best FLOP/s of square matmuls of 1024 and 2048 (torch's, in the run's dtype): the ceiling of a run
    whose matmuls are torch's own."""
    squares = [torch.randn(n, n, device=device, dtype=dtype) for n in (1024, 2048)]
    return max(2 * len(a) ** 3 / best_seconds(lambda: a @ a, tries, device) for a in squares)


def best_seconds(run, tries: int, device: str = "cpu") -> float:
    """The fastest of `tries` timings of run() (on a GPU, from an idle device to an idle device)."""
    sync, best = torch.cuda.synchronize if device.startswith("cuda") else lambda: None, float("inf")
    for _ in range(tries):
        sync()
        t = time.perf_counter()
        run()
        sync()
        best = min(best, time.perf_counter() - t)
    return best


def trace_flops(m: ModelConfig, trace: Trace) -> dict:
    """Model FLOPs the trace needs, counting what nanopaged computes: those of one step that computes
    every token of it, samples every output token, and attends causally over each request's whole length."""
    pairs = sum(n * (n + 1) // 2 for n in (len(p) + o for p, o in zip(trace.prompts, trace.output_lens)))
    tokens = trace.num_prompt_tokens + trace.num_output_tokens
    return step_flops(m, StepTiming(len(trace.prompts), tokens, 0, 0.0, trace.num_output_tokens, pairs))


def layer_weights(m: ModelConfig) -> int:
    """Weights of one decoder layer's matmuls: q, k, v, o projections and the gated MLP."""
    q, kv = m.num_attention_heads * m.head_dim, m.num_key_value_heads * m.head_dim
    return m.hidden_size * (2 * q + 2 * kv) + 3 * m.hidden_size * m.intermediate_size


def own_matmul_seconds(m: ModelConfig, row_counts: list[int], device: str, dtype: torch.dtype,
                       tries: int = 3, linear: str = "reference") -> dict[int, float]:
    """Best time of one pass of a decode step's own matmuls at each row count, every weight its own tensor
    streamed from memory, in the engine's cpu_linear `linear` (docs/07_benchmarks.md)."""
    q, kv = m.num_attention_heads * m.head_dim, m.num_key_value_heads * m.head_dim
    h, i = m.hidden_size, m.intermediate_size
    shapes = [(q + 2 * kv, h), (h, q), (2 * i, h), (h, i)] * m.num_hidden_layers + [(m.vocab_size, h)]
    wrap = KERNELS.get(linear, lambda layer: layer)
    layers = [wrap(torch.nn.Linear(k, n, bias=False, device=device, dtype=dtype)) for n, k in shapes]
    out = {}
    with torch.inference_mode():
        for rows in row_counts:
            inputs = {k: torch.randn(rows, k, device=device, dtype=dtype) for _, k in shapes}
            out[rows] = best_seconds(lambda: [layer(inputs[layer.in_features]) for layer in layers], tries, device)
    return out
