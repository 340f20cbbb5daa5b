"""What quantized weights cost in quality: perplexity on a fixed English text written for the bench,
benchmarks/data/english.txt (the spec workload's passages too) then english_more.txt: 3,332 tokens in
the demo model's tokenizer."""
from __future__ import annotations

import math
from pathlib import Path

from nanopaged import LLM, SamplingParams

DATA = Path(__file__).resolve().parent / "data"
TEXTS = (DATA / "english.txt", DATA / "english_more.txt")


def text_ids(tokenizer) -> list[int]:
    return tokenizer.encode("\n\n".join(t.read_text().strip() for t in TEXTS))


def perplexity(llm: LLM, ids: list[int]) -> float:
    out = llm.generate({"prompt_token_ids": ids}, SamplingParams(max_tokens=1, prompt_logprobs=0), use_tqdm=False)[0]
    logprobs = [entry[token].logprob for token, entry in zip(ids[1:], out.prompt_logprobs[1:])]
    return math.exp(-sum(logprobs) / len(logprobs))


def quality_figures(model_dir: str, settings: dict, ids: list[int], llamacpp: dict | None = None) -> dict:
    ours = perplexity(LLM(model_dir, **{**settings, "enable_prefix_caching": False}), ids)
    reference = perplexity(LLM(model_dir, **{**settings, "dtype": "float32", "quantization": None}), ids)
    out = {"text_tokens": len(ids),
           "perplexity": {"nanopaged": ours, "dequantized_float32": reference},
           "vs_float32": abs(ours / reference - 1)}
    if llamacpp and "perplexity" in llamacpp:
        out["perplexity"]["llama.cpp"] = llamacpp["perplexity"]
        out["vs_llamacpp"] = abs(ours / llamacpp["perplexity"] - 1)
    return out
