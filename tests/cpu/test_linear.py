"""The CPU fast paths: packed bfloat16 linears (oneDNN's and nanopaged's own) equal F.linear, are
chosen by the CPU's flags, and leave the model's answers where the reference puts them.

The oneDNN ops are private to torch: the first test pins that they exist in the torch this
project requires, so an upgrade that drops or renames them fails here, not in a benchmark."""
import pytest
import torch
import torch.nn.functional as F
from torch import nn

import nanopaged.config as config_module
import nanopaged.cpu.choose as choose_module
from conftest import check_logprobs_close, make_prompts, nanopaged_greedy
from nanopaged import LLM, EngineConfig
from nanopaged.cpu.build import available, cpu_ops
from nanopaged.cpu.choose import choose
from nanopaged.cpu.features import auto_cpu_dtype
from nanopaged.cpu.linear import AmxLinear, Dpbf16Linear, PackedLinear, pack_linears, packed_ops_available

needs_dpbf16 = pytest.mark.skipif(available() is not None or not cpu_ops().has_avx512_bf16,
                                  reason="nanopaged's kernels did not build with AVX512-BF16 here")


def test_the_private_onednn_ops_exist_in_this_torch():
    assert torch.__version__.startswith("2.13"), "pinned: the packed linear uses private oneDNN ops"
    assert packed_ops_available()


@pytest.mark.parametrize("rows", [1, 7, 24, 300])
@pytest.mark.parametrize("bias", [False, True])
def test_a_packed_linear_equals_f_linear_within_bf16_rounding(rows, bias):
    torch.manual_seed(rows)
    linear = nn.Linear(576, 1536, bias=bias, dtype=torch.bfloat16)
    x = torch.randn(rows, 576, dtype=torch.bfloat16)
    with torch.inference_mode():
        want, got = F.linear(x, linear.weight, linear.bias).float(), PackedLinear(linear)(x).float()
    # bf16 keeps 8 bits of mantissa: a sum of 576 products may round differently in another order
    assert torch.allclose(got, want, rtol=2e-2, atol=2e-2 * want.abs().max().item())
    assert got.shape == (rows, 1536)


@needs_dpbf16
@pytest.mark.parametrize("rows", [1, 5, 6, 7, 24, 300])
@pytest.mark.parametrize("out_features, in_features, bias", [(1536, 576, False), (960, 576, True), (100, 64, True),
                                                             (3, 2, False)])
def test_the_dpbf16_linear_rounds_the_exact_product_once(rows, out_features, in_features, bias):
    """Products of bfloat16 numbers are exact in float32: the kernel's output is the float32
    matmul of the same numbers rounded once to bfloat16, but for a sum whose float32 order tips
    it over a rounding boundary. Row counts around the 6-row tile, widths that are not whole
    64-feature tiles, a bias."""
    torch.manual_seed(rows + out_features)
    linear = nn.Linear(in_features, out_features, bias=bias, dtype=torch.bfloat16)
    x = torch.randn(rows, in_features + 2, dtype=torch.bfloat16)[:, :in_features]      # strided rows
    with torch.inference_mode():
        exact = F.linear(x.float(), linear.weight.float(), None if linear.bias is None else linear.bias.float())
        got = Dpbf16Linear(linear)(x)
    assert got.dtype == torch.bfloat16 and got.shape == (rows, out_features)
    assert (got == exact.bfloat16()).float().mean() > 0.99
    assert torch.allclose(got.float(), exact, rtol=2 ** -7, atol=1e-6)


@needs_dpbf16
@pytest.mark.parametrize("rows", [1, 2, 6, 7, 24, 25, 300])
@pytest.mark.parametrize("inter, hidden, bias", [(1536, 576, False), (64, 32, True), (128, 64, False)])
def test_the_gate_up_projection_with_silu_equals_the_two_ops(rows, inter, hidden, bias):
    """linear_bf16_silu_mul (the fused layers' gate_up projection, SiLU(gate) * up in its epilogue)
    gives exactly what linear_bf16 then silu_and_mul give: the same sums, rounded at the same places.
    Row counts around its 6-row tiles and 24-row units; few feature tiles (units of 6 rows) and many."""
    ops = cpu_ops()
    torch.manual_seed(rows + inter)
    linear = nn.Linear(hidden, 2 * inter, bias=bias, dtype=torch.bfloat16)
    layer = Dpbf16Linear(linear)
    x = torch.randn(rows, hidden + 2, dtype=torch.bfloat16)[:, :hidden]
    bias_t = linear.bias.detach() if bias else torch.empty(0)
    with torch.inference_mode():
        want = ops.silu_and_mul(layer(x))
        got = ops.linear_bf16_silu_mul(x, layer.packed_weight, bias_t, inter)
    assert torch.equal(got, want)
    with pytest.raises(RuntimeError, match="multiple of 64"):
        ops.linear_bf16_silu_mul(x, layer.packed_weight, bias_t, inter - 32)


