"""Bad input raises a ValueError that names the value and the limit, before any work,
and the engine keeps serving everything else."""
import json
import shutil

import pytest

from nanopaged import LLM, SamplingParams
from nanopaged.models.config import ModelConfig


@pytest.fixture(scope="module")
def llm(tiny_model_dirs):
    # 8 blocks of 16 tokens = 128 token slots; max_model_len 200 > 128 on purpose
    return LLM(tiny_model_dirs["llama"], max_model_len=200, num_kv_blocks=8)


GOOD = SamplingParams(temperature=0, max_tokens=4)


def assert_still_serving(llm):
    assert not llm.llm_engine.has_unfinished_requests()   # nothing half-queued
    out = llm.generate(["still here"], GOOD, use_tqdm=False)
    assert out[0].finished and len(out[0].outputs[0].token_ids) >= 1


@pytest.mark.parametrize("prompt, match", [
    ({"prompt_token_ids": [5] * 200}, r"200 tokens; max_model_len=200"),
    ({"prompt_token_ids": [5] * 250}, r"250 tokens; max_model_len=200.*at most 199"),
    ("", r"empty"),
    ({"prompt_token_ids": []}, r"empty"),
    ({"prompt_token_ids": [5, 512, 6]}, r"token id 512 is outside the vocabulary \[0, 512\)"),
    ({"prompt_token_ids": [5, -1]}, r"token id -1 is outside"),
    ({"prompt_token_ids": [5, "a"]}, r"list of integers"),
    (42, r"a prompt is a string"),
])
def test_bad_prompt_is_rejected_before_any_work(llm, prompt, match):
    with pytest.raises(ValueError, match=match):
        llm.generate(["a fine prompt", prompt], GOOD, use_tqdm=False)
    assert_still_serving(llm)


def test_request_larger_than_the_whole_kv_cache_is_rejected(llm):
    # 100 prompt + 50 max_tokens - 1 = 149 tokens -> 10 blocks > 8 in the pool
    with pytest.raises(ValueError, match=r"needs 10 KV blocks .* the whole cache has 8 blocks"):
        llm.generate({"prompt_token_ids": [5] * 100}, SamplingParams(max_tokens=50), use_tqdm=False)
    assert_still_serving(llm)


def test_engine_keeps_serving_queued_requests_after_a_rejected_one(llm):
    engine = llm.llm_engine
    engine.add_request("ok-1", "first", GOOD)
    with pytest.raises(ValueError):
        engine.add_request("bad", "", GOOD)
    with pytest.raises(ValueError, match="already in use"):
        engine.add_request("ok-1", "again", GOOD)
    engine.add_request("ok-2", "second", GOOD)
    done = set()
    while engine.has_unfinished_requests():
        done |= {o.request_id for o in engine.step() if o.finished}
    assert done == {"ok-1", "ok-2"}


@pytest.mark.parametrize("kwargs, match", [
    ({"temperature": -0.5}, r"temperature must be in \[0.0, inf\], got -0.5"),
    ({"max_tokens": 0}, r"max_tokens must be in \[1, inf\], got 0"),
    ({"max_tokens": -3}, r"max_tokens must be in \[1, inf\], got -3"),
    ({"max_tokens": 2.5}, r"max_tokens must be an integer, got 2.5"),
    ({"seed": "x"}, r"seed must be an integer"),
    ({"n": 0}, r"n must be in \[1, inf\], got 0"),
    ({"top_p": 0.0}, r"top_p must be in \(0.0, 1.0\], got 0.0"),
    ({"top_p": 1.5}, r"top_p must be in \(0.0, 1.0\]"),
    ({"top_k": -2}, r"top_k must be in \[-1, inf\], got -2"),
    ({"min_p": 2.0}, r"min_p must be in \[0.0, 1.0\]"),
    ({"presence_penalty": 3.0}, r"presence_penalty must be in \[-2.0, 2.0\]"),
    ({"frequency_penalty": -2.5}, r"frequency_penalty must be in \[-2.0, 2.0\]"),
    ({"repetition_penalty": 0.0}, r"repetition_penalty must be in \(0.0, inf\]"),
    ({"logprobs": 21}, r"logprobs must be in \[0, 20\], got 21"),
    ({"min_tokens": -1}, r"min_tokens must be in \[0, inf\]"),
    ({"min_tokens": 5, "max_tokens": 3}, r"min_tokens must be <= max_tokens=3, got 5"),
    ({"stop": ["ok", ""]}, r"stop must be a non-empty string"),
    ({"stop_token_ids": [-4]}, r"stop_token_ids\[i\] must be in \[0, inf\]"),
    ({"ignore_eos": "no"}, r"ignore_eos must be True or False"),
    ({"temperature": float("nan")}, r"temperature must be a number"),
])
def test_bad_sampling_values(kwargs, match):
    with pytest.raises(ValueError, match=match):
        SamplingParams(**kwargs)


