"""vLLM's API as its clients call it: every engine argument honoured, accepted where it changes
nothing, or refused by name; SamplingParams' later fields with vLLM's meanings; generate's
lora_request and priority; `llm_engine.model_config`; the prompt TypedDicts."""
import shutil

import pytest
import torch

from conftest import make_prompts
from nanopaged import LLM, RequestOutputKind, SamplingParams, TextPrompt, TokensPrompt
from nanopaged.vllm_compat import NOT_IMPLEMENTED, NOT_IMPLEMENTED_BY_NAME, RENAMED


@pytest.fixture(scope="module")
def llm(tiny_model_dirs):
    return LLM(tiny_model_dirs["llama"], dtype="float32", num_kv_blocks=128, max_model_len=256)


def ids(prompt):
    return {"prompt_token_ids": prompt}


GREEDY = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
PROMPT = make_prompts(512, n=1, seed=40, min_len=10, max_len=20)[0]


def greedy_tokens(llm, params=GREEDY, prompt=PROMPT):
    return llm.generate(ids(prompt), params, use_tqdm=False)[0].outputs[0].token_ids


# ---- engine arguments ----------------------------------------------------------------
# What lm-evaluation-harness 0.4.13 passes on every LLM(...) (lm_eval/models/vllm_causallms.py)
LM_EVAL_ARGS = dict(revision=None, dtype="float32", tokenizer=None, tokenizer_mode="auto", tokenizer_revision=None,
                    trust_remote_code=False, tensor_parallel_size=1, max_model_len=None, max_num_seqs=None,
                    quantization=None, seed=1234, enable_lora=False, max_lora_rank=16)


def test_what_lm_eval_passes_on_every_call_is_accepted(tiny_model_dirs):
    llm = LLM(tiny_model_dirs["llama"], num_kv_blocks=32, **LM_EVAL_ARGS)
    cfg = llm.llm_engine.config
    assert (cfg.seed, cfg.max_num_seqs, cfg.max_model_len, cfg.dtype) == (1234, 256, 512, "float32")
    assert cfg.tokenizer == tiny_model_dirs["llama"]


def test_every_off_value_of_every_vllm_argument_is_accepted(tiny_model_dirs):
    off = {name: accepted[0] for names, accepted, _ in NOT_IMPLEMENTED if accepted is not None for name in names}
    off |= {"swap_space": 4, "disable_log_stats": True, "served_model_name": "x", "max_loras": 4}   # any value
    LLM(tiny_model_dirs["llama"], num_kv_blocks=16, **off)


@pytest.mark.parametrize("kwargs, match", [
    ({"quantization": "awq"}, r"^quantization must be one of \[None, 'gguf', 'int4', 'int8', 'w8a8'\], got 'awq'"),
    ({"fully_sharded_loras": True}, r"fully_sharded_loras=True is not supported: nanopaged runs adapters in one process"),
    ({"revision": "main"}, r"revision='main' is not supported: .* never reaches a model hub"),
    ({"tokenizer_mode": "mistral"}, r"tokenizer_mode='mistral' is not supported"),
    ({"kv_cache_dtype": "fp16"}, r"kv_cache_dtype must be one of \['auto', 'fp8', 'fp8_e4m3', 'fp8_e5m2', 'int8'\], "
                                 r"got 'fp16'"),
    ({"calculate_kv_scales": True}, r"calculate_kv_scales=True is not supported: nanopaged keeps k_scale = v_scale = 1.0"),
    ({"decode_context_parallel_size": 2}, r"decode_context_parallel_size=2 is not supported: .*no context parallel"),
    ({"speculative_config": {"method": "ngram"}}, r"speculative_config num_speculative_tokens must be an integer, got None"),
    ({"speculative_model": "[ngram]"}, r"speculative_model='\[ngram\]' is not supported: .*speculative_config=\{...\}"),
    ({"enable_chunked_prefill": False}, r"enable_chunked_prefill=False is not supported"),
    ({"scheduling_policy": "priority"}, r"scheduling_policy='priority' is not supported"),
    ({"enforce_eager": 1}, r"enforce_eager must be True or False, got 1"),
    ({"trust_remote_code": 1}, r"trust_remote_code=1 is not supported"),     # a bool matches only a bool
    ({"prefix_caching_hash_algo": "sha256_cbor"}, r"prefix_caching_hash_algo='sha256_cbor' is not supported; "
                                                  r"nanopaged's prefix_hash takes \['sha256', 'xxhash'\]"),
    ({"prefix_caching_hash_algo": "xxhash", "prefix_hash": "sha256"}, r"give prefix_hash or vLLM's prefix_caching"),
    ({"max_logprobs": 21}, r"max_logprobs must be in \[0, 20\], got 21"),
    ({"max_num_seqz": 4}, r"unknown engine setting\(s\) \['max_num_seqz'\] \(did you mean \['max_num_seqs'\]\?\); "
                          r"known: \[.*'kv_cache_dtype'.*\], and vLLM's \[.*'calculate_kv_scales'.*\]"),
])
def test_a_vllm_argument_that_asks_for_what_nanopaged_does_not_do_is_refused_by_name(tiny_model_dirs, kwargs, match):
    with pytest.raises(ValueError, match=match):
        LLM(tiny_model_dirs["llama"], num_kv_blocks=16, **kwargs)