needs_amx = pytest.mark.skipif(available() is not None or not cpu_ops().has_amx_bf16,
                               reason="nanopaged's kernels did not build with AMX-BF16 here (no amx_bf16, amx_tile)")


@needs_amx
@pytest.mark.parametrize("rows", [1, 15, 16, 17, 32, 33, 300])
@pytest.mark.parametrize("out_features, in_features, bias", [(1536, 576, False), (960, 576, True), (100, 64, True),
                                                             (3, 32, False)])
def test_the_amx_linear_rounds_the_float32_product_once(rows, out_features, in_features, bias):
    """AMX's TDPBF16PS sums in float32 too, in steps of 32 inputs: the float32 matmul of the same numbers
    rounded once, but for sums whose order tips them over a rounding boundary. Row counts around the
    16-row tiles and 32-row groups, widths that are not whole 32-feature blocks, a bias, strided rows."""
    torch.manual_seed(rows + out_features)
    linear = nn.Linear(in_features, out_features, bias=bias, dtype=torch.bfloat16)
    x = torch.randn(rows, in_features + 32, dtype=torch.bfloat16)[:, :in_features]
    with torch.inference_mode():
        exact = F.linear(x.float(), linear.weight.float(), None if linear.bias is None else linear.bias.float())
        got = AmxLinear(linear)(x)
    assert got.dtype == torch.bfloat16 and got.shape == (rows, out_features)
    assert (got == exact.bfloat16()).float().mean() > 0.99
    assert torch.allclose(got.float(), exact, rtol=2 ** -7, atol=1e-6)


@needs_amx
def test_the_amx_weight_needs_whole_steps_of_32_inputs():
    with pytest.raises(RuntimeError, match="multiple of 32"):
        AmxLinear(nn.Linear(48, 4, dtype=torch.bfloat16))


@needs_dpbf16
def test_the_dpbf16_weight_needs_an_even_width():
    with pytest.raises(RuntimeError, match="in_features even"):
        Dpbf16Linear(nn.Linear(7, 4, dtype=torch.bfloat16))


@pytest.mark.parametrize("kernel, cls", [("packed", PackedLinear),
                                         pytest.param("dpbf16", Dpbf16Linear, marks=needs_dpbf16),
                                         pytest.param("amx", AmxLinear, marks=needs_amx)])
def test_pack_linears_swaps_plain_linears_only(kernel, cls):
    class Subclass(nn.Linear):            # tensor parallelism's layers subclass nn.Linear
        pass

    model = nn.Sequential(nn.Linear(32, 32, dtype=torch.bfloat16), Subclass(32, 32, dtype=torch.bfloat16))
    assert pack_linears(model, kernel) == 1
    assert isinstance(model[0], cls)
    assert type(model[1]) is Subclass


def test_auto_dtype_follows_the_cpus_bf16_units(monkeypatch, tiny_model_dirs):
    """AMX (Intel Xeons): nanopaged's amx kernel; AVX512-BF16 only (AMD Zen 4): nanopaged's dpbf16;
    both compute each row alone, with or without batch invariance; where neither builds, oneDNN's
    packed kernel; no bfloat16 units: float32 and F.linear."""
    def dtype_and_linear(**settings):
        cfg = EngineConfig(tiny_model_dirs["llama"], device="cpu", **settings)
        return cfg.dtype, choose(cfg).linear
    builds = {"amx": True, "dpbf16": True}
    monkeypatch.setattr(choose_module, "own_kernel_builds", lambda name: builds[name])
    monkeypatch.setattr(config_module, "auto_cpu_dtype", lambda: "bfloat16")
    monkeypatch.setattr(choose_module, "bf16_matrix_units", lambda: ["amx_bf16", "avx512_bf16"])
    assert dtype_and_linear() == ("bfloat16", "amx")
    assert dtype_and_linear(batch_invariant=False) == ("bfloat16", "amx")
    builds["amx"] = False
    assert dtype_and_linear() == ("bfloat16", "dpbf16")
    monkeypatch.setattr(choose_module, "bf16_matrix_units", lambda: ["avx512_bf16"])
    builds["amx"] = True
    assert dtype_and_linear() == ("bfloat16", "dpbf16")
    assert dtype_and_linear(batch_invariant=False) == ("bfloat16", "dpbf16")
    with pytest.raises(ValueError, match="cpu_linear='amx' needs the CPU's flag amx_bf16"):
        dtype_and_linear(cpu_linear="amx")
    builds["dpbf16"] = False
    assert dtype_and_linear() == ("bfloat16", "packed")
    monkeypatch.setattr(config_module, "auto_cpu_dtype", lambda: "float32")
    monkeypatch.setattr(choose_module, "bf16_matrix_units", lambda: [])
    assert dtype_and_linear() == ("float32", "reference")
    # an explicit bfloat16 on a CPU without the units runs, with the reference kernel
    assert dtype_and_linear(dtype="bfloat16") == ("bfloat16", "reference")


