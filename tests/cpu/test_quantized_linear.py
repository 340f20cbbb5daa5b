"""Quantized linears: the 4-bit and 8-bit kernels compute what their codes stand for at every row
count, the GGUF file's own blocks are the weights the converter wrote, no dense weight is kept, and
every bad setting is refused before any weight loads."""
import logging
import math

import numpy as np
import pytest
import torch
from torch import nn

import nanopaged.cpu.quantized_linear as ql
from conftest import check_logprobs_close, make_prompts, nanopaged_greedy
from nanopaged import LLM, EngineConfig, SamplingParams

needs_vnni = pytest.mark.skipif(ql.nanopaged_kernels() is None,
                                reason="nanopaged's quantized kernels run where they were built with AVX512-VNNI")


def dequantize_int4(codes, scale, zero, group):
    out_f, in_f = codes.shape
    return ((codes.float() - 8).reshape(out_f, in_f // group, group) * scale[..., None]
            + zero[..., None]).reshape(out_f, in_f)


def dequantize_blocks(codes, d, m, group):
    """w = q d (+ m): the blocks as pack_quantized takes them, in float64."""
    out_f, in_f = codes.shape
    w = codes.double().reshape(out_f, in_f // group, group) * d.double()[..., None]
    return (w if m.numel() == 0 else w + m.double()[..., None]).reshape(out_f, in_f)


def random_blocks(bits, out_f, in_f, group, seed):
    torch.manual_seed(seed)
    lo, hi = (0, 16) if bits == 4 else (-128, 128)
    codes = torch.randint(lo, hi, (out_f, in_f))
    d = (torch.rand(out_f, in_f // group) / 20).half().float()          # float16 in the packed layout
    m = (torch.randn(out_f, in_f // group) / 10).half().float() if bits == 4 else torch.empty(0)
    return codes, d, m


@needs_vnni
@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("group", [32, 128])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_kernels_multiply_the_quantized_rows_by_the_dequantized_weight_at_every_row_count(bits, group, dtype):
    """At every row count from 1 to 256: y = x^ W^T in float64 up to float32's sums (and the output's
    rounding to bfloat16), x^ the rows as quantize_activations quantizes them; and each row the same
    bits as in the step of all 256."""
    ops = ql.nanopaged_kernels()
    codes, d, m = random_blocks(bits, 100, 256, group, seed=bits + group)
    packed, weight = ops.pack_quantized(codes, d, m, group, bits), dequantize_blocks(codes, d, m, group)
    x = torch.randn(256, 256).to(dtype)
    xq, dx = ql.quantize_activations(x, group)
    x_hat = (xq.double().reshape(256, -1, group) * dx.double()[..., None]).reshape(256, 256)
    want = x_hat @ weight.t()
    full = ops.linear_quantized(x, packed, 100, group, bits)
    rtol = 1e-5 if dtype == torch.float32 else 2 ** -8
    for rows in range(1, 257):
        got = ops.linear_quantized(x[:rows], packed, 100, group, bits)
        assert torch.equal(got, full[:rows]), rows
    assert ((full.double() - want).abs() <= rtol * want.abs() + 1e-5 * want.abs().max()).all()


@needs_vnni
@pytest.mark.parametrize("bits", [4, 8])
def test_quantizing_the_rows_costs_at_most_half_a_step_per_input(bits):
    """Against the rows unquantized: each input is off by at most half its block's step (dx / 2),
    so each output by at most sum over blocks of dx / 2 times the block's sum of |w|."""
    ops, group = ql.nanopaged_kernels(), 32
    codes, d, m = random_blocks(bits, 64, 512, group, seed=3)
    weight = dequantize_blocks(codes, d, m, group)
    x = torch.randn(40, 512) * torch.logspace(-2, 1, 512)        # blocks of very different sizes
    got = ops.linear_quantized(x, ops.pack_quantized(codes, d, m, group, bits), 64, group, bits).double()
    _, dx = ql.quantize_activations(x, group)
    bound = (dx.double() / 2) @ weight.abs().reshape(64, -1, group).sum(-1).t()
    assert ((got - x.double() @ weight.t()).abs() <= bound * (1 + 1e-4) + 1e-5).all()


def test_the_activations_reference_rounds_half_to_even_within_127():
    x = torch.tensor([[127.0, -63.5, 62.5, 0.4] + [0.0] * 28, [0.0] * 32])
    codes, scale = ql.quantize_activations(x, 32)
    assert codes[0, :4].tolist() == [127, -64, 62, 0] and scale[0].item() == 1.0
    assert codes[1].abs().max() == 0 and scale[1].item() == 0.0          # an all-zero block: no division by 0


@pytest.mark.parametrize("group", [32, 64, 128])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_torchs_int4_kernel_multiplies_by_what_its_codes_stand_for(group, dtype, monkeypatch):
    monkeypatch.setattr(ql, "nanopaged_kernels", lambda: None)
    torch.manual_seed(group)
    out_f, in_f = 96, 256
    dense = nn.Linear(in_f, out_f, bias=False, dtype=dtype)
    codes = torch.randint(0, 16, (out_f, in_f))
    scale, zero = torch.rand(out_f, in_f // group) / 10, torch.randn(out_f, in_f // group) / 10
    layer = ql.Int4Linear(dense, codes, scale, zero, group)
    s, z = scale.to(dtype).float(), zero.to(dtype).float()     # torch's keeps them in the activations' dtype
    x = torch.randn(3, in_f, dtype=dtype)
    want = x.float() @ dequantize_int4(codes, s, z, group).t()
    got = layer(x).float()
    tolerance = 1e-4 if dtype == torch.float32 else 2e-2
    assert torch.allclose(got, want, rtol=tolerance, atol=tolerance * want.abs().max().item())


def test_torchs_int8_kernel_multiplies_by_what_its_codes_stand_for(monkeypatch):
    monkeypatch.setattr(ql, "nanopaged_kernels", lambda: None)
    torch.manual_seed(1)
    dense = nn.Linear(128, 64, bias=True)
    layer = ql.quantized_linear("int8", dense, 32, None)
    assert isinstance(layer, ql.Int8Linear)             # one scale per output feature, as torch's kernel takes
    codes, scale = ql.int8_codes(dense.weight.detach(), 128)
    x = torch.randn(2, 128)
    assert torch.allclose(layer(x), x @ (codes * scale).t() + dense.bias, atol=1e-4)


@needs_vnni
@pytest.mark.parametrize("method", ["int4", "int8"])
def test_a_layer_quantized_at_load_keeps_no_dense_weight_and_adds_its_bias(method):
    torch.manual_seed(4)
    dense = nn.Linear(128, 48, bias=True)
    layer = ql.quantized_linear(method, dense, 32, None)
    assert not any(t is dense.weight for t in layer.parameters()) and not hasattr(layer, "dense")
    if method == "int4":        # the kernel's d = scale and m = zero - 8 scale, in float16
        codes, scale, zero = ql.int4_codes(dense.weight.detach(), 32)
        d, m = scale.half().float(), (zero - 8 * scale).half().float()
    else:
        codes, scale = ql.int8_codes(dense.weight.detach(), 32)
        d, m = scale.half().float(), torch.empty(0)
    x = torch.randn(5, 128)
    xq, dx = ql.quantize_activations(x, 32)
    x_hat = (xq.double().reshape(5, -1, 32) * dx.double()[..., None]).reshape(5, 128)
    want = x_hat @ dequantize_blocks(codes, d, m, 32).t() + dense.bias.detach().double()
    assert torch.allclose(layer(x).double(), want, atol=1e-5)


def test_quantizing_at_load_rounds_each_weight_to_its_nearest_code():
    torch.manual_seed(2)
    w = torch.randn(16, 64)
    codes, scale, zero = ql.int4_codes(w, 32)
    err = (dequantize_int4(codes, scale, zero, 32) - w).abs().reshape(16, 2, 32)
    assert (err <= scale[..., None] / 2 + 1e-6).all() and 0 <= codes.min() and codes.max() <= 15
    for group in (32, 64):
        codes, scale = ql.int8_codes(w, group)
        err = (codes.reshape(16, -1, group) * scale[..., None] - w.reshape(16, -1, group)).abs()
        assert (err <= scale[..., None] / 2 + 1e-6).all() and codes.abs().max() <= 127


def test_the_gguf_blocks_as_shipped_are_the_weights_the_converter_wrote(demo_model_dir):
    """The demo model's Q4_1 tensors, read as 4-bit codes and unpermuted, and its Q8_0 output matrix
    (tied to the embeddings), dequantize exactly to the float32 folder transformers wrote from the
    same file."""
    from safetensors import safe_open
    from nanopaged.models.config import ModelConfig
    from nanopaged.models.demo_model import find_gguf
    from nanopaged.models.gguf import load_gguf_linears
    found, dense = load_gguf_linears(find_gguf(demo_model_dir), ModelConfig.from_folder(demo_model_dir))
    assert len(found) == 30 * 4 + 1 and dense == []
    with safe_open(f"{demo_model_dir}/model.safetensors", "pt") as f:
        codes, scale = found["lm_head"]
        assert codes.shape == (49152, 576) and codes.min() >= -128 and codes.max() <= 127
        dequantized = (codes.float().reshape(49152, 18, 32) * scale[..., None]).reshape(49152, 576)
        assert torch.equal(dequantized, f.get_tensor("model.embed_tokens.weight"))
        for module, parts in (("self_attn.qkv_proj", ("q_proj", "k_proj", "v_proj")), ("self_attn.o_proj", ("o_proj",)),
                              ("mlp.gate_up_proj", ("gate_proj", "up_proj")), ("mlp.down_proj", ("down_proj",))):
            for layer in (0, 17, 29):
                codes, scale, zero = found[f"model.layers.{layer}.{module}"]
                owner = module.split(".")[0]
                written = torch.cat([f.get_tensor(f"model.layers.{layer}.{owner}.{p}.weight") for p in parts])
                assert torch.equal(dequantize_int4(codes, scale, zero, 32), written), (layer, module)


def test_the_demo_model_as_shipped_answers_as_its_dequantized_weights_do(demo_model_dir):
    """One request at a time every step runs the 4-bit kernel; its greedy tokens are close to the
    dequantized model's under vLLM's rule, in the same dtype and in float32."""
    prompts = make_prompts(2000, n=3, seed=7, min_len=8, max_len=30)
    shipped = LLM(demo_model_dir, dtype="bfloat16", quantization="gguf", max_num_seqs=1)
    stats = shipped.get_stats()["quantization"]
    assert stats["quantization"] == "gguf" and stats["quantized_linears"] == 120 + 1          # and the lm_head
    assert 85e6 < stats["quantized_bytes"] < 105e6      # layers 5 bits a weight and lm_head 8.5, scales included
    got = nanopaged_greedy(shipped, prompts, 16)
    dense = LLM(demo_model_dir, dtype="bfloat16", max_num_seqs=1)
    check_logprobs_close(got, nanopaged_greedy(dense, prompts, 16))
    del dense
    # and against the dequantized weights in float32, as issue 28 asks
    check_logprobs_close(got, nanopaged_greedy(LLM(demo_model_dir, dtype="float32", max_num_seqs=1), prompts, 16))


@pytest.mark.parametrize("method", ["int4", "int8"])
def test_quantizing_at_load_keeps_the_answers_close(tiny_model_dirs, method):
    prompts = make_prompts(512, n=4, seed=9, min_len=4, max_len=20)
    quantized = LLM(tiny_model_dirs["qwen2"], dtype="float32", quantization=method, max_num_seqs=1)
    assert quantized.get_stats()["quantization"]["quantized_linears"] == 2 * 4
    out = quantized.generate([{"prompt_token_ids": p} for p in prompts],
                             SamplingParams(temperature=0, max_tokens=8, ignore_eos=True), use_tqdm=False)
    assert all(len(o.outputs[0].token_ids) == 8 for o in out)


@pytest.mark.parametrize("kwargs, match", [
    ({"quantization": "awq"}, r"quantization must be one of \[None, 'gguf', 'int4', 'int8', 'w8a8'\], got 'awq'"),
    ({"quantization": "int4", "quantization_group_size": 48}, r"quantization_group_size must be one of \[32, 64"),
    ({"quantization": "int4", "quantization_group_size": 256}, r"quantization_group_size=256 must divide the "
                                                               r"model's hidden_size=64"),
    ({"quantization": "int4", "tensor_parallel_size": 2}, r"runs on CPU in one process"),
    ({"quantization": "gguf"}, r"quantization='gguf' needs the model's GGUF file: pass the .gguf file itself"),
])
def test_a_bad_quantization_is_refused_before_loading(tiny_model_dirs, kwargs, match):
    with pytest.raises(ValueError, match=match):        # the settings alone: no weight is read
        EngineConfig.from_kwargs(tiny_model_dirs["llama"], **kwargs)


def test_without_the_kernels_the_model_runs_dense(tiny_model_dirs, monkeypatch, caplog):
    """An AVX2-only host or another torch may lack the ops: a warning, and the dense weights."""
    monkeypatch.setattr(ql, "quantized_ops_available", lambda: False)
    logging.getLogger("nanopaged").addHandler(caplog.handler)      # nanopaged's log does not propagate
    try:
        llm = LLM(tiny_model_dirs["llama"], dtype="float32", quantization="int4")
    finally:
        logging.getLogger("nanopaged").removeHandler(caplog.handler)
    assert llm.get_stats()["quantization"]["quantized_linears"] == 0
    assert "no weight-only int4/int8 CPU kernels" in caplog.text
    reference = LLM(tiny_model_dirs["llama"], dtype="float32")
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    prompt = {"prompt_token_ids": [5, 6, 7, 8]}
    assert (llm.generate(prompt, params, use_tqdm=False)[0].outputs[0].token_ids
            == reference.generate(prompt, params, use_tqdm=False)[0].outputs[0].token_ids)
    assert math.isfinite(llm.get_stats()["kv_cache_usage"])


def write_q8_gguf(path, model_dir: str) -> None:
    """A GGUF file of a tiny model's decoder linears as llama.cpp's converter writes a "Q8_0" file:
    every linear in Q8_0 blocks, q_proj's and k_proj's rotary halves interleaved."""
    import gguf
    from gguf.quants import quantize
    from safetensors.torch import load_file
    from nanopaged.models.config import ModelConfig
    from nanopaged.models.gguf import GGUF_NAMES, unpermute_rows
    cfg, weights = ModelConfig.from_folder(model_dir), load_file(f"{model_dir}/model.safetensors")
    hf_names = {"self_attn.qkv_proj": ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"),
                "self_attn.o_proj": ("self_attn.o_proj",), "mlp.gate_up_proj": ("mlp.gate_proj", "mlp.up_proj"),
                "mlp.down_proj": ("mlp.down_proj",)}
    heads = {"attn_q": cfg.num_attention_heads, "attn_k": cfg.num_key_value_heads}
    writer = gguf.GGUFWriter(str(path), "llama")
    for i in range(cfg.num_hidden_layers):
        for module, parts in GGUF_NAMES.items():
            for part, hf in zip(parts, hf_names[module]):
                w = weights[f"model.layers.{i}.{hf}.weight"].float().numpy()
                if part in heads:                        # llama.cpp's order: the inverse of unpermute_rows
                    w = w[np.argsort(unpermute_rows(w.shape[0], heads[part]))]
                writer.add_tensor(f"blk.{i}.{part}.weight", quantize(w, gguf.GGMLQuantizationType.Q8_0),
                                  raw_dtype=gguf.GGMLQuantizationType.Q8_0)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])      # bfloat16: the fused C++ layers where they build
def test_a_q8_0_file_runs_its_layers_as_shipped(tiny_model_dirs, tmp_path, dtype):
    """quantization="gguf" on a file whose layers are Q8_0: each fused linear gets the file's 8-bit
    codes (unpermuted, exactly llama.cpp's dequantized values), and greedy answers stay close to
    the float weights'."""
    import shutil
    from gguf.quants import dequantize
    from gguf import GGMLQuantizationType, GGUFReader
    from nanopaged.models.config import ModelConfig
    from nanopaged.models.gguf import load_gguf_linears
    folder = tmp_path / "q8"
    shutil.copytree(tiny_model_dirs["llama"], folder)
    write_q8_gguf(folder / "model-Q8_0.gguf", str(folder))
    cfg = ModelConfig.from_folder(str(folder))
    found, dense = load_gguf_linears(str(folder / "model-Q8_0.gguf"), cfg)
    assert dense == [] and len(found) == 4 * cfg.num_hidden_layers
    shipped = {t.name: dequantize(t.data, GGMLQuantizationType.Q8_0) for t in GGUFReader(folder / "model-Q8_0.gguf").tensors}
    codes, scale = found["model.layers.1.mlp.gate_up_proj"]                  # no rows permuted
    assert codes.min() >= -128 and codes.max() <= 127
    values = (codes.float().reshape(codes.shape[0], -1, 32) * scale[..., None]).reshape(codes.shape)
    assert torch.equal(values, torch.from_numpy(np.concatenate([shipped["blk.1.ffn_gate.weight"],
                                                                shipped["blk.1.ffn_up.weight"]])))
    codes, scale = found["model.layers.0.self_attn.qkv_proj"]                # q and k unpermuted
    values = (codes.float().reshape(codes.shape[0], -1, 32) * scale[..., None]).reshape(codes.shape)
    from safetensors.torch import load_file
    written = load_file(f"{folder}/model.safetensors")
    float_qkv = torch.cat([written[f"model.layers.0.self_attn.{p}_proj.weight"].float() for p in "qkv"])
    assert (values - float_qkv).abs().max() <= float_qkv.abs().max() / 127      # one 8-bit step at most

    llm = LLM(str(folder), dtype=dtype, quantization="gguf", max_num_seqs=1)
    stats = llm.get_stats()["quantization"]
    if ql.nanopaged_kernels() is None:                      # Q8_0 layers need nanopaged's kernels
        assert stats["quantized_linears"] == 0 and len(stats["left_dense"]) == 4 * cfg.num_hidden_layers
        return
    assert stats["quantized_linears"] == 4 * cfg.num_hidden_layers and stats["left_dense"] == []
    assert all(isinstance(m, ql.Q8Linear) for m in llm.llm_engine.runner.model.modules()
               if isinstance(m, ql.QuantizedLinear))
    prompts = make_prompts(512, n=3, seed=5, min_len=4, max_len=20)
    check_logprobs_close(nanopaged_greedy(llm, prompts, 8),
                         nanopaged_greedy(LLM(str(folder), dtype=dtype, max_num_seqs=1), prompts, 8))


def test_without_nanopaged_kernels_q8_0_layers_stay_dense_and_say_so(tiny_model_dirs, tmp_path, monkeypatch):
    import shutil
    folder = tmp_path / "q8"
    shutil.copytree(tiny_model_dirs["llama"], folder)
    write_q8_gguf(folder / "model-Q8_0.gguf", str(folder))
    monkeypatch.setattr(ql, "nanopaged_kernels", lambda: None)           # an AVX2-only host
    stats = LLM(str(folder), dtype="float32", quantization="gguf").get_stats()["quantization"]
    assert stats["quantized_linears"] == 0
    assert "model.layers.0.self_attn.qkv_proj (Q8_0: nanopaged's kernels did not build with AVX512-VNNI here)" in stats["left_dense"]
