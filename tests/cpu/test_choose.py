"""batch_invariant in the one place kernels are chosen (nanopaged/cpu/choose.py): on by default where
every kernel of the path computes a row alone, off elsewhere with a reason, refused by name where a
user asks for it and it cannot hold, before a weight loads."""
import pytest

import nanopaged.cpu.build as build_module
import nanopaged.cpu.choose as choose_module
from nanopaged import LLM, EngineConfig
from nanopaged.cpu.choose import choose, not_batch_invariant


@pytest.fixture
def zen4(monkeypatch):
    """A CPU with AVX512-BF16 where the kernels build."""
    monkeypatch.setattr(build_module, "available", lambda: None)
    monkeypatch.setattr(choose_module, "bf16_matrix_units", lambda: ["avx512_bf16"])
    monkeypatch.setattr(choose_module, "own_kernel_builds", lambda name: True)
    monkeypatch.delenv("VLLM_BATCH_INVARIANT", raising=False)


def chosen(model_dir, **settings):
    path = choose(EngineConfig(model_dir, device="cpu", **settings))
    return path.batch_invariant, path.linear, path.layers, path.attention_backend


def test_on_by_default_where_the_fast_path_holds_it(zen4, tiny_model_dirs):
    model = tiny_model_dirs["llama"]
    assert chosen(model, dtype="bfloat16") == (True, "dpbf16", "fused", "cpu")
    assert chosen(model, dtype="bfloat16", batch_invariant=False)[0] is False


def test_on_an_amx_host_the_path_takes_nanopageds_amx_kernel(monkeypatch, zen4, tiny_model_dirs):
    monkeypatch.setattr(choose_module, "bf16_matrix_units", lambda: ["amx_bf16", "avx512_bf16"])
    model = tiny_model_dirs["llama"]
    assert chosen(model, dtype="bfloat16") == (True, "amx", "fused", "cpu")
    assert chosen(model, dtype="bfloat16", batch_invariant=False) == (False, "amx", "fused", "cpu")
    assert chosen(model, dtype="bfloat16", cpu_linear="dpbf16") == (True, "dpbf16", "fused", "cpu")


@pytest.mark.parametrize("settings, why", [
    ({"dtype": "float32"}, "the linear kernel is 'reference'"),
    ({"dtype": "bfloat16", "cpu_linear": "packed"}, "the linear kernel is 'packed'"),
    ({"dtype": "bfloat16", "cpu_kernels": "reference"}, "the torch reference layers and attention"),
    ({"dtype": "bfloat16", "attention_backend": "torch"}, "the torch reference layers and attention"),
])
def test_off_by_default_where_it_cannot_hold_and_refused_by_name(zen4, tiny_model_dirs, settings, why):
    model = tiny_model_dirs["llama"]
    assert chosen(model, **settings)[0] is False
    with pytest.raises(ValueError, match=f"batch_invariant=True cannot hold here: {why}"):
        chosen(model, batch_invariant=True, **settings)


def test_refused_before_a_weight_loads(tiny_model_dirs):
    with pytest.raises(ValueError, match="batch_invariant=True cannot hold here"):
        LLM(tiny_model_dirs["llama"], dtype="float32", batch_invariant=True)
    with pytest.raises(ValueError, match="batch_invariant must be True or False, got 1"):
        LLM(tiny_model_dirs["llama"], batch_invariant=1)


def test_cuda_and_tensor_parallelism_say_why_not():
    assert "cuBLAS" in not_batch_invariant("cuda", 1, "reference", "reference", "flash")
    assert "tensor_parallel_size" in not_batch_invariant("cpu", 2, "dpbf16", "fused", "cpu")
    assert not_batch_invariant("cpu", 1, "dpbf16", "fused", "cpu") is None


def test_vllms_switch_is_read_where_the_setting_is_not_given(zen4, monkeypatch, tiny_model_dirs):
    model = tiny_model_dirs["llama"]
    monkeypatch.setenv("VLLM_BATCH_INVARIANT", "0")
    assert chosen(model, dtype="bfloat16")[0] is False
    assert chosen(model, dtype="bfloat16", batch_invariant=True)[0] is True      # the setting wins
    monkeypatch.setenv("VLLM_BATCH_INVARIANT", "1")
    with pytest.raises(ValueError, match="batch_invariant=True cannot hold here"):
        chosen(model, dtype="float32")