def test_the_tables_name_each_argument_once():
    names = [name for names, _, _ in NOT_IMPLEMENTED for name in names]
    assert len(names) == len(set(names)) == len(NOT_IMPLEMENTED_BY_NAME)
    from nanopaged.config import EngineConfig
    from dataclasses import fields
    own = {f.name for f in fields(EngineConfig)}
    assert not (set(names) | set(RENAMED)) & own


def test_the_sampling_table_names_the_fields_sampling_params_has():
    from nanopaged.sampling_params import VLLM_ONLY
    from nanopaged.vllm_compat import NOT_IMPLEMENTED_SAMPLING
    assert list(VLLM_ONLY) == list(NOT_IMPLEMENTED_SAMPLING)
    for name, (accepted, _) in NOT_IMPLEMENTED_SAMPLING.items():
        assert accepted is None or accepted[0] == VLLM_ONLY[name], name
    assert SamplingParams() == SamplingParams(**VLLM_ONLY)


def test_vllm_names_for_nanopaged_settings_are_honoured(tiny_model_dirs):
    llm = LLM(tiny_model_dirs["llama"], num_gpu_blocks_override=24, prefix_caching_hash_algo="xxhash",
              block_size=None, enable_prefix_caching=None, enforce_eager=None, seed=None)
    cfg = llm.llm_engine.config
    assert llm.llm_engine.runner.num_kv_blocks == 24 and cfg.prefix_hash == "xxhash"
    assert (cfg.block_size, cfg.enable_prefix_caching, cfg.enforce_eager, cfg.seed) == (16, True, False, 0)


def test_max_logprobs_bounds_what_a_request_may_ask_for(tiny_model_dirs):
    llm = LLM(tiny_model_dirs["llama"], num_kv_blocks=16, max_logprobs=2)
    with pytest.raises(ValueError, match=r"prompt_logprobs=3 is more than max_logprobs=2"):
        llm.generate("x", SamplingParams(prompt_logprobs=3), use_tqdm=False)
    assert llm.generate("x", SamplingParams(logprobs=2, max_tokens=2), use_tqdm=False)[0].outputs[0].logprobs


def test_a_tokenizer_folder_of_its_own_is_loaded(tiny_model_dirs, tmp_path):
    """tokenizer= a folder: that folder's tokenizer, even when the model folder has none."""
    model = tmp_path / "model"
    shutil.copytree(tiny_model_dirs["llama"], model)
    tokenizer = tmp_path / "tokenizer"
    tokenizer.mkdir()
    for f in model.iterdir():
        if f.name.startswith(("tokenizer", "chat_template", "special_tokens")):
            f.rename(tokenizer / f.name)
    with pytest.raises(ValueError, match=r"model folder .* has no tokenizer"):
        LLM(str(model), num_kv_blocks=16)
    llm = LLM(str(model), tokenizer=str(tokenizer), num_kv_blocks=16)
    assert llm.llm_engine.model_config.tokenizer == str(tokenizer)
    assert llm.generate("def f():", SamplingParams(max_tokens=3, temperature=0), use_tqdm=False)[0].prompt_token_ids
    for bad, match in ((str(tmp_path / "nowhere"), r"tokenizer='.*nowhere' is not a folder"),
                       (str(model), r"tokenizer folder '.*model' has no tokenizer")):
        with pytest.raises(ValueError, match=match):
            LLM(str(model), tokenizer=bad, num_kv_blocks=16)


