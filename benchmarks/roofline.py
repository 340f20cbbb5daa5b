"""The roofline: the matmul FLOP/s this machine reaches, the FLOPs the trace needs, and the
share of the tokens/s that ceiling allows which nanopaged reaches; and the trace floor, the
fastest this machine could run nanopaged's own steps, each bound by streaming the weights or
by its arithmetic, whichever takes longer."""
from __future__ import annotations

import time

import torch

from benchmarks.trace import Run, StepTiming, Trace
from nanopaged.models.config import ModelConfig
from nanopaged.cpu.linear import KERNELS


def roofline_figures(m: ModelConfig, trace: Trace, run: Run, device: str, dtype: torch.dtype,
                     earlier_peaks: tuple[float, ...] = (), linear: str = "reference", stats: dict | None = None) -> dict:
    """`earlier_peaks`: the same square-matmul timing taken earlier in the run. The ceiling is
    the highest of them and the one taken now: a host that is busy at one moment only lowers
    the figure, and a lowered ceiling would flatter the fraction. `stats`: the engine's
    get_stats(), whose quantization and kv_cache_dtype set the bytes the floor streams."""
    peak = max((measure_matmul_flops(device, dtype), *earlier_peaks))
    flops = trace_flops(m, trace)
    tokens = trace.num_prompt_tokens + trace.num_output_tokens
    per_token = flops["total"] / tokens
    return {"matmul_flops_per_s": peak, "flops_per_token": per_token,
            "flops_share": {k: v / flops["total"] for k, v in flops.items() if k != "total"},
            "roofline_tokens_per_s": peak / per_token,
            "fraction": (tokens / run.wall_s) / (peak / per_token),
            "decode_steps": decode_figures(m, run.steps, device, dtype, linear),
            "floor": floor_figures(m, run, peak, dtype, stats or {})}


def floor_figures(m: ModelConfig, run: Run, peak: float, dtype: torch.dtype, stats: dict) -> dict:
    """The trace floor: for each of nanopaged's steps, max(the bytes it must read / copy bandwidth,
    FLOPs / matmul peak in the run's dtype); their sum is the fastest this machine could run the
    steps. The bytes: the weights as stored (quantized ones at their packed size) and each request's
    K/V once, in the cache's dtype. The copy's read rate stands for memory bandwidth (a pure read may
    run faster: a floor, not a proof)."""
    weight_bytes = stored_weight_bytes(m, dtype, stats.get("quantization"))
    kv_bytes = kv_token_bytes(m, stats.get("kv_cache_dtype"), dtype)
    bandwidth = copy_bytes_per_s(weight_bytes)
    floors, bound_by_bytes = [], 0
    for s in run.steps:
        bytes_s, flops_s = (weight_bytes + kv_bytes * s.context_tokens) / bandwidth, step_flops(m, s) / peak
        floors.append(max(bytes_s, flops_s))
        bound_by_bytes += bytes_s >= flops_s
    model_s = sum(s.model_s for s in run.steps)
    return {"copy_bytes_per_s": bandwidth, "weight_bytes": weight_bytes, "kv_bytes_per_token": kv_bytes,
            "seconds": sum(floors), "model_s": model_s, "wall_s": run.wall_s,
            "fraction": sum(floors) / run.wall_s if run.wall_s else 0.0,
            "weight_bound_steps": bound_by_bytes, "num_steps": len(floors)}


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


def step_flops(m: ModelConfig, s: StepTiming) -> int:
    """A step's FLOPs: the layers' matmuls for every new token, the logits for every sampled
    row, attention over every (query, key) pair the step computes (QK^T and PV)."""
    q = m.num_attention_heads * m.head_dim
    return (2 * m.num_hidden_layers * layer_weights(m) * s.num_tokens + 2 * m.vocab_size * m.hidden_size
            * s.num_sampled + 4 * m.num_hidden_layers * q * s.attention_pairs)


