"""CUDA-graph decode steps: the padding that lets a batch of n run in a captured size.

The capture needs CUDA (scripts/gpu_check.sh runs it); the padding scheme runs anywhere:
here the triton backend, under the Triton interpreter on CPU, computes a padded decode
batch and must give the real rows exactly what the unpadded batch gives, leaving the
KV cache untouched by the padding rows.
"""
import importlib.util
import os

import pytest
import torch

from nanopaged import LLM, SamplingParams
from nanopaged.attention.cuda_graphs import capture_sizes, pad_decode_batch


def test_capture_sizes():
    assert capture_sizes(1) == [1]
    assert capture_sizes(8) == [1, 2, 4, 8]
    assert capture_sizes(48) == [1, 2, 4, 8, 16, 32, 48]


@pytest.mark.skipif(importlib.util.find_spec("triton") is None
                    or (os.environ.get("TRITON_INTERPRET") != "1" and not torch.cuda.is_available()),
                    reason="the triton backend needs triton, and CUDA or TRITON_INTERPRET=1")
def test_padded_decode_batch_equals_the_real_one(tiny_model_dirs):
    # float32 (the CUDA default is bfloat16, too coarse for atol 1e-5) and eager: this test
    # runs the model on padded inputs itself, on CPU or CUDA alike, after one synchronous step (no step in flight).
    llm = LLM(tiny_model_dirs["llama"], attention_backend="triton", num_kv_blocks=32, block_size=8,
              dtype="float32", enforce_eager=True, async_scheduling=False)
    engine = llm.llm_engine
    for i, n in enumerate((5, 11, 20)):
        engine.add_request(str(i), {"prompt_token_ids": list(range(100 * i + 3, 100 * i + 3 + n))},
                           SamplingParams(temperature=0, max_tokens=10, ignore_eos=True))
    engine.step()                                   # prefill all three
    out = engine.scheduler.schedule()               # a decode-only step
    assert [n for _, n in out.scheduled] == [1, 1, 1]
    runner = engine.runner
    inputs = runner.prepare_inputs(out)
    ids, pos, meta = inputs.input_ids, inputs.positions, inputs.meta
    with torch.inference_mode():
        real = runner.model(ids, pos, runner.kv_cache, meta).clone()
        cache_after_real = runner.kv_cache.clone()
        p_ids, p_pos, p_meta = pad_decode_batch(ids, pos, meta, size=8, max_blocks=16)
        padded = runner.model(p_ids, p_pos, runner.kv_cache, p_meta)
    assert p_ids.shape[0] == 8 and p_meta.slot_mapping[3:].eq(-1).all()
    # Not bit-equal: a matmul over 8 rows may round differently from one over 3 rows.
    assert torch.allclose(padded[:3], real, atol=1e-5, rtol=1e-5)
    # The padding rows wrote nothing: every slot but the 3 real ones is bit-identical.
    flat = runner.kv_cache.flatten(2, 3)              # (layers, K/V, slots, kv_heads, head_dim)
    before = cache_after_real.flatten(2, 3)
    others = torch.ones(flat.shape[2], dtype=torch.bool, device=flat.device)
    others[meta.slot_mapping] = False
    assert torch.equal(flat[:, :, others], before[:, :, others])
    assert torch.allclose(flat[:, :, ~others], before[:, :, ~others], atol=1e-5)


def test_graphs_are_captured_without_autograd(tiny_model_dirs, monkeypatch):
    """Capture runs under inference_mode: a graph's output must not keep a grad_fn (and with
    it every activation) alive. Checked on CPU with a stand-in for torch.cuda's graph API."""
    if importlib.util.find_spec("triton") is None or (
            os.environ.get("TRITON_INTERPRET") != "1" and not torch.cuda.is_available()):
        pytest.skip("the triton backend needs triton, and CUDA or TRITON_INTERPRET=1")
    from nanopaged.attention.cuda_graphs import CUDAGraphModel

    modes = []

    class FakeGraph:
        def pool(self):
            return None

        def replay(self):
            pass

    class FakeCapture:
        def __init__(self, graph, pool=None):
            pass

        def __enter__(self):
            modes.append(torch.is_inference_mode_enabled())

        def __exit__(self, *exc):
            return False

    monkeypatch.setattr(torch.cuda, "CUDAGraph", FakeGraph)
    monkeypatch.setattr(torch.cuda, "graph", FakeCapture)
    llm = LLM(tiny_model_dirs["llama"], attention_backend="triton", num_kv_blocks=8, block_size=8,
              dtype="float32", enforce_eager=True)
    runner = llm.llm_engine.runner
    graphs = CUDAGraphModel(runner.model, runner.kv_cache, 8, max_num_seqs=4, max_blocks=4)
    assert sorted(graphs.graphs) == [1, 2, 4] and modes == [True, True, True]
    for _, _, hidden in graphs.graphs.values():
        assert hidden.grad_fn is None and not hidden.requires_grad
