"""W8A8 (quantization="w8a8"): weights in 8 bits with one scale per output feature, each row quantized
to 8 bits per token at run time, one integer sum over the whole row; the hidden states rotated first
(nanopaged/cpu/rotation.py) so a row's few large features do not set its scale. The kernel equals the
torch reference bit for bit at every row count, the rotation leaves the model's answers as they were,
and on the demo model the perplexity stays within 1% of bfloat16's."""
import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file
from torch import nn

import nanopaged.cpu.quantized_linear as ql
from conftest import make_prompts, nanopaged_greedy
from nanopaged import LLM, EngineConfig, SamplingParams
from nanopaged.cpu.rotation import orthogonal, rotate_hidden_states

needs_vnni = pytest.mark.skipif(ql.nanopaged_kernels() is None,
                                reason="nanopaged's quantized kernels run where they were built with AVX512-VNNI")


def codes_t(dense: nn.Linear) -> torch.Tensor:
    return ql.int8_codes(dense.weight.detach(), dense.in_features)[0].to(torch.int8).t().contiguous()


@needs_vnni
@pytest.mark.parametrize("in_features, out_features", [(576, 960), (1536, 576), (64, 100), (48, 17)])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_the_kernel_equals_the_integer_reference_bit_for_bit_at_every_row_count(in_features, out_features, dtype):
    """One integer sum per row and feature, times d dx once: nanopaged's kernel and torch's _int_mm give the
    same bits, for the first m rows of 300 at every m from 1 to 300 (the integer sum has no order to change)."""
    torch.manual_seed(in_features + out_features)
    dense = nn.Linear(in_features, out_features, bias=False, dtype=dtype)
    layer = ql.W8A8Linear(dense)
    x = torch.randn(300, in_features).to(dtype) * torch.logspace(-2, 1, in_features).to(dtype)
    full = layer(x)
    assert torch.equal(full, ql.w8a8_reference(x, codes_t(dense), layer.scale))
    for rows in range(1, 301):
        assert torch.equal(layer(x[:rows]), full[:rows]), rows
    assert torch.equal(layer(x[137:138])[0], full[137])


@needs_vnni
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_the_amx_and_vnni_kernels_give_the_same_bits(monkeypatch, dtype):
    """AMX's int8 tiles and VPDPBUSD sum the same integers: the same outputs, bit for bit."""
    ops = ql.nanopaged_kernels()
    if not ops.has_amx_int8:
        pytest.skip("nanopaged's kernels were built without AMX-INT8 here (no amx_int8, amx_tile)")
    torch.manual_seed(8)
    dense = nn.Linear(576, 1000, bias=True, dtype=dtype)
    on_amx = ql.W8A8Linear(dense)

    class WithoutAmx:
        has_amx_int8 = False

        def __getattr__(self, name):
            return getattr(ops, name)
    monkeypatch.setattr(ql, "nanopaged_kernels", lambda: WithoutAmx())
    on_vnni = ql.W8A8Linear(dense)
    assert on_amx.amx and not on_vnni.amx
    x = torch.randn(70, 576).to(dtype)
    assert torch.equal(on_amx(x), on_vnni(x))


def test_the_reference_multiplies_the_quantized_row_by_the_quantized_weight():
    """w8a8_reference against float64: x^ = xq dx (one scale per row), w^ = q d (one per output feature)."""
    torch.manual_seed(3)
    dense = nn.Linear(256, 40, bias=False)
    layer = ql.W8A8Linear(dense)
    x = torch.randn(7, 256)
    xq, dx = ql.quantize_activations(x, 256)
    codes, _ = ql.int8_codes(dense.weight.detach(), 256)
    want = (xq.double() * dx.double()) @ (codes.double() * layer.scale.double()[:, None]).t()
    got = ql.w8a8_reference(x, codes_t(dense), layer.scale).double()
    assert torch.allclose(got, want, rtol=1e-6, atol=1e-6 * want.abs().max().item())
    assert dx.shape == (7, 1)                                  # one scale per token


