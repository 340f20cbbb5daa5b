"""The peers, each on the same trace in the same process: Hugging Face static batching,
transformers' own continuous batching over a paged cache, and vLLM where it is installed."""
from __future__ import annotations

import time

import torch

from benchmarks.memory import hf_static_kv_utilization
from benchmarks.trace import WARMUP_PROMPT, Run, Trace
from nanopaged import EngineConfig

PEERS = ("hf", "hf-paged", "vllm")


def run_peer(name: str, model_dir: str, trace: Trace, args, settings: dict, config: EngineConfig,
             resolved: dict) -> dict:
    """One peer's figures, or why it did not run (the table says so instead of a number).

    `settings` are the engine settings given on the command line (vLLM gets those), `config`
    and `resolved` what nanopaged made of them (the HF peers follow those).
    """
    if name == "vllm":
        try:
            import vllm  # noqa: F401
        except ImportError:
            return {"skipped": "vllm is not installed here; its published figures are shown apart"}
    try:
        if name == "hf":
            return run_hf_sweep(model_dir, trace, config, args.hf_batch_sizes)
        if name == "hf-paged":
            return run_hf_paged(model_dir, trace, config, resolved).figures()
        return run_vllm(model_dir, trace, settings).figures()
    except Exception as e:                   # a peer failing is a result to report, not a crash
        return {"skipped": f"{type(e).__name__}: {e}"}


# ---- Hugging Face transformers ------------------------------------------------------------

def hf_device_dtype(config: EngineConfig) -> tuple[str, torch.dtype]:
    """The device and torch dtype nanopaged resolved ('auto': CUDA + bfloat16, else CPU + float32)."""
    return config.device, getattr(torch, config.dtype)


def load_hf(model_dir: str, config: EngineConfig):
    from transformers import AutoModelForCausalLM
    from transformers.utils import logging as hf_logging
    hf_logging.set_verbosity_error()          # its warnings about unused sampling flags are noise here
    device, dtype = hf_device_dtype(config)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype, attn_implementation="sdpa",
                                                 local_files_only=True)
    return model.to(device).eval()


def run_hf_sweep(model_dir: str, trace: Trace, config: EngineConfig, batch_sizes: list[int]) -> dict:
    """The hf peer at each static batch size; its figures are those of the fastest, so
    nanopaged is compared with Hugging Face at its best on this trace (`sweep` keeps all)."""
    model = load_hf(model_dir, config)
    runs = [run_hf_static(model, trace, b).figures() for b in batch_sizes]
    best = max(runs, key=lambda f: f["output_tokens_per_s"])
    return {**best, "sweep": {str(f["batch_size"]): f["output_tokens_per_s"] for f in runs}}


def run_hf_static(model, trace: Trace, batch_size: int) -> Run:
    """The reservation-style baseline: static batches, left-padded to the longest prompt.

    Each batch decodes until its longest request is done (min_new_tokens = max_new_tokens
    bans EOS, as ignore_eos does); a request counts only the tokens it asked for, so the
    rows a finished request keeps decoding are padded compute, measured as `padding_waste`.
    """
    pad = model.generation_config.pad_token_id or 0
    batches = [range(i, min(i + batch_size, len(trace.prompts)))
               for i in range(0, len(trace.prompts), batch_size)]
    hf_generate(model, [WARMUP_PROMPT["prompt_token_ids"]], 4, pad)
    start, produced = time.perf_counter(), 0
    for b in batches:
        longest_output = max(trace.output_lens[i] for i in b)
        generated = hf_generate(model, [trace.prompts[i] for i in b], longest_output, pad)
        produced += sum(min(generated, trace.output_lens[i]) for i in b)   # what each request asked for
    wall = time.perf_counter() - start
    held = sum(len(b) * (max(len(trace.prompts[i]) for i in b) + max(trace.output_lens[i] for i in b))
               for b in batches)
    real = trace.num_prompt_tokens + trace.num_output_tokens
    return Run("hf", wall, produced, trace.num_prompt_tokens, len(trace.prompts),
               {"batch_size": batch_size, "padding_waste": 1 - real / held,
                "kv_utilization": hf_static_kv_utilization(trace, batches)})


