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
    with pytest.raises(ValueError, match="the prompt is empty"):
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
    ({"max_tokens": 0}, r"max_tokens must be in \[1, 9223372036854775807\], got 0"),
    ({"max_tokens": -3}, r"max_tokens must be in \[1, 9223372036854775807\], got -3"),
    ({"max_tokens": 2**63}, r"max_tokens must be in \[1, 9223372036854775807\], got 9223372036854775808"),
    ({"max_tokens": 2.5}, r"max_tokens must be an integer, got 2.5"),
    ({"seed": "x"}, r"seed must be an integer"),
    ({"n": 0}, r"n must be in \[1, 1024\], got 0"),
    ({"n": 10**30}, r"n must be in \[1, 1024\], got 1000000000000000000000000000000"),
    ({"top_p": 0.0}, r"top_p must be in \(0.0, 1.0\], got 0.0"),
    ({"top_p": 1.5}, r"top_p must be in \(0.0, 1.0\]"),
    ({"top_k": -2}, r"top_k must be in \[-1, 9223372036854775807\], got -2"),
    ({"min_p": 2.0}, r"min_p must be in \[0.0, 1.0\]"),
    ({"presence_penalty": 3.0}, r"presence_penalty must be in \[-2.0, 2.0\]"),
    ({"frequency_penalty": -2.5}, r"frequency_penalty must be in \[-2.0, 2.0\]"),
    ({"repetition_penalty": 0.0}, r"repetition_penalty must be in \(0.0, inf\]"),
    ({"logprobs": 21}, r"logprobs must be in \[0, 20\], got 21"),
    ({"min_tokens": -1}, r"min_tokens must be in \[0, 9223372036854775807\]"),
    ({"min_tokens": 10**30}, r"min_tokens must be in \[0, 9223372036854775807\]"),
    ({"min_tokens": 5, "max_tokens": 3}, r"min_tokens must be <= max_tokens=3, got 5"),
    ({"stop": ["ok", ""]}, r"stop must be a non-empty string"),
    ({"stop_token_ids": [-4]}, r"stop_token_ids\[i\] must be in \[0, inf\]"),
    ({"ignore_eos": "no"}, r"ignore_eos must be True or False"),
    ({"temperature": float("nan")}, r"temperature must be a finite number, got nan"),
    ({"temperature": float("inf")}, r"temperature must be a finite number, got inf"),
    ({"repetition_penalty": float("inf")}, r"repetition_penalty must be a finite number, got inf"),
    ({"top_p": float("nan")}, r"top_p must be a finite number"),
    ({"seed": 2**64}, r"seed must be in \[-9223372036854775808, 18446744073709551615\], got 18446744073709551616"),
    ({"seed": -2**63 - 1}, r"seed must be in \[-9223372036854775808"),
    ({"seed": 2**64 - 1, "n": 2}, r"seed \+ n - 1 must be in \[-9223372036854775808, 18446744073709551615\]"),
    ({"top_k": 2**63}, r"top_k must be in \[-1, 9223372036854775807\], got 9223372036854775808"),
    ({"stop": 5}, r"stop must be a string or a list of strings, got 5"),
    ({"stop_token_ids": 5}, r"stop_token_ids must be a list of token ids, got 5"),
    ({"stop_token_ids": ["a"]}, r"stop_token_ids\[i\] must be an integer, got 'a'"),
    ({"prompt_logprobs": 21}, r"prompt_logprobs must be in \[0, 20\], got 21"),
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


# ---- values that pass SamplingParams but only the model can judge --------------------------
def test_stop_token_ids_outside_the_vocabulary(llm):
    with pytest.raises(ValueError, match=r"stop_token_ids holds 512, outside the vocabulary \[0, 512\)"):
        llm.generate("x", SamplingParams(stop_token_ids=[3, 512], min_tokens=1), use_tqdm=False)
    assert_still_serving(llm)


@pytest.mark.parametrize("prompt, match", [
    ({"prompt_token_ids": [5, 6], "cache_salt": "tenant-\udc80"}, r"cache_salt must encode as UTF-8"),
    ("half a surrogate \ud800", r"the prompt must encode as UTF-8"),
])
def test_text_that_is_not_utf8(llm, prompt, match):
    with pytest.raises(ValueError, match=match):
        llm.generate(prompt, GOOD, use_tqdm=False)
    assert_still_serving(llm)