def test_more_samples_than_max_num_seqs(tiny_model_dirs):
    llm = LLM(tiny_model_dirs["llama"], max_num_seqs=2, num_kv_blocks=16)
    with pytest.raises(ValueError, match=r"n=3 samples cannot run at once with max_num_seqs=2"):
        llm.generate("x", SamplingParams(n=3), use_tqdm=False)


def test_sampling_params_of_the_wrong_type(llm):
    with pytest.raises(ValueError, match="SamplingParams"):
        llm.generate("x", {"temperature": 0}, use_tqdm=False)


@pytest.mark.parametrize("kwargs, match", [
    ({"block_size": 0}, r"block_size must be in \[1, 1024\], got 0"),
    ({"block_size": 12}, r"block_size must be a power of two, got 12"),
    ({"dtype": "int8"}, r"dtype must be one of .* got 'int8'"),
    ({"device": "tpu"}, r"device must be one of"),
    ({"max_num_seqs": 0}, r"max_num_seqs must be in \[1, inf\], got 0"),
    ({"max_num_batched_tokens": 0}, r"max_num_batched_tokens must be in \[1, inf\], got 0"),
    ({"num_kv_blocks": 0}, r"num_kv_blocks must be in \[1, inf\], got 0"),
    ({"kv_cache_memory_bytes": -1}, r"kv_cache_memory_bytes must be in \[1, inf\], got -1"),
    ({"gpu_memory_utilization": 1.5}, r"gpu_memory_utilization must be in \(0, 1\]"),
    ({"attention_backend": "magic"}, r"attention_backend must be one of"),
    ({"enable_prefix_caching": "yes"}, r"enable_prefix_caching must be True or False"),
    ({"max_model_len": 10_000}, r"max_model_len=10000 is larger than the model's max_position_embeddings=512"),
    ({"max_model_len": "long"}, r"max_model_len must be an integer"),
    ({"kv_cache_memory_bytes": 100}, r"budget of 100 bytes holds no block"),
    ({"no_such_setting": 1}, r"unknown engine setting\(s\) \['no_such_setting'\]"),
])
def test_bad_engine_settings(tiny_model_dirs, kwargs, match):
    with pytest.raises(ValueError, match=match):
        LLM(tiny_model_dirs["llama"], **kwargs)


def test_missing_model_folder(tmp_path):
    with pytest.raises(ValueError, match="does not exist"):
        LLM(str(tmp_path / "nope"))


def test_model_folder_without_config_or_weights(tiny_model_dirs, tmp_path):
    folder = tmp_path / "m"
    shutil.copytree(tiny_model_dirs["llama"], folder)
    (folder / "model.safetensors").unlink()
    with pytest.raises(ValueError, match=r"no \*.safetensors weights"):
        LLM(str(folder))
    (folder / "config.json").unlink()
    with pytest.raises(ValueError, match="has no config.json"):
        LLM(str(folder))


def _config(tiny_model_dirs, **changes):
    cfg = json.loads(open(f"{tiny_model_dirs['llama']}/config.json").read())
    cfg.update(changes)
    return cfg


def test_unsupported_architecture_is_named(tiny_model_dirs):
    with pytest.raises(ValueError, match=r"unsupported model architecture 'GPT2LMHeadModel'"):
        ModelConfig.from_dict(_config(tiny_model_dirs, architectures=["GPT2LMHeadModel"]))


def test_unsupported_rope_scaling_is_named(tiny_model_dirs):
    cfg = _config(tiny_model_dirs, rope_parameters={"rope_type": "yarn", "factor": 4.0, "rope_theta": 1e4})
    with pytest.raises(ValueError, match=r"unsupported rope scaling type 'yarn'"):
        ModelConfig.from_dict(cfg)


def test_checkpoint_with_a_missing_tensor_is_named(tiny_model_dirs, tmp_path):
    from safetensors.torch import load_file, save_file
    folder = tmp_path / "m"
    shutil.copytree(tiny_model_dirs["llama"], folder)
    weights = load_file(folder / "model.safetensors")
    del weights["model.layers.1.self_attn.v_proj.weight"]
    save_file(weights, folder / "model.safetensors")
    with pytest.raises(ValueError, match=r"missing .*layers.1.self_attn.qkv_proj.weight\[shard 2\]"):
        LLM(str(folder))