def test_model_config_has_the_names_vllm_clients_read(llm, tiny_model_dirs):
    mc = llm.llm_engine.model_config
    assert (mc.max_model_len, mc.dtype, mc.model, mc.tokenizer) == (256, torch.float32, tiny_model_dirs["llama"],
                                                                    tiny_model_dirs["llama"])
    assert mc.get_vocab_size() == 512 and mc.hf_config.architectures == ["LlamaForCausalLM"]
    assert mc.hf_config.vocab_size == mc.hf_text_config.vocab_size == 512
    assert (mc.get_hidden_size(), mc.get_num_layers(), mc.get_head_size()) == (64, 2, 16)
    assert llm.llm_engine.get_tokenizer() is llm.get_tokenizer()


def test_default_sampling_params_come_from_generation_config(tiny_model_dirs, tmp_path):
    """As in vLLM: generate without SamplingParams takes generation_config.json's sampling fields."""
    import json
    model = tmp_path / "model"
    shutil.copytree(tiny_model_dirs["llama"], model)
    config = json.loads((model / "generation_config.json").read_text())
    (model / "generation_config.json").write_text(json.dumps({**config, "temperature": 0.5, "top_k": 7,
                                                              "max_new_tokens": 5, "do_sample": True}))
    llm = LLM(str(model), num_kv_blocks=16)
    default = llm.get_default_sampling_params()
    assert (default.temperature, default.top_k, default.max_tokens) == (0.5, 7, 5)
    out = llm.generate({"prompt_token_ids": [5, 6, 7]}, use_tqdm=False)[0].outputs[0]
    assert len(out.token_ids) == 5 or out.finish_reason == "stop"
    assert LLM(tiny_model_dirs["llama"], num_kv_blocks=16).get_default_sampling_params() == SamplingParams()


# ---- generate's vLLM arguments ---------------------------------------------------------
def test_generate_takes_vllm_lora_request_and_priority_when_they_ask_for_nothing(llm):
    want = greedy_tokens(llm)
    got = llm.generate([ids(PROMPT)], GREEDY, False, None, [0])[0].outputs[0].token_ids   # vLLM's positions
    assert got == want
    assert llm.generate(ids(PROMPT), GREEDY, use_tqdm=False, lora_request=[None])[0].outputs[0].token_ids == want
    for kwargs, match in (({"lora_request": object()}, r"lora_request=.* needs an engine made with enable_lora=True"),
                          ({"priority": [1]}, r"priority=\[1\] is not supported: nanopaged schedules first come"),
                          ({"priority": [0, 0]}, r"got 2 priorities for 1 prompts")):
        with pytest.raises(ValueError, match=match):
            llm.generate([ids(PROMPT)], GREEDY, use_tqdm=False, **kwargs)


def test_generate_leaves_the_callers_sampling_params_as_they_were(llm):
    params = SamplingParams(temperature=0, max_tokens=2)
    llm.generate("x", params, use_tqdm=False)
    assert params.output_kind is RequestOutputKind.CUMULATIVE


def test_the_prompt_typeddicts_are_plain_dicts(llm):
    assert llm.generate([TokensPrompt(prompt_token_ids=PROMPT), TextPrompt(prompt="def main():")], GREEDY,
                        use_tqdm=False)[0].outputs[0].token_ids == greedy_tokens(llm)
    with pytest.raises(ValueError, match=r"multi_modal_data: LlamaForCausalLM is a text-only model and takes no images"):
        llm.generate({"prompt": "x", "multi_modal_data": {"image": 1}}, GREEDY, use_tqdm=False)
    llm.generate({"prompt": "x", "multi_modal_data": None}, GREEDY, use_tqdm=False)   # None asks for nothing