def test_auto_cpu_dtype_reads_the_flags(monkeypatch):
    import nanopaged.cpu.features as cf
    monkeypatch.setattr(cf, "cpu_flags", lambda: frozenset({"avx2", "fma"}))          # an AVX2-only EPYC
    assert auto_cpu_dtype() == "float32"
    monkeypatch.setattr(cf, "cpu_flags", lambda: frozenset({"avx2", "avx512_bf16"}))
    assert auto_cpu_dtype() == "bfloat16"


def test_packed_where_it_cannot_run_is_refused_by_name(tiny_model_dirs):
    """Refused when the runner chooses its kernels, before a weight loads."""
    with pytest.raises(ValueError, match="cpu_linear='packed' needs device='cpu', dtype='bfloat16' \\(packed: or"):
        LLM(tiny_model_dirs["llama"], device="cpu", dtype="float16", cpu_linear="packed")
    with pytest.raises(ValueError, match=r"cpu_linear must be one of \['auto', 'packed', 'dpbf16', 'amx', 'reference'\]"):
        EngineConfig(tiny_model_dirs["llama"], cpu_linear="fast")
    with pytest.raises(ValueError, match="cpu_linear='dpbf16' needs device='cpu', dtype='bfloat16'"):
        LLM(tiny_model_dirs["llama"], device="cpu", dtype="float32", cpu_linear="dpbf16")


def test_dpbf16_without_avx512_bf16_is_refused_by_name(monkeypatch, tiny_model_dirs):
    monkeypatch.setattr(choose_module, "bf16_matrix_units", lambda: ["amx_bf16"])
    with pytest.raises(ValueError, match=r"cpu_linear='dpbf16' needs the CPU's flag avx512_bf16"):
        choose(EngineConfig(tiny_model_dirs["llama"], device="cpu", dtype="bfloat16", cpu_linear="dpbf16"))


@pytest.mark.skipif(not choose_module.bf16_matrix_units(), reason="this CPU has no bfloat16 matrix units")
def test_the_packed_model_answers_as_the_reference_does(tiny_model_dirs):
    """Same bf16 weights, two kernels: greedy tokens agree under vLLM's check_logprobs_close rule."""
    prompts = make_prompts(512, n=6, seed=5, min_len=4, max_len=40)
    reference = nanopaged_greedy(LLM(tiny_model_dirs["qwen2"], dtype="bfloat16", cpu_linear="reference"), prompts, 16)
    kernels = ["packed"] + [k for k in ("dpbf16", "amx") if choose_module.own_kernel_builds(k)
                            and choose_module.OWN_KERNEL_FLAGS[k] in choose_module.bf16_matrix_units()]
    for kernel in kernels:
        check_logprobs_close(nanopaged_greedy(LLM(tiny_model_dirs["qwen2"], dtype="bfloat16", cpu_linear=kernel),
                                              prompts, 16), reference)


def test_oneDNNs_float32_kernel_runs_where_asked_beside_the_reference_layers(tiny_model_dirs):
    """cpu_linear="packed" in float32 (vLLM's CPU float32 GEMM): never chosen by auto, the layers and attention stay
    the reference's (the fused layers ran slower in float32), and the answers stay close to F.linear's."""
    cfg = EngineConfig(tiny_model_dirs["qwen2"], device="cpu", dtype="float32", cpu_linear="packed")
    path = choose(cfg)
    assert (path.linear, path.layers, path.attention_backend) == ("packed", "reference", "torch")
    assert choose(EngineConfig(tiny_model_dirs["qwen2"], device="cpu", dtype="float32")).linear == "reference"
    prompts = make_prompts(512, n=4, seed=6, min_len=4, max_len=30)
    reference = nanopaged_greedy(LLM(tiny_model_dirs["qwen2"], dtype="float32"), prompts, 12)
    packed = LLM(tiny_model_dirs["qwen2"], dtype="float32", cpu_linear="packed")
    assert isinstance(packed.llm_engine.runner.model.lm_head, PackedLinear)
    check_logprobs_close(nanopaged_greedy(packed, prompts, 12), reference)