def copy_bytes_per_s(num_bytes: int, tries: int = 3) -> float:
    """Bytes read per second by a plain copy of num_bytes (it also writes as many)."""
    src = torch.randn(num_bytes // 4)
    dst = torch.empty_like(src)
    return num_bytes / best_seconds(lambda: dst.copy_(src), tries)


def read_bytes_per_s(num_bytes: int, tries: int = 3) -> float:
    """Bytes read per second by a sum over num_bytes (it writes nothing): the rate a decode step that
    streams its weights once can reach; a copy's (copy_bytes_per_s) also pays for its writes. The best
    over fresh buffers of random values: on these VMs one buffer reads at 30 GB/s and the next at 50 (how
    its pages are backed, not measured), and a floor takes the fastest."""
    return num_bytes / min(best_seconds(torch.rand(num_bytes // 4).sum, tries) for _ in range(tries))


def measure_matmul_flops(device: str, dtype: torch.dtype) -> float:
    """Best FLOP/s of square matmuls on this machine: the ceiling the model's matmuls work under."""
    return max(measure_rows_matmul_flops(n, n, n, device, dtype, repeat=1, tries=4) for n in (1024, 2048))


def best_seconds(run, tries: int, device: str = "cpu") -> float:
    """The fastest of `tries` timings of run() (on a GPU, from an idle device to an idle device)."""
    best = float("inf")
    for _ in range(tries):
        if device.startswith("cuda"):
            torch.cuda.synchronize()
        t = time.perf_counter()
        run()
        if device.startswith("cuda"):
            torch.cuda.synchronize()
        best = min(best, time.perf_counter() - t)
    return best


def trace_flops(m: ModelConfig, trace: Trace) -> dict:
    """Model FLOPs the trace needs, counting what nanopaged computes.

    Every token: 2 x (weights of the decoder layers). Logits (2 x vocab x hidden) only for
    the tokens that are sampled, one per output token. Attention, causal: 4 x layers x heads
    x head_dim x (context length) per token (QK^T and PV). Embedding lookups and norms: none.
    """
    q = m.num_attention_heads * m.head_dim
    linear = 2 * m.num_hidden_layers * layer_weights(m) * (trace.num_prompt_tokens + trace.num_output_tokens)
    logits = 2 * m.vocab_size * m.hidden_size * trace.num_output_tokens
    ctx = sum(n * (n + 1) // 2 for n in (len(p) + o for p, o in zip(trace.prompts, trace.output_lens)))
    attention = 4 * m.num_hidden_layers * q * ctx
    return {"linear": linear, "logits": logits, "attention": attention,
            "total": linear + logits + attention}


def layer_weights(m: ModelConfig) -> int:
    """Weights of one decoder layer's matmuls: q, k, v, o projections and the gated MLP."""
    q, kv = m.num_attention_heads * m.head_dim, m.num_key_value_heads * m.head_dim
    return m.hidden_size * (2 * q + 2 * kv) + 3 * m.hidden_size * m.intermediate_size


def decode_figures(m: ModelConfig, steps: list[StepTiming], device: str, dtype: torch.dtype,
                   linear: str = "reference") -> dict:
    """Decode-only steps (one new token per row): the model's FLOP/s in their forward passes,
    against a plain matmul with the same number of rows (the median step's), the MLP's shape,
    and against the step's own matmuls at each step's row count. A decode step of few rows
    streams every weight for little arithmetic, so even the plain matmul is far from the
    square-matmul peak; what the step adds on top of its own matmuls is the engine's."""
    decode = [s for s in steps if s.num_tokens == s.num_rows]
    if not decode:
        return {"num_steps": 0}
    q = m.num_attention_heads * m.head_dim
    flops = sum(matmul_flops(m, s.num_rows) + 4 * m.num_hidden_layers * q * s.context_tokens for s in decode)
    seconds = sum(s.model_s for s in decode)
    rows = sorted(s.num_rows for s in decode)[len(decode) // 2]
    plain = measure_rows_matmul_flops(rows, m.hidden_size, m.intermediate_size, device, dtype)
    own = own_matmul_seconds(m, sorted({s.num_rows for s in decode}), device, dtype, linear=linear)
    own_s = sum(own[s.num_rows] for s in decode)     # each step's matmuls alone, at its own rows
    return {"num_steps": len(decode), "share_of_model_time": seconds / sum(s.model_s for s in steps),
            "median_rows": rows, "flops_per_s": flops / seconds, "plain_matmul_flops_per_s": plain,
            "fraction_of_plain_matmul": flops / seconds / plain,
            "model_matmuls_flops_per_s": matmul_flops(m, rows) / own[rows],
            "seconds": seconds, "model_matmuls_s": own_s, "fraction_of_model_matmuls": own_s / seconds}


def matmul_flops(m: ModelConfig, rows: int) -> int:
    """FLOPs of one pass of the decode step's linears (the layers' and the lm_head) over `rows` rows."""
    return 2 * rows * (m.num_hidden_layers * layer_weights(m) + m.vocab_size * m.hidden_size)


def own_matmul_seconds(m: ModelConfig, row_counts: list[int], device: str, dtype: torch.dtype,
                       tries: int = 3, linear: str = "reference") -> dict[int, float]:
    """Best time (of `tries`) of one pass of the decode step's own matmuls and nothing else, at
    each row count: every layer's q/k/v, o, gate/up and down weights and the lm_head, each its own
    tensor as in the model. Unlike the plain matmul above, whose one small weight stays in the
    CPU's cache, these stream from memory as a real step's do: the ceiling a decode step of that
    many rows works under. `linear`: the engine's cpu_linear, so the layers are the ones it runs
    (packed: oneDNN's bfloat16 kernel; dpbf16: nanopaged's; reference: nn.Linear)."""
    q, kv, h, i = m.num_attention_heads * m.head_dim, m.num_key_value_heads * m.head_dim, m.hidden_size, m.intermediate_size
    shapes = [(q + 2 * kv, h), (h, q), (2 * i, h), (h, i)] * m.num_hidden_layers + [(m.vocab_size, h)]
    layers = []
    for n, k in shapes:
        layer = torch.nn.Linear(k, n, bias=False, device=device, dtype=dtype)
        layers.append(KERNELS[linear](layer) if linear in KERNELS else layer)
    out = {}
    with torch.inference_mode():
        for rows in row_counts:
            inputs = {k: torch.randn(rows, k, device=device, dtype=dtype) for _, k in shapes}
            out[rows] = best_seconds(lambda: [layer(inputs[layer.in_features]) for layer in layers], tries, device)
    return out


def measure_rows_matmul_flops(rows: int, k: int, n: int, device: str, dtype: torch.dtype,
                              repeat: int = 20, tries: int = 5) -> float:
    """Best FLOP/s of (rows x k) @ (k x n) over `tries` timings of `repeat` matmuls each (a small
    one is too short to time alone)."""
    a = torch.randn(rows, k, device=device, dtype=dtype)
    b = torch.randn(k, n, device=device, dtype=dtype)
    return repeat * 2 * rows * k * n / best_seconds(lambda: [a @ b for _ in range(repeat)], tries, device)
