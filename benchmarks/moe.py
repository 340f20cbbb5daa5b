"""bench.py --workload moe: a mixture of experts at a real model's shape, against what its active weights allow.

    python bench.py --workload moe --random-weights olmoe-1b-7b --peers vllm
    python bench.py --workload moe --random-weights qwen3-30b-a3b-12l --quantization int4 --peers vllm

The models: random weights at the shape of OLMoE-1B-7B (6.9B parameters, 1.3B active, 64 experts, top-8)
and of Qwen3-30B-A3B (128 experts of 768, top-8) cut to its first 12 of 48 layers: nanopaged quantizes
after it has loaded the bfloat16 weights, so the whole model in bfloat16 (61 GB) would not fit a 24 GiB
machine, and 12 layers (15 GB) do. Both are written shard by shard, a layer at a time, so the generator
never holds the model either (MOE_CONFIGS, write_random_moe).

Two figures for nanopaged, on one engine: one request at a time (decode tokens/s, timed by
benchmarks/decode_speed.py) against the active-weight floor (the bytes one token reads: attention, router,
its top-k experts, the lm_head, as stored, over the rate a sum reads memory at), and the default trace's
throughput; then vLLM's CPU engine on the same folder and trace, in its own environment, after nanopaged's
engine is gone (both at once would not fit). Targets (issue 39): one request at a time at least 60% of
the floor; the trace at least 1.5x vLLM's. docs/13_moe.md explains the figures.
"""
from __future__ import annotations

import ctypes
import gc
import itertools
import json
import time
from pathlib import Path

import torch

from benchmarks.decode_speed import decode_tokens_per_s
from benchmarks.peers import not_set_up, run_side, side_python, vllm_job
from benchmarks.roofline import copy_bytes_per_s, read_bytes_per_s
from benchmarks.tokenizer import train_tokenizer
from benchmarks.trace import WARMUP_PROMPT, make_trace
from nanopaged import LLM, SamplingParams

MOE_CONFIGS = {
    "olmoe-1b-7b": dict(architectures=["OlmoeForCausalLM"], model_type="olmoe", vocab_size=50304, hidden_size=2048,
                        intermediate_size=1024, num_hidden_layers=16, num_attention_heads=16, num_key_value_heads=16,
                        num_experts=64, num_experts_per_tok=8, norm_topk_prob=False, rms_norm_eps=1e-5,
                        rope_theta=10000.0, max_position_embeddings=4096, tie_word_embeddings=False),
    "qwen3-30b-a3b-12l": dict(architectures=["Qwen3MoeForCausalLM"], model_type="qwen3_moe", vocab_size=151936,
                              hidden_size=2048, intermediate_size=6144, moe_intermediate_size=768,
                              num_hidden_layers=12, num_attention_heads=32, num_key_value_heads=4, head_dim=128,
                              num_experts=128, num_experts_per_tok=8, norm_topk_prob=True, decoder_sparse_step=1,
                              mlp_only_layers=[], rms_norm_eps=1e-6, rope_theta=1_000_000.0,
                              max_position_embeddings=40960, tie_word_embeddings=False),
    "tiny-olmoe": dict(architectures=["OlmoeForCausalLM"], model_type="olmoe", vocab_size=4096, hidden_size=128,
                       intermediate_size=64, num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=2,
                       num_experts=8, num_experts_per_tok=2, norm_topk_prob=False, rms_norm_eps=1e-5,
                       rope_theta=10000.0, max_position_embeddings=1024, tie_word_embeddings=False),   # for tests
}
KV_BLOCKS = 1024          # of 16 tokens: the default trace's 32 requests of up to 192 tokens, with room


