"""bench.py --workload lora: many LoRA adapters mixed in one batch, against the base model alone."""
from __future__ import annotations

import json
import tempfile
from pathlib import Path

import torch
from safetensors.torch import save_file

from benchmarks.models import vocab_limit
from benchmarks.nanopaged_run import greedy, resolved_settings, timed_generate, token_prompts, warm_up
from benchmarks.peers import run_vllm_side, vllm_job
from benchmarks.trace import make_trace, trace_settings
from nanopaged import LLM, EngineConfig, LoRARequest
from nanopaged.lora.adapter import projection_shapes

ADAPTER_COUNTS = (1, 4, 16)
RANK = 16
PROJECTIONS = {"q_proj": "self_attn", "k_proj": "self_attn", "v_proj": "self_attn", "o_proj": "self_attn",
               "gate_proj": "mlp", "up_proj": "mlp", "down_proj": "mlp"}


def make_random_adapters(model_dir: str, root: Path, count: int, rank: int = RANK, seed: int = 0) -> list[str]:
    """`count` PEFT LoRA folders on every projection of every layer, random A and B (small, so the text
    the model writes stays the model's)."""
    m = EngineConfig(model_dir, device="cpu").model_config
    shapes, folders = projection_shapes(m), []
    for i in range(count):
        g = torch.Generator().manual_seed(seed + i)
        tensors = {}
        for layer in range(m.num_hidden_layers):
            for proj, part in PROJECTIONS.items():
                fan_in, fan_out = shapes[proj]
                key = f"base_model.model.model.layers.{layer}.{part}.{proj}"
                tensors[f"{key}.lora_A.weight"] = torch.randn(rank, fan_in, generator=g) / fan_in ** 0.5
                tensors[f"{key}.lora_B.weight"] = torch.randn(fan_out, rank, generator=g) * 0.01
        folder = root / f"adapter-{i}"
        folder.mkdir(parents=True)
        save_file({k: v.to(torch.bfloat16).contiguous() for k, v in tensors.items()},
                  folder / "adapter_model.safetensors")
        (folder / "adapter_config.json").write_text(json.dumps({
            "peft_type": "LORA", "task_type": "CAUSAL_LM", "r": rank, "lora_alpha": 2 * rank, "lora_dropout": 0.0,
            "bias": "none", "target_modules": list(PROJECTIONS), "base_model_name_or_path": model_dir}))
        folders.append(str(folder))
    return folders


def run_lora(args, model_dir: str, settings: dict) -> dict:
    trace = make_trace(args.num_requests, args.input_len, args.output_len, args.seed, vocab_limit(model_dir))
    params = [greedy(n) for n in trace.output_lens]
    prompts = token_prompts(trace.prompts)
    with tempfile.TemporaryDirectory() as tmp:
        folders = make_random_adapters(model_dir, Path(tmp), max(ADAPTER_COUNTS), seed=args.seed)
        engines = {"base": (LLM(model_dir, **settings), [None] * len(prompts))}
        for n in ADAPTER_COUNTS:
            loras = [LoRARequest(f"adapter-{i}", i + 1, folders[i]) for i in range(n)]
            llm = LLM(model_dir, enable_lora=True, max_loras=n, max_cpu_loras=n, **settings)
            engines[f"{n} adapters"] = (llm, [loras[i % n] for i in range(len(prompts))])
        runs = {name: [] for name in engines}
        for _ in range(2):                   # alternating, so a slow minute of the machine hits them all
            for name, (llm, per_prompt) in engines.items():
                runs[name].append(timed(llm, prompts, params, per_prompt))
        result = {name: min(r, key=lambda x: x["wall_s"]) for name, r in runs.items()}
        for name, (llm, _) in engines.items():
            result[name]["stats"] = {k: llm.get_stats()[k] for k in ("cpu_linear", "cpu_kernels", "batch_invariant",
                                                                     "lora")}
        base = result["base"]["output_tokens_per_s"]
        for name in engines:
            result[name]["of_base"] = result[name]["output_tokens_per_s"] / base
        tokens = {name: runs[name][0]["token_ids"] for name in engines}
        out = {"settings": {"model": model_dir, **trace_settings(args), "rank": RANK, "projections": list(PROJECTIONS),
                            "threads": torch.get_num_threads(), **settings},
               "runs": {name: {k: v for k, v in r.items() if k != "token_ids"} for name, r in result.items()},
               "adapters_change_tokens": sum(a != b for a, b in zip(tokens["4 adapters"], tokens["base"]))}
        if "vllm" in args.peers:
            out["vllm"] = run_vllm_lora(args, model_dir, trace, folders[:4], engines["base"][0])
        out["targets"] = lora_targets(out)
    return out


def timed(llm: LLM, prompts, params, loras) -> dict:
    """One warm-up request per adapter (each read and put in a slot), then the trace, timed."""
    for lora in dict.fromkeys(loras):
        warm_up(llm, lora_request=lora)
    llm.reset_stats()
    run, outs = timed_generate(llm, prompts, params, lora_request=loras)
    return {**run, "token_ids": [o.outputs[0].token_ids for o in outs]}


def run_vllm_lora(args, model_dir: str, trace, folders: list[str], base_llm: LLM) -> dict:
    """vLLM's CPU engine with the same adapters (and without), in its own environment; an error says why not."""
    engine = base_llm.llm_engine
    resolved = resolved_settings(engine.config, base_llm.get_stats())
    job = {**vllm_job(model_dir, engine.config.model_config, resolved, trace.prompts, trace.output_lens),
           "lora_adapters": folders, "max_lora_rank": RANK}
    out = run_vllm_side(args, job)
    return out if "error" in out else {"version": out["vllm"], **{k: out[k] for k in ("lora", "base")}}


def lora_targets(r: dict) -> dict:
    four = r["runs"]["4 adapters"]
    targets = {"4 adapters >= 80% of the base model": {"value": four["of_base"], "met": four["of_base"] >= 0.8}}
    theirs = r.get("vllm", {}).get("lora")
    if theirs:
        x = four["output_tokens_per_s"] / theirs["output_tokens_per_s"]
        targets["4 adapters >= 1.5x vLLM CPU's"] = {"value": x, "met": x >= 1.5}
    return targets