def test_a_tiny_temperature_is_raised_to_001_as_vllm_does(llm):
    with pytest.warns(UserWarning, match=r"temperature 1e-06 is below 0.01"):
        params = SamplingParams(temperature=1e-6, max_tokens=8, seed=0, ignore_eos=True)
    assert params.temperature == 0.01
    out = llm.generate({"prompt_token_ids": [5, 6, 7]}, params, use_tqdm=False)[0].outputs[0]
    greedy = llm.generate({"prompt_token_ids": [5, 6, 7]}, SamplingParams(temperature=0, max_tokens=8, ignore_eos=True),
                          use_tqdm=False)[0].outputs[0]
    assert out.token_ids == greedy.token_ids      # at T = 0.01 sampling is all but greedy: no NaN, no token 0


def test_a_huge_top_k_keeps_every_token(llm):
    params = SamplingParams(temperature=1.0, top_k=2**62, seed=3, max_tokens=8, ignore_eos=True)
    alone = llm.generate({"prompt_token_ids": [5, 6, 7]}, params, use_tqdm=False)[0].outputs[0].token_ids
    no_k = SamplingParams(temperature=1.0, seed=3, max_tokens=8, ignore_eos=True)
    assert alone == llm.generate({"prompt_token_ids": [5, 6, 7]}, no_k, use_tqdm=False)[0].outputs[0].token_ids


@pytest.mark.parametrize("prompts, params, match", [
    (None, GOOD, r"prompts must be a prompt or a list of them, got NoneType"),
    (5, GOOD, r"prompts must be a prompt or a list of them, got int"),
    (["x"], 5, r"sampling_params must be a SamplingParams or a list of them, got int"),
    (["x"], [GOOD, "not params"], r"got 2 SamplingParams for 1 prompts"),
    (["x", "y"], [GOOD, "not params"], r"sampling params must be a SamplingParams, got str"),
])
def test_arguments_of_the_wrong_type(llm, prompts, params, match):
    with pytest.raises(ValueError, match=match):
        llm.generate(prompts, params, use_tqdm=False)
    assert_still_serving(llm)


@pytest.mark.parametrize("messages, match", [
    ([{"role": "user"}], r"a chat message is a dict with 'role' and 'content'"),
    ([{"content": "hi"}], r"a chat message is a dict with 'role' and 'content'"),
    ([{"role": "user", "content": None}], r"content must be a string or a list of text parts, got None"),
    ([{"role": "wizard", "content": "hi"}], r"role must be one of \['system', 'user', 'assistant', 'tool', 'developer'\], got 'wizard'"),
    ([{"role": "user", "content": [{"type": "audio", "audio": "x"}]}], r"only text parts"),
    ([{"role": "user", "content": [{"type": "image_url", "image_url": "x"}]}],
     r"messages\[0\]\.content\[0\]\.image_url must be an object"),
    (["hi"], r"a conversation is a non-empty list of messages, got 'hi'"),
    ([["hi"]], r"a chat message is a dict with 'role' and 'content', got 'hi'"),
    ([[]], r"a conversation is a non-empty list of messages"),
    (None, r"messages must be a conversation or a list of them, got NoneType"),
])
def test_malformed_chat_messages(llm, messages, match):
    with pytest.raises(ValueError, match=match):
        llm.chat(messages, GOOD, use_tqdm=False)
    assert_still_serving(llm)


def test_chat_content_as_a_list_of_text_parts(llm):
    as_parts = [{"role": "user", "content": [{"type": "text", "text": "one"}, {"type": "text", "text": "two"}]}]
    as_text = [{"role": "user", "content": "one\ntwo"}]
    a = llm.chat(as_parts, GOOD, use_tqdm=False)[0]
    b = llm.chat(as_text, GOOD, use_tqdm=False)[0]
    assert a.prompt == b.prompt and a.outputs[0].token_ids == b.outputs[0].token_ids