def write_random_moe(name: str, folder: Path) -> None:
    """`name`'s config and random bfloat16 weights as Hugging Face lays them out (each expert's gate, up and
    down on its own), one safetensors shard per layer, written as drawn."""
    from safetensors.torch import save_file
    cfg = {**MOE_CONFIGS[name], "bos_token_id": 1, "eos_token_id": 2, "pad_token_id": 2, "dtype": "bfloat16"}
    folder.mkdir(parents=True)
    (folder / "config.json").write_text(json.dumps(cfg, indent=2) + "\n")
    g = torch.Generator().manual_seed(0)

    def rand(*shape):
        return (torch.randn(*shape, generator=g) * shape[-1] ** -0.5).to(torch.bfloat16)

    h, vocab = cfg["hidden_size"], cfg["vocab_size"]
    weight_map = {}

    def write(name: str, tensors: dict) -> None:
        save_file(tensors, folder / name, metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(tensors, name))

    write("model-outer.safetensors", {"model.embed_tokens.weight": rand(vocab, h), "lm_head.weight": rand(vocab, h),
                                      "model.norm.weight": torch.ones(h, dtype=torch.bfloat16)})
    for i in range(cfg["num_hidden_layers"]):
        write(f"model-layer{i:02d}.safetensors", random_layer(cfg, i, rand))
    (folder / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    train_tokenizer(4096, model_max_length=cfg["max_position_embeddings"]).save_pretrained(folder)


def random_layer(cfg: dict, i: int, rand) -> dict:
    h, p = cfg["hidden_size"], f"model.layers.{i}."
    d = cfg.get("head_dim") or h // cfg["num_attention_heads"]
    q, kv, inter = cfg["num_attention_heads"] * d, cfg["num_key_value_heads"] * d, cfg.get("moe_intermediate_size",
                                                                                              cfg["intermediate_size"])
    ones = lambda n: torch.ones(n, dtype=torch.bfloat16)          # noqa: E731
    t = {p + "input_layernorm.weight": ones(h), p + "post_attention_layernorm.weight": ones(h),
         p + "self_attn.q_proj.weight": rand(q, h), p + "self_attn.k_proj.weight": rand(kv, h),
         p + "self_attn.v_proj.weight": rand(kv, h), p + "self_attn.o_proj.weight": rand(h, q),
         p + "mlp.gate.weight": rand(cfg["num_experts"], h)}
    norms = (q, kv) if cfg["model_type"] == "olmoe" else (d, d)   # OLMoE's q/k norm spans the projection
    t[p + "self_attn.q_norm.weight"], t[p + "self_attn.k_norm.weight"] = ones(norms[0]), ones(norms[1])
    for e in range(cfg["num_experts"]):
        x = f"{p}mlp.experts.{e}."
        t[x + "gate_proj.weight"], t[x + "up_proj.weight"] = rand(inter, h), rand(inter, h)
        t[x + "down_proj.weight"] = rand(h, inter)
    return t


def active_bytes(llm: LLM) -> int:
    """Bytes of weights one token reads: every layer's attention and router, its top-k experts (each
    expert's gate, up and down), the final lm_head; as the engine stores them (int4: codes and scales)."""
    m = llm.llm_engine.config.model_config
    moe, itemsize = m.moe, getattr(torch, llm.llm_engine.config.dtype).itemsize
    q, kv = m.num_attention_heads * m.head_dim, m.num_key_value_heads * m.head_dim
    attention = m.hidden_size * (2 * q + 2 * kv)
    expert = 3 * m.hidden_size * moe.intermediate_size
    quantized = llm.get_stats().get("quantization") or {}
    per_weight = (quantized["quantized_bytes"] / quantized["weights_replaced"]) if quantized.get("quantized_linears") \
        else itemsize          # attention and experts alike, as quantize_linears swaps both
    layer = per_weight * (attention + moe.top_k * expert) + itemsize * m.hidden_size * moe.num_experts
    return int(m.num_hidden_layers * layer + itemsize * m.vocab_size * m.hidden_size)


def run_moe(args, model_dir: str, settings: dict) -> dict:
    from benchmarks.models import vocab_limit
    from benchmarks.nanopaged_run import resolved_settings
    settings = {"num_kv_blocks": KV_BLOCKS, **settings}
    trace = make_trace(args.num_requests, args.input_len, args.output_len, args.seed, vocab_limit(model_dir))
    load = time.perf_counter()
    llm = LLM(model_dir, **settings)
    load = time.perf_counter() - load
    stats = llm.get_stats()
    ours = {"load_s": load, **timed_trace(llm, trace), "decode_tokens_per_s": one_at_a_time(llm, trace)}
    floor_bytes, read, copy = active_bytes(llm), read_bytes_per_s(2**30), copy_bytes_per_s(2**30)
    floor = read / floor_bytes
    out = {"settings": {"model": model_dir, "random_weights": args.random_weights, "num_requests": args.num_requests,
                        "input_len": list(args.input_len), "output_len": list(args.output_len), "seed": args.seed,
                        "threads": torch.get_num_threads(), **settings},
           "engine": {**ours, "stats": {k: stats[k] for k in ("cpu_linear", "cpu_kernels", "batch_invariant")},
                      "quantization": stats.get("quantization"), "expert_load": llm.get_stats()["moe"]["max_over_mean"]},
           "floor": {"active_weight_bytes": floor_bytes, "read_bytes_per_s": read, "copy_bytes_per_s": copy,
                     "decode_tokens_per_s": floor,
                     "fraction": ours["decode_tokens_per_s"] / floor}}
    resolved = resolved_settings(llm.llm_engine.config, stats)
    config = llm.llm_engine.config.model_config
    del llm
    release_memory()
    if "vllm" in args.peers:
        out["vllm"] = run_vllm_moe(args, model_dir, config, resolved, trace)
    out["targets"] = moe_targets(out)
    return out


def release_memory() -> None:
    """Give the freed engine's memory back to the system before vLLM loads the same weights beside this
    process: glibc keeps freed blocks of a few MB (an expert's weights) for reuse unless asked to trim."""
    gc.collect()
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):       # not glibc: nothing to ask
        pass