# ---- SamplingParams: vLLM's later fields -----------------------------------------------
@pytest.mark.parametrize("kwargs, match", [
    ({"best_of": 3}, r"best_of=3 is not supported: nanopaged has no best-of-n selection"),
    ({"structured_outputs": {"json": {}}}, r"structured_outputs must be a StructuredOutputsParams, got dict"),
    ({"logprob_token_ids": [1]}, r"logprob_token_ids=\[1\] is not supported"),
    ({"stream_interval": 4}, r"stream_interval=4 is not supported"),
    ({"stop": ["x"], "detokenize": False}, r"stop strings are found in the text, so they need detokenize=True"),
    ({"truncate_prompt_tokens": 0}, r"truncate_prompt_tokens must be an integer >= 1 or -1, got 0"),
    ({"truncate_prompt_tokens": -2}, r"truncate_prompt_tokens must be in \[-1, inf\], got -2"),
    ({"allowed_token_ids": []}, r"allowed_token_ids must hold at least one token id, got \[\]"),
    ({"allowed_token_ids": [-1]}, r"allowed_token_ids\[i\] must be in \[0, inf\], got -1"),
    ({"bad_words": [""]}, r"bad_words must be a list of non-empty strings"),
    ({"bad_words": "word"}, r"bad_words must be a list of non-empty strings, got 'word'"),
    ({"logit_bias": {1: float("inf")}}, r"logit_bias\[1\] must be a finite number"),
    ({"logit_bias": {"a": 1.0}}, r"logit_bias key must be an integer, got 'a'"),
    ({"logit_bias": [1]}, r"logit_bias must be a dict of token id -> bias"),
    ({"output_kind": 2}, r"output_kind must be one of"),
    ({"detokenize": "no"}, r"detokenize must be True or False"),
    ({"spaces_between_special_tokens": None}, r"spaces_between_special_tokens must be True or False"),
])
def test_bad_vllm_sampling_fields(kwargs, match):
    with pytest.raises(ValueError, match=match):
        SamplingParams(**kwargs)


def test_vllm_sampling_fields_at_their_off_values_are_accepted():
    p = SamplingParams(best_of=1, structured_outputs=None, logits_processors=[], flat_logprobs=False,
                       stream_interval=None, skip_clone=True, extra_args={"anything": 1}, thinking_token_budget=-1,
                       logit_bias={"5": 2}, seed=-1, bad_words=["a", "a"])
    assert p.seed is None and p.logit_bias == {5: 2.0} and p.bad_words == ["a"]   # vLLM's normal forms
    assert SamplingParams(2).n == 2                                  # the new fields are keyword-only


@pytest.mark.parametrize("name, value", [("allowed_token_ids", [3, 512]), ("logit_bias", {512: 1.0})])
def test_token_ids_outside_the_vocabulary_are_refused(llm, name, value):
    with pytest.raises(ValueError, match=rf"{name} holds 512, outside the vocabulary \[0, 512\)"):
        llm.generate("x", SamplingParams(**{name: value}), use_tqdm=False)


def test_detokenize_false_keeps_ids_and_logprobs_and_makes_no_text(llm, monkeypatch):
    params = dict(temperature=0, max_tokens=6, ignore_eos=True, logprobs=2, prompt_logprobs=1)
    want = llm.generate(ids(PROMPT), SamplingParams(**params), use_tqdm=False)[0]
    decoded = []
    monkeypatch.setattr(llm.get_tokenizer(), "decode", lambda *a, **k: decoded.append(a) or "")
    got = llm.generate(ids(PROMPT), SamplingParams(**params, detokenize=False), use_tqdm=False)[0]
    assert decoded == []                                   # no detokenizer work at all
    c, w = got.outputs[0], want.outputs[0]
    assert c.text == "" and c.token_ids == w.token_ids and c.cumulative_logprob == w.cumulative_logprob
    assert [{t: lp.logprob for t, lp in d.items()} for d in c.logprobs] == \
           [{t: lp.logprob for t, lp in d.items()} for d in w.logprobs]
    assert all(lp.decoded_token is None for d in c.logprobs + got.prompt_logprobs[1:] for lp in d.values())
    assert [{t: lp.logprob for t, lp in d.items()} for d in got.prompt_logprobs[1:]] == \
           [{t: lp.logprob for t, lp in d.items()} for d in want.prompt_logprobs[1:]]


def test_truncate_prompt_tokens_keeps_the_last_tokens(llm):
    long = make_prompts(512, n=1, seed=41, min_len=40, max_len=50)[0]
    out = llm.generate(ids(long), SamplingParams(temperature=0, max_tokens=4, ignore_eos=True,
                                                 truncate_prompt_tokens=10), use_tqdm=False)[0]
    assert out.prompt_token_ids == long[-10:]
    assert out.outputs[0].token_ids == greedy_tokens(llm, SamplingParams(temperature=0, max_tokens=4, ignore_eos=True),
                                                     long[-10:])
    text = "word " * 400                                  # ~400+ tokens, past max_model_len=256
    with pytest.raises(ValueError, match=r"max_model_len=256"):
        llm.generate(text, SamplingParams(max_tokens=2), use_tqdm=False)
    cut = llm.generate(text, SamplingParams(max_tokens=2, truncate_prompt_tokens=-1), use_tqdm=False)[0]
    assert len(cut.prompt_token_ids) == 255 and cut.prompt == text       # -1: the longest prompt that runs
    with pytest.raises(ValueError, match=r"truncate_prompt_tokens=300 is larger than max_model_len=256"):
        llm.generate(text, SamplingParams(truncate_prompt_tokens=300), use_tqdm=False)