def test_without_vnni_the_layer_runs_torchs_integer_matmul(monkeypatch):
    monkeypatch.setattr(ql, "nanopaged_kernels", lambda: None)
    torch.manual_seed(5)
    dense = nn.Linear(128, 32, bias=True, dtype=torch.bfloat16)
    layer = ql.quantized_linear("w8a8", dense, 32, None)
    x = torch.randn(9, 128).bfloat16()
    assert layer.ops is None and layer.codes_t.dtype == torch.int8
    assert torch.equal(layer(x), ql.w8a8_reference(x, codes_t(dense), layer.scale) + dense.bias.detach())


@pytest.mark.parametrize("n", [576, 64, 96, 7])
def test_the_rotation_is_orthogonal_and_spreads_a_large_feature(n):
    q = orthogonal(n)
    assert torch.allclose(q @ q.t(), torch.eye(n, dtype=torch.float64), atol=1e-12)
    spike = torch.zeros(n, dtype=torch.float64)
    spike[n // 3] = 1.0
    # one large feature becomes many small ones: the row's largest |x| falls from 1 to at most 1/sqrt(n / odd part)
    assert (spike @ q).abs().max() <= (n & -n) ** -0.5 + 1e-12 or n & -n == 1


@pytest.mark.parametrize("name", ["llama", "qwen2", "qwen3"])
def test_the_rotated_model_answers_as_the_model_did(tiny_model_dirs, name):
    """Rotation alone (no quantization): float32 greedy tokens and logprobs equal the unrotated model's up
    to float32 rounding, tied embeddings (llama) and q/k norms (qwen3) included."""
    prompts = make_prompts(512, n=4, seed=11, min_len=4, max_len=30)
    plain = LLM(tiny_model_dirs[name], dtype="float32", max_num_seqs=4)
    want = nanopaged_greedy(plain, prompts, 12)
    rotated = LLM(tiny_model_dirs[name], dtype="float32", max_num_seqs=4)
    rotate_hidden_states(rotated.llm_engine.runner.model)
    got = nanopaged_greedy(rotated, prompts, 12)
    assert [g[0] for g in got] == [w[0] for w in want]
    for (_, g_lp), (_, w_lp) in zip(got, want):
        for a, b in zip(g_lp, w_lp):
            top = max(b, key=b.get)
            assert abs(a[top] - b[top]) < 1e-3


@pytest.mark.parametrize("kwargs, match", [
    ({"runner": "pooling"}, "runner='pooling' hands out hidden states"),
    ({"enable_lora": True}, "LoRA adapters were trained on the unrotated weights"),
])
def test_what_the_rotation_would_change_is_refused_before_loading(tiny_model_dirs, kwargs, match):
    with pytest.raises(ValueError, match=f"quantization='w8a8' rotates the model's hidden states.*{match}"):
        LLM(tiny_model_dirs["llama"], quantization="w8a8", **kwargs)


SCHEME = {"quant_method": "compressed-tensors", "format": "int-quantized", "ignore": ["lm_head"],
          "config_groups": {"group_0": {"targets": ["Linear"],
                                        "weights": {"num_bits": 8, "type": "int", "symmetric": True,
                                                    "strategy": "channel", "dynamic": False},
                                        "input_activations": {"num_bits": 8, "type": "int", "symmetric": True,
                                                              "strategy": "token", "dynamic": True}}}}
LAYER_WEIGHTS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def shipped_checkpoint(src: str, dst, scheme: dict = SCHEME) -> dict:
    """The tiny model as llm-compressor writes int8 W8A8: each decoder linear's weight as int8 codes (absmax
    per output row) and a float32 weight_scale, the scheme in config.json; returns the codes and scales."""
    dst.mkdir()
    for f in Path(src).iterdir():
        if f.suffix != ".safetensors":
            shutil.copy(f, dst / f.name)
    config = json.loads((dst / "config.json").read_text())
    (dst / "config.json").write_text(json.dumps({**config, "quantization_config": scheme}))
    tensors, shipped = {}, {}
    for name, w in load_file(Path(src) / "model.safetensors").items():
        if name.endswith(".weight") and name.split(".")[-2] in LAYER_WEIGHTS:
            codes, scale = ql.int8_codes(w, w.shape[1])
            tensors[name], tensors[name + "_scale"] = codes.to(torch.int8), scale.float()
            shipped[name] = (codes.to(torch.int8), scale.reshape(-1))
        else:
            tensors[name] = w
    save_file(tensors, str(dst / "model.safetensors"))
    return shipped


def test_a_shipped_int8_checkpoint_runs_its_own_codes(tiny_model_dirs, tmp_path):
    """compressed-tensors' int8 W8A8, as vLLM loads it: quantization "w8a8" from config.json, each layer the
    codes and scales as they ship (the scales in float16, as every W8A8 layer keeps them), no rotation."""
    shipped = shipped_checkpoint(tiny_model_dirs["llama"], tmp_path / "w8a8")
    llm = LLM(str(tmp_path / "w8a8"), dtype="bfloat16")
    assert llm.get_stats()["quantization"]["quantization"] == "w8a8"
    model = llm.llm_engine.runner.model
    assert not torch.equal(model.model.norm.weight, torch.ones_like(model.model.norm.weight))   # not rotated
    layer = model.model.layers[1].self_attn.o_proj
    codes, scale = shipped["model.layers.1.self_attn.o_proj.weight"]
    x = torch.randn(5, layer.in_features).bfloat16()
    assert torch.equal(layer(x), ql.w8a8_reference(x, codes.t().contiguous(), scale.half().float()))
    out = llm.generate({"prompt_token_ids": [5, 6, 7, 8]}, SamplingParams(max_tokens=6, ignore_eos=True), use_tqdm=False)
    assert len(out[0].outputs[0].token_ids) == 6
    with pytest.raises(ValueError, match="quantization must be None or 'w8a8', got 'int4'"):
        EngineConfig(str(tmp_path / "w8a8"), quantization="int4")


def test_scales_without_the_scheme_or_the_scheme_without_scales_are_refused(tiny_model_dirs, tmp_path):
    shipped_checkpoint(tiny_model_dirs["llama"], tmp_path / "bare")
    config = json.loads((tmp_path / "bare" / "config.json").read_text())
    del config["quantization_config"]
    (tmp_path / "bare" / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match="holds int8 weight scales .* declares no int8 W8A8 quantization_config"):
        LLM(str(tmp_path / "bare"))
    shipped_checkpoint(tiny_model_dirs["llama"], tmp_path / "unscaled")
    tensors = load_file(tmp_path / "unscaled" / "model.safetensors")
    del tensors["model.layers.1.mlp.down_proj.weight_scale"]
    save_file(tensors, str(tmp_path / "unscaled" / "model.safetensors"))
    with pytest.raises(ValueError, match="ships int8 W8A8, but model.layers.1.mlp.down_proj has no weight_scale"):
        LLM(str(tmp_path / "unscaled"))


@pytest.mark.parametrize("change, match", [
    ({"format": "float-quantized"}, "format 'float-quantized'"),
    ({"config_groups": {"g": {**SCHEME["config_groups"]["group_0"], "weights": {
        "num_bits": 4, "type": "int", "symmetric": True, "strategy": "group"}}}}, "nanopaged loads compressed-tensors' int8"),
    ({"config_groups": {"g": {**SCHEME["config_groups"]["group_0"], "input_activations": {
        "num_bits": 8, "type": "int", "symmetric": True, "strategy": "tensor", "dynamic": False}}}}, "input activations"),
    ({"quant_method": "awq"}, "quantization_config 'awq'"),
])
def test_any_other_shipped_quantization_is_refused_by_name(tiny_model_dirs, tmp_path, change, match):
    shipped_checkpoint(tiny_model_dirs["llama"], tmp_path / "other", {**SCHEME, **change})
    with pytest.raises(ValueError, match=match):
        EngineConfig(str(tmp_path / "other"))


@needs_vnni
@pytest.mark.slow
def test_the_demo_models_perplexity_stays_within_1_percent_of_bfloat16(demo_model_dir):
    """The bench's text (benchmarks/data), the issue's gate: W8A8 within 1% of bfloat16's perplexity."""
    from benchmarks.quality import perplexity, text_ids
    dense = LLM(demo_model_dir, dtype="bfloat16", enable_prefix_caching=False)
    ids = text_ids(dense.get_tokenizer())
    want = perplexity(dense, ids)
    del dense
    w8a8 = LLM(demo_model_dir, dtype="bfloat16", quantization="w8a8", enable_prefix_caching=False)
    assert w8a8.get_stats()["quantization"]["quantized_linears"] == 30 * 4
    assert perplexity(w8a8, ids) / want - 1 < 0.01
