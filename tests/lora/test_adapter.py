"""Reading PEFT adapter folders (nanopaged/lora/adapter.py): adapters made here with `peft` on the tiny
models, read back as the A, B and scaling peft applies; every form nanopaged cannot apply refused by a
ValueError that names it; LoRARequest's fields checked as vLLM's."""
import json
import math

import pytest
import torch
from safetensors.torch import save_file

from nanopaged.lora.adapter import load_adapter
from nanopaged.lora.request import LoRARequest
from nanopaged.models.config import ModelConfig

peft = pytest.importorskip("peft")     # a test dependency ([test] in pyproject.toml)


def make_adapter(model_dir, folder, **lora):
    """A peft LoRA adapter on the model, its B random (peft starts B at zero), saved as peft saves it."""
    from transformers import AutoModelForCausalLM
    base = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    config = peft.LoraConfig(**{"r": 8, "lora_alpha": 16, "target_modules": ["q_proj", "v_proj", "down_proj"],
                                "init_lora_weights": False, **lora})
    model = peft.get_peft_model(base, config)
    model.save_pretrained(folder)
    return model


def read(folder, model_dir, max_rank=16, dtype=torch.float32):
    return load_adapter(LoRARequest("a", 1, str(folder)), ModelConfig.from_folder(model_dir), max_rank, dtype)


@pytest.mark.parametrize("name", ["llama", "qwen3"])
@pytest.mark.parametrize("rslora", [False, True])
def test_an_adapter_reads_back_as_peft_applies_it(tiny_model_dirs, tmp_path, name, rslora):
    model = make_adapter(tiny_model_dirs[name], tmp_path, use_rslora=rslora)
    got = read(tmp_path, tiny_model_dirs[name])
    assert got.rank == 8 and got.scaling == pytest.approx(16 / math.sqrt(8) if rslora else 2.0)
    layers = ModelConfig.from_folder(tiny_model_dirs[name]).num_hidden_layers
    assert set(got.weights) == {(i, p) for i in range(layers) for p in ("q_proj", "v_proj", "down_proj")}
    for (i, proj), (a, b) in got.weights.items():
        part = "self_attn" if proj != "down_proj" else "mlp"
        module = model.base_model.model.model.layers[i].get_submodule(f"{part}.{proj}")
        assert torch.equal(a, module.lora_A["default"].weight) and torch.equal(b, module.lora_B["default"].weight)
        assert module.scaling["default"] == pytest.approx(got.scaling)
        x = torch.randn(3, a.shape[1])        # the update peft adds to the base layer's output
        want = module(x) - module.base_layer(x)
        torch.testing.assert_close(x @ a.T @ b.T * got.scaling, want, rtol=1e-5, atol=1e-5)


def test_the_weights_come_in_the_models_dtype(tiny_model_dirs, tmp_path):
    make_adapter(tiny_model_dirs["llama"], tmp_path)
    got = read(tmp_path, tiny_model_dirs["llama"], dtype=torch.bfloat16)
    assert all(a.dtype == b.dtype == torch.bfloat16 for a, b in got.weights.values())


@pytest.mark.parametrize("lora, named", [
    ({"use_dora": True}, "DoRA"),
    ({"modules_to_save": ["lm_head"]}, "modules_to_save"),
    ({"target_modules": ["embed_tokens", "q_proj"]}, "embed_tokens"),
    ({"target_modules": ["lm_head"]}, "lm_head"),
    ({"r": 32}, "max_lora_rank=16"),
    ({"bias": "lora_only"}, "bias"),
    ({"rank_pattern": {"q_proj": 4}}, "rank_pattern"),
])
def test_what_nanopaged_cannot_apply_is_refused_by_name(tiny_model_dirs, tmp_path, lora, named):
    make_adapter(tiny_model_dirs["llama"], tmp_path, **lora)
    with pytest.raises(ValueError, match=named):
        read(tmp_path, tiny_model_dirs["llama"])


def test_an_adapter_made_for_another_shape_is_refused_with_both_shapes(tiny_model_dirs, tmp_path):
    make_adapter(tiny_model_dirs["qwen3"], tmp_path)              # head_dim 32: q_proj is 64 -> 128
    with pytest.raises(ValueError, match=r"q_proj has A \(8, 64\) and B \(128, 8\); this model needs"):
        read(tmp_path, tiny_model_dirs["llama"])


def test_a_missing_or_broken_folder_is_a_clear_error(tiny_model_dirs, tmp_path):
    with pytest.raises(ValueError, match="no adapter_config.json"):
        read(tmp_path / "gone", tiny_model_dirs["llama"])
    make_adapter(tiny_model_dirs["llama"], tmp_path)
    (tmp_path / "adapter_model.safetensors").write_bytes(b"not a safetensors file")
    with pytest.raises(ValueError, match="adapter_model.safetensors cannot be read"):
        read(tmp_path, tiny_model_dirs["llama"])
    (tmp_path / "adapter_model.safetensors").unlink()
    torch.save({}, tmp_path / "adapter_model.bin")
    with pytest.raises(ValueError, match=r"found: adapter_model.bin; nanopaged reads safetensors only"):
        read(tmp_path, tiny_model_dirs["llama"])
    (tmp_path / "adapter_config.json").write_text("{")
    with pytest.raises(ValueError, match="adapter_config.json cannot be read"):
        read(tmp_path, tiny_model_dirs["llama"])


def test_an_unpaired_or_integer_tensor_is_refused(tiny_model_dirs, tmp_path):
    make_adapter(tiny_model_dirs["llama"], tmp_path)
    key = "base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight"
    save_file({key: torch.zeros(8, 64)}, tmp_path / "adapter_model.safetensors")
    with pytest.raises(ValueError, match="q_proj has lora_A without its pair"):
        read(tmp_path, tiny_model_dirs["llama"])
    save_file({key: torch.zeros(8, 64, dtype=torch.int32)}, tmp_path / "adapter_model.safetensors")
    with pytest.raises(ValueError, match="not a floating-point tensor"):
        read(tmp_path, tiny_model_dirs["llama"])
    config = json.loads((tmp_path / "adapter_config.json").read_text())
    (tmp_path / "adapter_config.json").write_text(json.dumps({**config, "peft_type": "IA3"}))
    with pytest.raises(ValueError, match="IA3 adapter"):
        read(tmp_path, tiny_model_dirs["llama"])


@pytest.mark.parametrize("fields, named", [(("", 1, "/x"), "lora_name"), (("a", 0, "/x"), "lora_int_id"),
                                           (("a", True, "/x"), "lora_int_id"), (("a", 1, ""), "lora_path")])
def test_a_lora_request_checks_its_fields(fields, named):
    with pytest.raises(ValueError, match=named):
        LoRARequest(*fields)
    assert LoRARequest("sql", 3, "/adapters/sql").lora_int_id == 3
