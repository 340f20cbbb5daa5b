"""The `triton` backend end to end: same greedy tokens as `torch`; clear errors when unavailable.

Without a GPU the kernels run in Triton's interpreter on CPU (conftest.py sets
TRITON_INTERPRET=1). The batches are chosen so that every path of the kernel runs: a token
budget smaller than the longest prompt (chunked prefill after earlier chunks), decode rows
mixed with prefill rows in one step, prefix-cache hits on a second pass, and a block size of 8
(smaller than the kernel's 16-key tile, so one tile spans two blocks).
"""
import os
import subprocess
import sys

import pytest

from conftest import make_prompts
from nanopaged import LLM, SamplingParams
from nanopaged.attention.backends import load_attention_backend, resolve_attention_backend

INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"
DEVICE = "cpu" if INTERPRETED else "cuda"

CASES = {
    "llama-block8": ("llama", {"block_size": 8}),
    "qwen3-block16": ("qwen3", {}),
}


@pytest.mark.parametrize("case", list(CASES))
def test_triton_backend_gives_the_same_greedy_tokens_as_torch(tiny_model_dirs, case):
    pytest.importorskip("triton")
    arch, settings = CASES[case]
    prompts = make_prompts(512, n=4, seed=2, min_len=5, max_len=45)
    assert max(len(p) for p in prompts) > 24   # longer than the budget: that one is chunked
    params = SamplingParams(temperature=0, max_tokens=10)
    tokens = {}
    for backend in ("torch", "triton"):
        # A small pool: the interpreter copies every tensor argument back after each launch.
        llm = LLM(tiny_model_dirs[arch], attention_backend=backend, device=DEVICE,
                  dtype="float32", max_num_batched_tokens=24, num_kv_blocks=64, **settings)
        # Twice: the second pass starts from prefix-cache hits, so its prompts are
        # computed after a context that is already in the pool.
        tokens[backend] = [o.outputs[0].token_ids
                           for _ in range(2)
                           for o in llm.generate([{"prompt_token_ids": p} for p in prompts],
                                                 params, use_tqdm=False)]
        assert llm.get_stats()["prefix_cache_hits"] > 0
    assert tokens["triton"] == tokens["torch"]
    assert len({tuple(t) for t in tokens["torch"]}) > 1   # not a vacuous comparison


# ---- choosing a backend -----------------------------------------------------------------
def test_auto_on_cpu_is_the_torch_reference():
    assert resolve_attention_backend("auto", "cpu", "float32") == "torch"
    assert load_attention_backend("torch").name == "torch"


def test_triton_on_cpu_needs_the_interpreter(monkeypatch):
    pytest.importorskip("triton")
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    with pytest.raises(ValueError, match="needs CUDA.*TRITON_INTERPRET=1"):
        resolve_attention_backend("triton", "cpu", "float32")
    if INTERPRETED:   # on a GPU machine this would load the kernels in interpreter mode
        monkeypatch.setenv("TRITON_INTERPRET", "1")
        assert load_attention_backend(resolve_attention_backend("triton", "cpu", "float32")).name == "triton"


def test_flash_without_cuda_names_the_install_command():
    with pytest.raises(ValueError, match=r"needs CUDA.*pip install -e '\.\[flash\]'"):
        resolve_attention_backend("flash", "cpu", "bfloat16")


def test_flash_without_flash_attn_names_the_install_command():
    try:
        import flash_attn  # noqa: F401
        pytest.skip("flash-attn is installed")
    except ImportError:
        pass
    with pytest.raises(ValueError, match=r"needs flash-attn: pip install -e '\.\[flash\]'"):
        resolve_attention_backend("flash", "cuda", "bfloat16")


def test_llm_rejects_flash_on_cpu_before_loading(tiny_model_dirs):
    with pytest.raises(ValueError, match="attention_backend='flash' needs CUDA"):
        LLM(tiny_model_dirs["llama"], attention_backend="flash", device="cpu")


def test_importing_nanopaged_imports_neither_triton_nor_flash_attn():
    code = ("import nanopaged, sys; "
            "assert 'triton' not in sys.modules, 'triton'; "
            "assert 'flash_attn' not in sys.modules, 'flash_attn'")
    subprocess.run([sys.executable, "-c", code], check=True)


