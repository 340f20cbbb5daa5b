"""GPU checks: the CUDA path against the torch reference. Skipped without CUDA.

scripts/gpu_check.sh runs this file (and a short bench) on a CUDA machine.
"""
import pytest
import torch

from conftest import make_prompts
from nanopaged import LLM, SamplingParams

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")

GREEDY = SamplingParams(temperature=0, max_tokens=16)


def run(model_dir, **kw):
    llm = LLM(model_dir, device="cuda", dtype="float32", num_kv_blocks=64, **kw)
    prompts = [{"prompt_token_ids": p} for p in make_prompts(512, n=8, seed=40)]
    return [o.outputs[0].token_ids for o in llm.generate(prompts, GREEDY, use_tqdm=False)], llm


@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3"])
def test_triton_backend_with_cuda_graphs_equals_torch_on_cuda(tiny_model_dirs, hf_greedy, arch):
    prompts = make_prompts(512, n=8, seed=40)
    expected = hf_greedy(tiny_model_dirs[arch], prompts, 16)
    torch_out, _ = run(tiny_model_dirs[arch], attention_backend="torch")
    eager_out, _ = run(tiny_model_dirs[arch], attention_backend="triton", enforce_eager=True)
    graph_out, llm = run(tiny_model_dirs[arch], attention_backend="triton", max_num_seqs=8)
    from nanopaged.attention.cuda_graphs import CUDAGraphModel
    assert isinstance(llm.llm_engine.runner.model, CUDAGraphModel)
    assert torch_out == expected and eager_out == expected and graph_out == expected


def test_async_scheduling_is_on_and_gives_the_synchronous_tokens_on_cuda(tiny_model_dirs):
    """On CUDA async scheduling is on by default; its forward passes (CUDA graphs replayed) run on the model thread."""
    off, _ = run(tiny_model_dirs["qwen3"], attention_backend="triton", max_num_seqs=8, async_scheduling=False)
    on, llm = run(tiny_model_dirs["qwen3"], attention_backend="triton", max_num_seqs=8)
    assert llm.get_stats()["async_scheduling"] is True and llm.llm_engine.overlap.num_overlapped_steps > 0
    assert on == off


def test_flash_backend_equals_torch_on_cuda(tiny_model_dirs):
    pytest.importorskip("flash_attn")
    torch_out, _ = run(tiny_model_dirs["llama"], attention_backend="torch")
    # flash-attn computes in half precision only
    llm = LLM(tiny_model_dirs["llama"], device="cuda", dtype="bfloat16", attention_backend="flash",
              num_kv_blocks=64)
    outs = llm.generate([{"prompt_token_ids": p} for p in make_prompts(512, n=8, seed=40)], GREEDY,
                        use_tqdm=False)
    agree = sum(o.outputs[0].token_ids[:4] == t[:4] for o, t in zip(outs, torch_out))
    assert agree >= 6          # bf16 vs fp32: near-ties may flip late tokens, not most first ones


def test_kv_cache_sized_from_free_memory(tiny_model_dirs):
    llm = LLM(tiny_model_dirs["llama"], device="cuda", gpu_memory_utilization=0.3, max_model_len=512)
    free, total = torch.cuda.mem_get_info()
    assert llm.get_stats()["num_kv_blocks"] > 0
    assert torch.cuda.memory_allocated() <= 0.3 * total * 1.05


def test_demo_model_on_cuda_in_bfloat16(demo_model_dir):
    llm = LLM(demo_model_dir, device="cuda", max_model_len=2048)
    out = llm.chat([{"role": "user", "content": "What is the capital of France?"}],
                   SamplingParams(temperature=0, max_tokens=20), use_tqdm=False)
    assert "Paris" in out[0].outputs[0].text


def test_every_sampling_rule_runs_on_cuda_and_a_seed_reproduces_it(tiny_model_dirs):
    """The sampler's tensors and generators must live on the logits' device (on CPU, a
    tensor or generator left on the default device goes unnoticed: docs/testing.md says what ran on a GPU)."""
    llm = LLM(tiny_model_dirs["llama"], device="cuda", dtype="float32", num_kv_blocks=64)
    prompts = [{"prompt_token_ids": p} for p in make_prompts(512, n=4, seed=41)]
    rules = dict(temperature=0.8, top_k=20, top_p=0.9, min_p=0.05, repetition_penalty=1.2,
                 presence_penalty=0.3, frequency_penalty=0.2, min_tokens=4, logprobs=2, max_tokens=12)
    seeded = [SamplingParams(seed=i, **rules) for i in range(4)]
    first = [o.outputs[0].token_ids for o in llm.generate(prompts, seeded, use_tqdm=False)]
    again = [o.outputs[0].token_ids for o in llm.generate(prompts, seeded, use_tqdm=False)]
    assert first == again and all(len(t) >= 4 for t in first)
    unseeded = llm.generate(prompts, SamplingParams(**rules), use_tqdm=False)   # the engine's generator
    assert all(len(o.outputs[0].token_ids) >= 4 for o in unseeded)