# ---- beam search ------------------------------------------------------------------------------
def test_beam_search_past_the_context_is_clipped_as_generate_does(tiny_model_dirs):
    from nanopaged import BeamSearchParams
    llm = LLM(tiny_model_dirs["llama"], max_model_len=24, num_kv_blocks=16)
    out = llm.beam_search({"prompt_token_ids": list(range(3, 23))}, BeamSearchParams(beam_width=2, max_tokens=50))[0]
    assert all(len(s.tokens) <= 24 for s in out.sequences)        # 20 prompt + at most 4 generated
    assert max(len(s.tokens) for s in out.sequences) == 24
    assert llm.get_stats()["kv_cache_usage"] == 0.0


@pytest.mark.parametrize("kwargs, match", [
    ({"beam_width": 300, "max_tokens": 4}, r"2 x beam_width=600 is larger than the vocabulary \(512\)"),
    ({"beam_width": 2, "max_tokens": 4, "length_penalty": float("inf")}, r"length_penalty must be a finite number"),
    ({"beam_width": 2, "max_tokens": 4, "length_penalty": float("nan")}, r"length_penalty must be a finite number"),
])
def test_beam_search_values_the_search_cannot_use(tiny_model_dirs, kwargs, match):
    from nanopaged import BeamSearchParams
    llm = LLM(tiny_model_dirs["llama"], num_kv_blocks=32, max_num_seqs=512)
    with pytest.raises(ValueError, match=match):
        llm.beam_search("x", BeamSearchParams(**kwargs))
    assert not llm.llm_engine.has_unfinished_requests()


# ---- loading: every broken file is named --------------------------------------------------
def broken_copy(tiny_model_dirs, tmp_path):
    folder = tmp_path / "m"
    shutil.copytree(tiny_model_dirs["llama"], folder)
    return folder


