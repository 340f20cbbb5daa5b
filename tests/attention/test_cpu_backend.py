"""The `cpu` backend (decode rows attended by nanopaged's C++ kernel, tests/kernels/test_cpu_ops.py
checks the kernel itself): end to end, the same greedy tokens as `torch` in float32 over chunked
prefill, decode rows mixed with prefill rows, preemption and prefix-cache hits."""
import pytest

from conftest import make_prompts
from nanopaged import LLM, SamplingParams
from nanopaged.attention.backends import resolve_attention_backend
from nanopaged.kernels.cpu_ops import available

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


def test_the_cpu_backend_needs_a_cpu_and_its_kernels(monkeypatch):
    import nanopaged.kernels.cpu_ops as cpu_ops
    with pytest.raises(ValueError, match=r"attention_backend='cpu' runs on CPU \(device is 'cuda'\)"):
        resolve_attention_backend("cpu", "cuda", "bfloat16")
    monkeypatch.setattr(cpu_ops, "available", lambda: "building nanopaged's CPU kernels needs a C++ compiler")
    with pytest.raises(ValueError, match="attention_backend='cpu': building nanopaged's CPU kernels needs a C\\+\\+ compiler"):
        resolve_attention_backend("cpu", "cpu", "float32")
