"""One request at a time: the decode tokens/s a single user sees, nanopaged against
Hugging Face `generate` on the same prompt, alternating (benchmarks/decode_speed.py), and the
peers' figures from their own processes, timed by the same rule. Prefix caching is off, so
both timings compute the whole prompt."""
from __future__ import annotations

import torch

from benchmarks.decode_speed import decode_tokens_per_s
from benchmarks.nanopaged_run import one_request
from benchmarks.peers import load_hf
from benchmarks.trace import Trace
from nanopaged import LLM, EngineConfig


def single_stream_length(trace: Trace) -> int:
    """Tokens each single-stream timing generates: the trace's longest output (at least 2)."""
    return max(2, max(trace.output_lens))


def single_stream_figures(model_dir: str, trace: Trace, settings: dict, config: EngineConfig,
                          peers: dict | None = None) -> dict:
    """`peers`: the peers' figures; vLLM's and llama.cpp's `decode_tokens_per_s` were timed the same
    way on the same prompt in their own processes (not alternating with these rounds: before them)."""
    prompt, n = trace.prompts[0], single_stream_length(trace)
    nanopaged = one_request(LLM(model_dir, **{**settings, "enable_prefix_caching": False}), prompt)

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