def timed_trace(llm: LLM, trace) -> dict:
    params = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True) for n in trace.output_lens]
    llm.generate(WARMUP_PROMPT, SamplingParams(temperature=0, max_tokens=4, ignore_eos=True), use_tqdm=False)
    llm.reset_stats()
    start = time.perf_counter()
    outs = llm.generate([{"prompt_token_ids": p} for p in trace.prompts], params, use_tqdm=False)
    wall = time.perf_counter() - start
    tokens = sum(len(o.outputs[0].token_ids) for o in outs)
    return {"wall_s": wall, "output_tokens": tokens, "output_tokens_per_s": tokens / wall}


def one_at_a_time(llm: LLM, trace) -> float:
    """Decode tokens/s of the trace's first prompt alone; each call's prompt starts with a token of its own,
    so none reuses the cache another left (vllm_peer.py's single_stream does the same)."""
    first, prompt = itertools.count(100), trace.prompts[0]

    def one(tokens: int) -> None:
        llm.generate({"prompt_token_ids": [next(first)] + prompt[1:]},
                     SamplingParams(temperature=0, max_tokens=tokens, ignore_eos=True), use_tqdm=False)
    return decode_tokens_per_s([one], max(2, max(trace.output_lens)))[0]


def run_vllm_moe(args, model_dir: str, config, resolved: dict, trace) -> dict:
    """vLLM's CPU engine on the same folder and trace, and one request at a time; an error says why not."""
    from benchmarks import vllm_peer
    python = side_python(args, "vllm")
    if python is None:
        return {"error": not_set_up("vllm")}
    job = {**vllm_job(model_dir, config, resolved, trace.prompts, trace.output_lens),
           "single_stream": {"prompt": trace.prompts[0], "output_tokens": max(2, max(trace.output_lens))}}
    try:
        out = run_side(python, vllm_peer, job)
    except RuntimeError as e:
        return {"error": str(e)}
    return {"version": out["vllm"], "load_s": out["load_s"], "wall_s": out["wall_s"],
            "output_tokens": out["output_tokens"], "output_tokens_per_s": out["output_tokens"] / out["wall_s"],
            "decode_tokens_per_s": out.get("decode_tokens_per_s")}


def moe_targets(r: dict) -> dict:
    fraction = r["floor"]["fraction"]
    targets = {"one request at a time >= 60% of the active-weight floor": {"value": fraction, "met": fraction >= 0.6}}
    theirs = r.get("vllm", {}).get("output_tokens_per_s")
    if theirs:
        x = r["engine"]["output_tokens_per_s"] / theirs
        targets["the trace >= 1.5x vLLM CPU's"] = {"value": x, "met": x >= 1.5}
    return targets


def print_moe(r: dict) -> None:
    s, e, f = r["settings"], r["engine"], r["floor"]
    print(f"\nmixture of experts: {s['random_weights']} (random weights), {s['num_requests']} requests, input "
          f"{s['input_len'][0]}-{s['input_len'][1]}, output {s['output_len'][0]}-{s['output_len'][1]}, "
          f"{s['threads']} threads; {r['machine']['cpu']}, flags {' '.join(r['machine']['matrix_flags'])}")
    print(f"  nanopaged ({e['stats']['cpu_linear']}, {e['stats']['cpu_kernels']}, quantization "
          f"{(e['quantization'] or {}).get('quantization')}): trace {e['output_tokens_per_s']:.1f} tok/s, one request "
          f"{e['decode_tokens_per_s']:.2f} tok/s, loaded in {e['load_s']:.0f} s; busiest expert {e['expert_load']:.2f}x "
          "the mean")
    print(f"  active-weight floor: {f['active_weight_bytes'] / 1e9:.2f} GB a token at {f['read_bytes_per_s'] / 1e9:.1f} "
          f"GB/s read (a copy: {f['copy_bytes_per_s'] / 1e9:.1f} GB/s) = {f['decode_tokens_per_s']:.2f} tok/s; one "
          f"request at {f['fraction']:.0%} of it")
    v = r.get("vllm")
    if v and "error" in v:
        print(f"  vLLM CPU: {v['error']}")
    elif v:
        print(f"  vLLM CPU {v['version']}: trace {v['output_tokens_per_s']:.1f} tok/s, one request "
              f"{v['decode_tokens_per_s'] or 0:.2f} tok/s, loaded in {v['load_s']:.0f} s")
    for name, t in r["targets"].items():
        print(f"  target {name}: {t['value']:.2f} {'MET' if t['met'] else 'MISSED'}")
