"""A hostile or broken adapter folder costs its request a ValueError, never the engine
(nanopaged/lora/adapter.py): adapter_config.json's fields checked for type and range, the files'
sizes and the safetensors header checked before a tensor is read, anything else reading raises
turned into the request's ValueError. docs/12_lora.md, "Limits"."""
import json
import shutil

import pytest
import safetensors.torch
import torch

from nanopaged.lora import adapter as adapter_module
from nanopaged.lora.adapter import load_adapter
from nanopaged.lora.request import LoRARequest
from nanopaged.models.config import ModelConfig


@pytest.fixture
def folder(tiny_adapters, tmp_path):
    """A copy of a good rank-8 adapter on the tiny Llama, to break."""
    return shutil.copytree(tiny_adapters["llama"]["attn"], tmp_path / "attn")


@pytest.fixture
def reads(monkeypatch):
    """The paths safetensors' load_file was asked to read, wherever the adapter reader looks it up."""
    seen = []

    def spy(path, *args, real=safetensors.torch.load_file, **kwargs):
        seen.append(path)
        return real(path, *args, **kwargs)
    monkeypatch.setattr(safetensors.torch, "load_file", spy)
    monkeypatch.setattr(adapter_module, "load_file", spy, raising=False)
    return seen


def read(folder, model_dir):
    return load_adapter(LoRARequest("bad", 1, str(folder)), ModelConfig.from_folder(model_dir), 16, torch.float32)


def rewrite_config(folder, **changes):
    config = json.loads((folder / "adapter_config.json").read_text())
    (folder / "adapter_config.json").write_text(json.dumps({**config, **changes}))


@pytest.mark.parametrize("text, named", [
    ("[1, 2, 3]", "must hold a JSON object, got a JSON list"),
    ('"r"', "must hold a JSON object, got a JSON str"),
    ("[" * 100_000 + "]" * 100_000, "adapter_config.json cannot be read"),
], ids=["list", "string", "deep"])
def test_a_config_that_is_no_json_object_is_a_value_error(folder, tiny_model_dirs, text, named):
    (folder / "adapter_config.json").write_text(text)
    with pytest.raises(ValueError, match=named):
        read(folder, tiny_model_dirs["llama"])


@pytest.mark.parametrize("changes, named", [
    ({"lora_alpha": "16"}, "lora_alpha must be a positive number, got '16'"),
    ({"lora_alpha": True}, "lora_alpha must be a positive number"),
    ({"lora_alpha": -2}, "lora_alpha must be a positive finite number"),
    ({"lora_alpha": 1e309}, "lora_alpha must be a positive finite number"),
    ({"r": 8.0}, "r must be a positive integer"),
    ({"r": True}, "r must be a positive integer"),
    ({"use_rslora": "yes"}, "use_rslora must be true or false"),
    ({"target_modules": 7}, "target_modules must be a module name or a list"),
    ({"peft_type": ["LORA"]}, "peft_type must be a string"),
    ({"bias": {"a": 1}}, "bias must be a string"),
    ({"use_dora": "no"}, "use_dora must be true or false"),
    ({"rank_pattern": [1]}, "rank_pattern must be an object"),
])
def test_each_config_field_is_checked_for_its_type_and_range_by_name(folder, tiny_model_dirs, changes, named):
    rewrite_config(folder, **changes)
    with pytest.raises(ValueError, match=named):
        read(folder, tiny_model_dirs["llama"])


def test_a_config_file_too_big_is_refused_before_it_is_read(folder, tiny_model_dirs):
    with open(folder / "adapter_config.json", "r+b") as f:
        f.truncate(adapter_module.MAX_CONFIG_BYTES + 1)   # sparse: nothing written, nothing to read
    with pytest.raises(ValueError, match=f"more than the {adapter_module.MAX_CONFIG_BYTES}"):
        read(folder, tiny_model_dirs["llama"])


def test_a_weights_file_bigger_than_its_rank_allows_is_refused_before_a_tensor_is_read(folder, tiny_model_dirs,
                                                                                      reads):
    most = adapter_module.max_weights_bytes(ModelConfig.from_folder(tiny_model_dirs["llama"]), 8)
    with open(folder / "adapter_model.safetensors", "r+b") as f:
        f.truncate(most + 1)
    with pytest.raises(ValueError, match=f"more than the {most} an adapter of its rank"):
        read(folder, tiny_model_dirs["llama"])
    assert reads == []


def test_a_header_with_the_wrong_shapes_is_refused_before_a_tensor_is_read(folder, tiny_model_dirs, reads):
    key = "base_model.model.model.layers.0.self_attn.q_proj.lora_{}.weight"
    safetensors.torch.save_file({key.format("A"): torch.zeros(8, 640), key.format("B"): torch.zeros(64, 8)},
                                folder / "adapter_model.safetensors")
    with pytest.raises(ValueError, match=r"q_proj has A \(8, 640\)"):
        read(folder, tiny_model_dirs["llama"])
    assert reads == []


@pytest.mark.parametrize("header", [b"[]", b"{\"x\": 5}", b"[" * 50_000 + b"]" * 50_000, b"\xff\xfe"],
                         ids=["list", "no-dtype", "deep", "not-utf8"])
def test_a_broken_safetensors_header_is_a_value_error(folder, tiny_model_dirs, header):
    (folder / "adapter_model.safetensors").write_bytes(len(header).to_bytes(8, "little") + header)
    with pytest.raises(ValueError, match="adapter_model.safetensors cannot be read"):
        read(folder, tiny_model_dirs["llama"])


def test_any_other_failure_while_reading_is_the_requests_value_error(folder, tiny_model_dirs, monkeypatch):
    def fail(*args, **kwargs):
        raise MemoryError("out of memory while reading")
    monkeypatch.setattr(safetensors.torch, "load_file", fail)
    monkeypatch.setattr(adapter_module, "load_file", fail, raising=False)
    with pytest.raises(ValueError, match="'bad' cannot be read: MemoryError"):
        read(folder, tiny_model_dirs["llama"])