@torch.inference_mode()
def hf_generate(model, prompts: list[list[int]], max_new_tokens: int, pad: int) -> int:
    """One static batch, left-padded; the tokens each row generated."""
    longest = max(map(len, prompts))
    ids = torch.tensor([[pad] * (longest - len(p)) + p for p in prompts], device=model.device)
    mask = torch.tensor([[0] * (longest - len(p)) + [1] * len(p) for p in prompts], device=model.device)
    out = model.generate(input_ids=ids, attention_mask=mask, do_sample=False, pad_token_id=pad,
                         max_new_tokens=max_new_tokens, min_new_tokens=max_new_tokens)
    return out.shape[1] - longest


def run_hf_paged(model_dir: str, trace: Trace, config: EngineConfig, engine: dict) -> Run:
    """transformers' own continuous batching over a paged KV cache (`generate_batch`'s engine).

    We drive its manager directly rather than call `model.generate_batch`, because that takes
    one max_new_tokens for all requests and the trace gives each its own. The KV cache gets
    nanopaged's block size and block count, so both engines have the same KV budget.
    """
    from transformers import GenerationConfig
    from transformers.generation import ContinuousBatchingConfig
    model = load_hf(model_dir, config)
    gen = GenerationConfig(do_sample=False, max_new_tokens=max(trace.output_lens), eos_token_id=-1)
    cb = ContinuousBatchingConfig(page_size=engine["block_size"], num_blocks=engine["num_kv_blocks"],
                                  max_batch_tokens=engine["max_num_batched_tokens"],
                                  max_requests_per_batch=engine["max_num_seqs"])
    with model.continuous_batching_context_manager(generation_config=gen, continuous_batching_config=cb,
                                                   warmup=False) as manager:
        cb_generate(manager, [WARMUP_PROMPT["prompt_token_ids"]], [4])
        start = time.perf_counter()
        results = cb_generate(manager, trace.prompts, trace.output_lens)
        wall = time.perf_counter() - start
    out = sum(min(len(r.generated_tokens), n) for r, n in zip(results, trace.output_lens))
    return Run("hf-paged", wall, out, trace.num_prompt_tokens, len(results),
               {"attn_implementation": model.config._attn_implementation})


def cb_generate(manager, prompts, output_lens) -> list:
    ids = [manager.add_request(p, request_id=f"bench-{time.monotonic_ns()}-{i}", max_new_tokens=n,
                               eos_token_id=-1)       # -1: no EOS, as ignore_eos
           for i, (p, n) in enumerate(zip(prompts, output_lens))]
    results = {}
    while len(results) < len(ids):
        r = manager.get_result(timeout=1)
        if r is not None and r.is_finished():
            if r.error is not None:
                raise RuntimeError(f"transformers continuous batching failed: {r.error}")
            results[r.request_id] = r
        elif r is None and not manager.is_running():
            raise RuntimeError("transformers continuous batching stopped before finishing")
    return [results[i] for i in ids]


# ---- vLLM ---------------------------------------------------------------------------------

def run_vllm(model_dir: str, trace: Trace, settings: dict) -> Run:
    """vLLM's offline API on the same prompts; only where `import vllm` works."""
    from vllm import LLM as VLLM, SamplingParams as VParams
    from vllm.inputs import TokensPrompt
    kwargs = {k: v for k, v in settings.items() if k in ("max_num_seqs", "max_num_batched_tokens",
                                                         "block_size", "max_model_len", "dtype")}
    if "num_kv_blocks" in settings:
        kwargs["num_gpu_blocks_override"] = settings["num_kv_blocks"]
    llm = VLLM(model_dir, **kwargs)
    llm.generate([TokensPrompt(**WARMUP_PROMPT)], VParams(max_tokens=4), use_tqdm=False)
    prompts = [TokensPrompt(prompt_token_ids=p) for p in trace.prompts]
    params = [VParams(temperature=0, max_tokens=n, ignore_eos=True) for n in trace.output_lens]
    start = time.perf_counter()
    outs = llm.generate(prompts, params, use_tqdm=False)
    wall = time.perf_counter() - start
    return Run("vllm", wall, sum(len(o.outputs[0].token_ids) for o in outs),
               trace.num_prompt_tokens, len(outs), {})