# ---- the flash backend's calls, checked against flash-attn 2's signatures -------------------
# flash-attn cannot be installed without CUDA. Two checks stand in for it: every call must
# bind to flash-attn 2's documented signatures (flash_attn/flash_attn_interface.py, v2.6-2.8)
# with the shapes and dtypes they require, and its result, computed here by the torch
# reference backend's own functions (so this is not an independent check of the numbers),
# must equal the torch backend's. tests/test_gpu.py compares against real flash-attn on a GPU.
def flash_attn_varlen_func(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, dropout_p=0.0,
                           softmax_scale=None, causal=False, window_size=(-1, -1), softcap=0.0,
                           alibi_slopes=None, deterministic=False, return_attn_probs=False, block_table=None):
    """flash-attn 2's signature; the body checks the call and computes with the torch reference."""
    import torch
    from nanopaged.attention.torch_backend import _attend, gather_kv
    num_reqs = cu_seqlens_q.shape[0] - 1
    assert q.dim() == 3 and k.dim() == v.dim() == (4 if block_table is not None else 3)
    assert cu_seqlens_q.dtype == cu_seqlens_k.dtype == torch.int32 and cu_seqlens_k.shape == (num_reqs + 1,)
    assert isinstance(max_seqlen_q, int) and isinstance(max_seqlen_k, int)
    assert causal is True and softmax_scale is not None and dropout_p == 0.0
    if block_table is not None:
        assert block_table.dtype == torch.int32 and block_table.shape[0] == num_reqs
        assert k.shape[1] % 256 == 0                  # upstream flash-attn's paged-KV rule
    out = torch.empty_like(q)
    for b in range(num_reqs):
        qs, qe = int(cu_seqlens_q[b]), int(cu_seqlens_q[b + 1])
        seqlen_k = int(cu_seqlens_k[b + 1] - cu_seqlens_k[b])
        assert qe - qs <= max_seqlen_q and seqlen_k <= max_seqlen_k
        if block_table is None:
            kk, vv = (t[int(cu_seqlens_k[b]):int(cu_seqlens_k[b]) + seqlen_k] for t in (k, v))
        else:
            kk, vv = (gather_kv(t, block_table[b], seqlen_k) for t in (k, v))
        out[qs:qe] = _attend(q[qs:qe], kk, vv, seqlen_k - (qe - qs), softmax_scale)
    return out


def flash_attn_with_kvcache(q, k_cache, v_cache, k=None, v=None, rotary_cos=None, rotary_sin=None,
                            cache_seqlens=None, cache_batch_idx=None, cache_leftpad=None, block_table=None,
                            softmax_scale=None, causal=False, window_size=(-1, -1), softcap=0.0,
                            rotary_interleaved=True, alibi_slopes=None, num_splits=0, return_softmax_lse=False):
    """flash-attn 2's signature; the body checks the call and computes with the torch reference."""
    import torch
    from nanopaged.attention.torch_backend import _attend, gather_kv
    assert q.dim() == 4 and q.shape[1] == 1 and k is None and v is None      # decode rows; K/V already stored
    assert cache_seqlens.dtype == torch.int32 and cache_seqlens.shape == (q.shape[0],)
    assert block_table.dtype == torch.int32 and k_cache.shape[1] % 256 == 0 and causal is True
    return torch.stack([_attend(q[b], gather_kv(k_cache, block_table[b], int(n)),
                                gather_kv(v_cache, block_table[b], int(n)), int(n) - 1, softmax_scale)
                        for b, n in enumerate(cache_seqlens)])


@pytest.mark.parametrize("block_size", [16, 256])   # gather path; flash-attn's own paged path
@pytest.mark.parametrize("batch", ["decode_only", "mixed_with_prefix_context"])
def test_flash_backend_calls_match_flash_attn_signatures_and_a_torch_stand_in(monkeypatch, block_size, batch):
    pytest.importorskip("triton")
    import types

    import torch
    from test_triton_kernels import BATCHES, make_batch
    from nanopaged.attention.torch_backend import TorchAttentionBackend
    from nanopaged.attention.flash_backend import FlashAttentionBackend

    calls = []
    record = lambda fn: lambda *a, **kw: calls.append(fn.__name__) or fn(*a, **kw)   # noqa: E731
    monkeypatch.setitem(sys.modules, "flash_attn", types.SimpleNamespace(
        flash_attn_varlen_func=record(flash_attn_varlen_func), flash_attn_with_kvcache=record(flash_attn_with_kvcache)))
    q, k, v, pool, meta = make_batch(*BATCHES[batch], block_size, 2, 2, 64)
    pool_ref = pool.clone()
    want = TorchAttentionBackend().forward(q, k, v, pool_ref[1, 0], pool_ref[1, 1], meta, 0.125)
    got = FlashAttentionBackend().forward(q, k, v, pool[1, 0], pool[1, 1], meta, 0.125)
    paged_decode = block_size == 256 and batch == "decode_only"
    assert calls == ["flash_attn_with_kvcache" if paged_decode else "flash_attn_varlen_func"]
    assert torch.equal(pool, pool_ref)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
