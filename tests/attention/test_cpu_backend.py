"""The `cpu` backend's C++ kernel attends as the torch reference does, reading K/V through the
block table: on shuffled pools with noise in the spare blocks, every dtype it takes, GQA, strided
queries; and end to end, the same greedy tokens as `torch` in float32 over chunked prefill,
decode rows mixed with prefill rows, preemption and prefix-cache hits."""
import random

import pytest
import torch

from conftest import make_prompts
from nanopaged import LLM, SamplingParams
from nanopaged.attention.backends import resolve_attention_backend

from nanopaged.attention.backends import _compiler  # noqa: E402

pytestmark = pytest.mark.skipif(not _compiler(),
                                reason="the cpu backend compiles its kernel: no C++ compiler here")


def reference(q, k_cache, v_cache, tables, lens, scale):
    """Each row's attention over its first lens[r] keys, gathered through its block table, in float32."""
    rows, heads, dim = q.shape
    kv_heads, block = k_cache.shape[2], k_cache.shape[1]
    out = torch.empty(rows, heads, dim)
    for r in range(rows):
        n = lens[r]
        blocks = tables[r, :-(-n // block)]
        kk, vv = k_cache[blocks].flatten(0, 1)[:n].float(), v_cache[blocks].flatten(0, 1)[:n].float()
        qq = q[r].float().view(kv_heads, heads // kv_heads, dim)
        scores = torch.einsum("hgd,thd->hgt", qq, kk) * scale
        out[r] = torch.einsum("hgt,thd->hgd", scores.softmax(-1), vv).reshape(heads, dim)
    return out


@pytest.mark.parametrize("dtype, tolerance", [(torch.float32, 1e-5), (torch.bfloat16, 1e-2), (torch.float16, 2e-3)])
@pytest.mark.parametrize("heads, kv_heads, dim, block", [(9, 3, 64, 16), (8, 8, 128, 8), (16, 2, 64, 32), (4, 2, 16, 8), (6, 2, 96, 16)])
def test_the_kernel_equals_the_reference_on_a_shuffled_pool(dtype, tolerance, heads, kv_heads, dim, block):
    from nanopaged.attention.cpu_backend import kernel
    torch.manual_seed(heads + dim)
    rng = random.Random(block)
    num_blocks, rows = 300, 7
    k_cache = torch.randn(num_blocks, block, kv_heads, dim).to(dtype)      # every spare block is noise
    v_cache = torch.randn(num_blocks, block, kv_heads, dim).to(dtype)
    lens = [rng.randint(1, 200) for _ in range(rows)]
    max_blocks = -(-max(lens) // block)
    tables = torch.randperm(num_blocks)[:rows * max_blocks].view(rows, max_blocks)
    q = torch.randn(rows, heads + kv_heads, dim).to(dtype)[:, :heads]         # strided, as the model hands it over
    got = kernel().paged_decode_attention(q, k_cache, v_cache, tables, torch.tensor(lens), dim ** -0.5)
    assert got.dtype == dtype
    assert torch.allclose(got.float(), reference(q, k_cache, v_cache, tables, lens, dim ** -0.5), atol=tolerance)


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


def test_the_cpu_backend_needs_a_cpu_and_a_compiler(monkeypatch):
    import nanopaged.attention.backends as backends
    with pytest.raises(ValueError, match=r"attention_backend='cpu' runs on CPU \(device is 'cuda'\)"):
        resolve_attention_backend("cpu", "cuda", "bfloat16")
    monkeypatch.setattr(backends, "_compiler", lambda: False)
    with pytest.raises(ValueError, match="needs a C\\+\\+ compiler"):
        resolve_attention_backend("cpu", "cpu", "float32")
