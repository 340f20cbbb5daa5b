"""One request at a time: the decode tokens/s a single user sees, nanopaged against
Hugging Face `generate` on the same prompt, and vLLM's figure from its own process.

Decode speed is measured apart from the prefill: each engine generates 1 token, then N
tokens, from the same prompt, and decode tokens/s = (N - 1) / (time(N) - time(1)). Each is
the best of a few repeats, and the repeats alternate between the two engines, so a host
that slows down part-way slows both alike. Prefix caching is off, so both timings compute
the whole prompt.
"""
from __future__ import annotations

import time

import torch

from benchmarks.peers import load_hf
from benchmarks.trace import Trace
from nanopaged import LLM, EngineConfig, SamplingParams

REPEATS = 3


def single_stream_length(trace: Trace) -> int:
    """Tokens each single-stream timing generates: the trace's longest output (at least 2)."""
    return max(2, max(trace.output_lens))


def single_stream_figures(model_dir: str, trace: Trace, settings: dict, config: EngineConfig,
                          peers: dict | None = None) -> dict:
    """`peers`: the peers' figures; vLLM's and llama.cpp's `decode_tokens_per_s` were timed the same
    way on the same prompt in their own processes (not alternating with these rounds: before them)."""
    prompt, n = trace.prompts[0], single_stream_length(trace)
    llm = LLM(model_dir, **{**settings, "enable_prefix_caching": False})

    def nanopaged(tokens: int) -> None:
        params = SamplingParams(temperature=0, max_tokens=tokens, ignore_eos=True)
        llm.generate({"prompt_token_ids": prompt}, params, use_tqdm=False)

    model = load_hf(model_dir, config)
    ids = torch.tensor([prompt], device=model.device)

    @torch.inference_mode()
    def hf(tokens: int) -> None:
        model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), do_sample=False,
                       max_new_tokens=tokens, min_new_tokens=tokens,
                       pad_token_id=model.generation_config.pad_token_id or 0)

    engine, peer = decode_tokens_per_s([nanopaged, hf], n)
    out = {"prompt_tokens": len(prompt), "output_tokens": n, "nanopaged_decode_tokens_per_s": engine,
           "hf_decode_tokens_per_s": peer, "ratio": engine / peer}
    for name, key in (("vllm", "vllm"), ("llama.cpp", "llamacpp")):
        peer = (peers or {}).get(name, {})
        if "decode_tokens_per_s" in peer:
            out[f"{key}_decode_tokens_per_s"] = peer["decode_tokens_per_s"]
            out[f"ratio_vs_{key}"] = engine / peer["decode_tokens_per_s"]
    return out


def decode_tokens_per_s(generates: list, n: int) -> list[float]:
    """Each engine's best decode tokens/s over REPEATS rounds; each round times every engine."""
    for generate in generates:
        generate(n)                              # warm-up
    best = [0.0] * len(generates)
    for _ in range(REPEATS):
        for i, generate in enumerate(generates):
            t0 = time.perf_counter()
            generate(1)
            t1 = time.perf_counter()
            generate(n)
            t2 = time.perf_counter()
            best[i] = max(best[i], (n - 1) / max((t2 - t1) - (t1 - t0), 1e-9))
    return best
