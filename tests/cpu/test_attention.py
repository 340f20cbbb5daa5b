"""The `cpu` backend (decode rows attended by nanopaged's C++ kernel, tests/cpu/test_cpu_ops.py
checks the kernel itself): end to end, the same greedy tokens as `torch` in float32 over chunked
prefill, decode rows mixed with prefill rows, preemption and prefix-cache hits."""
import pytest

from conftest import make_prompts
from nanopaged import LLM, EngineConfig, SamplingParams
from nanopaged.attention.backends import resolve_attention_backend
from nanopaged.cpu.build import available
from nanopaged.cpu.choose import choose

pytestmark = pytest.mark.skipif(available() is not None, reason=f"{available()}")


@pytest.mark.parametrize("arch, settings", [("llama", {"block_size": 8}), ("qwen3", {}), ("qwen2", {"num_kv_blocks": 12})])
def test_the_cpu_backend_gives_the_same_greedy_tokens_as_torch(tiny_model_dirs, arch, settings):
    prompts = make_prompts(512, n=5, seed=4, min_len=5, max_len=45)
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    tokens = {}
    for backend in ("torch", "cpu"):
        llm = LLM(tiny_model_dirs[arch], attention_backend=backend, dtype="float32",
                  max_num_batched_tokens=24, **{"num_kv_blocks": 64, **settings})
        tokens[backend] = [o.outputs[0].token_ids for _ in range(2)       # the second pass hits the prefix cache
                           for o in llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)]
    assert tokens["cpu"] == tokens["torch"]
    assert len({tuple(t) for t in tokens["torch"]}) > 1


def test_the_cpu_backend_needs_a_cpu_and_its_kernels(monkeypatch, tiny_model_dirs):
    import nanopaged.cpu.build as cpu_ops
    with pytest.raises(ValueError, match=r"attention_backend='cpu' runs on CPU \(device is 'cuda'\)"):
        resolve_attention_backend("cpu", "cuda", "bfloat16")
    with pytest.raises(ValueError, match=r"attention_backend='cpu' keeps pairs of tokens side by side in a block: "
                                         r"block_size must be at least 2, got 1"):
        choose(EngineConfig(tiny_model_dirs["llama"], device="cpu", attention_backend="cpu", block_size=1))
    monkeypatch.setattr(cpu_ops, "available", lambda: "building nanopaged's CPU kernels needs a C++ compiler")
    with pytest.raises(ValueError, match="attention_backend='cpu': building nanopaged's CPU kernels needs a C\\+\\+ compiler"):
        choose(EngineConfig(tiny_model_dirs["llama"], device="cpu", dtype="float32", attention_backend="cpu"))
