"""A hybrid model's two kinds of memory and its prefix cache for state (docs/15_hybrid_models.md): the bytes
a request of CONTEXT tokens holds (its K/V, its state) beside a full-attention model of the same shape (every
layer attention), and how many such requests the pool holds; then the time to the first token of a question
behind a --prefix-len shared prompt (2,048 by default) once that prompt was computed (a hit, which restores
the state kept at its last block boundary) against a prompt never seen (a miss). Hit and miss take turns,
HYBRID_ROUNDS times; each figure is the fastest."""
from __future__ import annotations

import random

from benchmarks.models import vocab_limit
from benchmarks.nanopaged_run import greedy, timed_generate, token_prompts, warm_up
from benchmarks.trace import random_ids
from nanopaged import LLM
from nanopaged.models.config import ModelConfig

CONTEXT = 4096
HYBRID_ROUNDS = 3
QUESTION_TOKENS = 32


def memory(llm: LLM, m: ModelConfig) -> dict:
    """Bytes per request at CONTEXT tokens, as the pool pages them and as they are filled."""
    stats = llm.get_stats()
    h, bs, pages = stats["hybrid"], stats["block_size"], stats["num_kv_blocks"]
    per_value = llm.llm_engine.runner.kv_cache_dtype.itemsize
    full_attention = 2 * m.num_hidden_layers * m.num_key_value_heads * m.head_dim * per_value
    return {"context": CONTEXT, "block_size": bs, "kv_bytes_per_token": h["kv_bytes_per_token"],
            "state_bytes_per_request": h["state_bytes_per_request"],
            "paged_bytes": (-(-CONTEXT // bs) + h["state_pages_per_request"]) * h["page_bytes"],
            "filled_bytes": CONTEXT * h["kv_bytes_per_token"] + h["state_bytes_per_request_filled"],
            "full_attention_bytes": CONTEXT * full_attention,
            "requests_at_context": h[f"requests_at_{CONTEXT}_tokens"],
            "full_attention_requests": pages * h["page_bytes"] // (CONTEXT * full_attention)}


def time_to_first_token(llm: LLM, prompt: list[int]) -> float:
    figures, _ = timed_generate(llm, token_prompts([prompt]), greedy(1))
    return figures["wall_s"]


def run_hybrid(args, model_dir: str, settings: dict) -> dict:
    m = ModelConfig.from_folder(model_dir)
    if m.hybrid is None:
        raise SystemExit(f"--workload hybrid takes a hybrid model; {m.architecture} is not one")
    llm = LLM(model_dir, **settings)
    warm_up(llm)
    rng, vocab = random.Random(args.seed), vocab_limit(model_dir)
    prefix_len = args.prefix_len or 2048
    hits, misses = [], []
    for _ in range(HYBRID_ROUNDS):
        shared = random_ids(rng, prefix_len, vocab)
        time_to_first_token(llm, shared + random_ids(rng, QUESTION_TOKENS, vocab))       # computes the prefix
        hits.append(time_to_first_token(llm, shared + random_ids(rng, QUESTION_TOKENS, vocab)))
        misses.append(time_to_first_token(llm, random_ids(rng, prefix_len + QUESTION_TOKENS, vocab)))
    stats = llm.get_stats()
    return {"settings": {"model": model_dir, "architecture": m.architecture, "prefix_len": prefix_len,
                         "question_tokens": QUESTION_TOKENS, "rounds": HYBRID_ROUNDS, **settings},
            "memory": memory(llm, m), "ttft_hit_s": min(hits), "ttft_miss_s": min(misses),
            "ttft_speedup": min(misses) / min(hits),
            "snapshots_restored": stats["hybrid"]["state_snapshots_restored"]}