def test_allowed_token_ids_are_the_only_tokens_drawn(llm):
    allowed = [7, 11, 300]
    for temperature in (0, 1.0):
        out = greedy_tokens(llm, SamplingParams(temperature=temperature, seed=1, max_tokens=12, ignore_eos=True,
                                                allowed_token_ids=allowed))
        assert set(out) <= set(allowed) and len(out) == 12


def test_logit_bias_moves_a_token_to_the_top_and_a_large_negative_one_away(llm):
    free = greedy_tokens(llm)
    boosted = greedy_tokens(llm, SamplingParams(temperature=0, max_tokens=8, ignore_eos=True, logit_bias={99: 100.0}))
    assert boosted == [99] * 8 and free != boosted
    banned = greedy_tokens(llm, SamplingParams(temperature=0, max_tokens=8, ignore_eos=True,
                                               logit_bias={t: -100.0 for t in free}))
    assert not set(banned) & set(free)


def test_bad_words_are_never_generated(llm):
    """A word the model writes greedily, as bad_words, is not written; the rule for words of several
    tokens is proved on the sampler (tests/sample/test_sampler.py)."""
    tok = llm.get_tokenizer()
    free = greedy_tokens(llm)
    word = next(w for w in (tok.decode([t]) for t in free)
                if w.strip() and w.isprintable() and tok.encode(w.lstrip(), add_special_tokens=False) in (
                    [[t] for t in free]))
    out = greedy_tokens(llm, SamplingParams(temperature=0, max_tokens=8, ignore_eos=True, bad_words=[word]))
    blocked = {t for w in (word.lstrip(), " " + word.lstrip()) for t in tok.encode(w, add_special_tokens=False)}
    assert not blocked & set(out) and out != free


def test_output_kinds_cumulative_delta_and_final_only(tiny_model_dirs):
    """LLMEngine.step: CUMULATIVE returns everything so far, DELTA what is new (their concatenation
    is the whole), FINAL_ONLY one output at the end."""
    llm = LLM(tiny_model_dirs["llama"], dtype="float32", num_kv_blocks=64)
    engine = llm.llm_engine
    for kind in RequestOutputKind:
        engine.add_request(kind.name, ids(PROMPT), SamplingParams(temperature=0, max_tokens=7, ignore_eos=True,
                                                                  logprobs=1, output_kind=kind))
    seen = {kind.name: [] for kind in RequestOutputKind}
    while engine.has_unfinished_requests():
        for o in engine.step():
            seen[o.request_id].append(o.outputs[0])
    whole = seen["CUMULATIVE"][-1]
    assert [len(c.token_ids) for c in seen["CUMULATIVE"]] == list(range(1, 8))
    assert len(seen["FINAL_ONLY"]) == 1 and seen["FINAL_ONLY"][0].token_ids == whole.token_ids
    delta = seen["DELTA"]
    assert [len(c.token_ids) for c in delta] == [1] * 7 and delta[-1].finish_reason == "length"
    assert sum((c.token_ids for c in delta), []) == whole.token_ids
    assert "".join(c.text for c in delta) == whole.text
    flat = sum((c.logprobs for c in delta), [])
    assert [list(d) for d in flat] == [list(d) for d in whole.logprobs]      # the same tokens, each once


def test_a_delta_output_holds_back_what_may_begin_a_stop_string(llm):
    """vLLM's stop_buffer_length: text that may still turn out to be a stop string is not sent."""
    engine = llm.llm_engine
    free = llm.generate(ids(PROMPT), SamplingParams(temperature=0, max_tokens=8, ignore_eos=True), use_tqdm=False)
    text = free[0].outputs[0].text
    # three printable characters that first occur well inside the text
    stop = next(text[i:i + 3] for i in range(len(text) // 3, len(text) - 3)
                if text.find(text[i:i + 3]) == i and text[i:i + 3].isprintable())
    engine.add_request("d", ids(PROMPT), SamplingParams(temperature=0, max_tokens=8, ignore_eos=True, stop=[stop],
                                                        output_kind=RequestOutputKind.DELTA))
    parts = []
    while engine.has_unfinished_requests():
        parts += [o.outputs[0].text for o in engine.step()]
    assert "".join(parts) == text[:text.index(stop)]