def test_truncated_weights_are_named(tiny_model_dirs, tmp_path):
    folder = broken_copy(tiny_model_dirs, tmp_path)
    data = (folder / "model.safetensors").read_bytes()
    (folder / "model.safetensors").write_bytes(data[:len(data) // 2])
    with pytest.raises(ValueError, match=r"model.safetensors is not a readable safetensors file"):
        LLM(str(folder))


def test_weights_that_are_not_safetensors_are_named(tiny_model_dirs, tmp_path):
    folder = broken_copy(tiny_model_dirs, tmp_path)
    (folder / "model.safetensors").write_bytes(b"this is not a tensor file at all")
    with pytest.raises(ValueError, match=r"model.safetensors is not a readable safetensors file"):
        LLM(str(folder))


@pytest.mark.parametrize("name", ["config.json", "generation_config.json"])
def test_json_that_does_not_parse_is_named(tiny_model_dirs, tmp_path, name):
    folder = broken_copy(tiny_model_dirs, tmp_path)
    (folder / name).write_text("{ not json")
    with pytest.raises(ValueError, match=rf"{name} is not a readable JSON file"):
        LLM(str(folder))


def test_a_broken_tokenizer_file_is_named(tiny_model_dirs, tmp_path):
    folder = broken_copy(tiny_model_dirs, tmp_path)
    (folder / "tokenizer.json").write_text("{ not json")
    with pytest.raises(ValueError, match=r"cannot load the tokenizer in .*m'"):
        LLM(str(folder))


def test_a_folder_without_a_tokenizer_says_so(tiny_model_dirs, tmp_path):
    folder = broken_copy(tiny_model_dirs, tmp_path)
    for f in folder.glob("tokenizer*"):
        f.unlink()
    with pytest.raises(ValueError, match=r"has no tokenizer"):
        LLM(str(folder))


@pytest.mark.parametrize("changes, match", [
    ({"hidden_size": None}, r"config.json: field 'hidden_size' must be a positive integer, got None"),
    ({"num_attention_heads": 0}, r"field 'num_attention_heads' must be a positive integer, got 0"),
    ({"num_key_value_heads": 3}, r"field 'num_key_value_heads' must divide num_attention_heads=4, got 3"),
    ({"architectures": "LlamaForCausalLM"}, r"'architectures' must be a list of class names"),
])
def test_config_fields_that_cannot_work_are_named(tiny_model_dirs, tmp_path, changes, match):
    folder = broken_copy(tiny_model_dirs, tmp_path)
    config = {k: v for k, v in _config(tiny_model_dirs, **changes).items() if v is not None}
    (folder / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match=match):
        LLM(str(folder))


def test_a_config_without_architectures_loads_by_model_type(tiny_model_dirs, tmp_path):
    folder = broken_copy(tiny_model_dirs, tmp_path)
    config = _config(tiny_model_dirs)
    del config["architectures"]
    assert config["model_type"] == "llama"
    (folder / "config.json").write_text(json.dumps(config))
    llm = LLM(str(folder), num_kv_blocks=8)
    assert llm.generate({"prompt_token_ids": [5, 6]}, GOOD, use_tqdm=False)[0].finished


@pytest.mark.parametrize("kwargs, match", [
    ({"num_kv_blocks": 10**9}, r"a KV cache of 1000000000 blocks needs .* GiB but only .* GiB of cpu memory is free"),
    ({"kv_cache_memory_bytes": 10**15}, r"kv_cache_memory_bytes needs .* GiB but only"),
])
def test_a_kv_cache_larger_than_free_memory_is_refused_before_allocating(tiny_model_dirs, kwargs, match):
    with pytest.raises(ValueError, match=match):
        LLM(tiny_model_dirs["llama"], **kwargs)


def test_weights_larger_than_free_memory_are_refused_before_a_tensor_is_read(tiny_model_dirs, monkeypatch):
    """A model too large for the machine: a ValueError naming the bytes needed and free, before the model is built
    or a weight read (here the machine is made small, and the loader must not run)."""
    import torch
    import nanopaged.config
    import nanopaged.worker.model_runner as runner
    from nanopaged.models.loader import weight_bytes
    need = weight_bytes(tiny_model_dirs["llama"], torch.float32)
    assert need == 2 * weight_bytes(tiny_model_dirs["llama"], torch.bfloat16) > 100_000
    monkeypatch.setattr(nanopaged.config, "_free_memory", lambda device: need - 1)
    monkeypatch.setattr(runner, "load_weights", lambda *a: pytest.fail("a weight was read"))
    with pytest.raises(ValueError, match=rf"the model's weights needs .* GiB but only .* GiB of cpu memory is free "
                                         rf"\({need:,} bytes needed, {need - 1:,} available\); load a smaller model"):
        LLM(tiny_model_dirs["llama"], dtype="float32")


def test_gpu_memory_utilization_true_is_refused(tiny_model_dirs):
    with pytest.raises(ValueError, match=r"gpu_memory_utilization must be a number, got True"):
        LLM(tiny_model_dirs["llama"], gpu_memory_utilization=True)


def test_the_engine_seed_is_checked_before_the_weights_load(tiny_model_dirs, monkeypatch):
    import nanopaged.worker.model_runner as runner

    def no_loading(*args):
        raise AssertionError("the weights were loaded before the seed was checked")

    monkeypatch.setattr(runner, "load_weights", no_loading)
    with pytest.raises(ValueError, match=r"seed must be in \[-9223372036854775808, 18446744073709551615\]"):
        LLM(tiny_model_dirs["llama"], seed=2**64)


def test_a_text_far_past_the_context_is_refused_from_its_start(llm, monkeypatch):
    """A prompt of many megabytes is refused after tokenizing its first max_model_len x 32
    characters, never all of it (the server's 8 MiB bodies would otherwise cost seconds)."""
    tokenizer, seen = llm.llm_engine.tokenizer, []
    encode = tokenizer.encode
    monkeypatch.setattr(tokenizer, "encode", lambda text, **kw: seen.append(len(text)) or encode(text, **kw))
    text = "hello world " * 100_000                     # 1.2 M characters; max_model_len 200
    with pytest.raises(ValueError, match=r"at least \d+ tokens \(its first 6,400 of 1,200,000 characters"
                                         r" alone\); max_model_len=200.*at most 199"):
        llm.generate(text, GOOD, use_tqdm=False)
    assert seen == [6_400]
    assert llm.generate("hello world", GOOD, use_tqdm=False)[0].outputs[0].token_ids   # still serving
