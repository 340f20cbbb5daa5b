"""Embeddings (runner="pooling"): prefill without sampling, through the same scheduler and block pool.

Each pooled vector equals Hugging Face's last hidden states pooled the same way (float32, 1e-5), for
last-token, mean and CLS pooling, normalised or not; alone, in a batch, across chunked prefill, after
a prefix-cache hit and after a preemption; every block is free afterwards; every bad input is a
ValueError naming its field, or the runner.
"""
import functools
import json
import shutil

import pytest
import torch

from nanopaged import LLM, EmbeddingRequestOutput, PoolingParams, SamplingParams
from nanopaged.engine.extension import StepObserver

SETTINGS = dict(dtype="float32", block_size=4, num_kv_blocks=64)
PROMPTS = [list(range(3, 40)), list(range(50, 55)), [7], list(range(100, 121))]


@functools.lru_cache(maxsize=2)
def hf_model(model_dir):
    from transformers import AutoModelForCausalLM
    return AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)


def hf_hidden(model_dir, ids):
    """Hugging Face's last hidden states (after the final norm), (len(ids), hidden)."""
    with torch.no_grad():
        return hf_model(model_dir).model(torch.tensor([ids])).last_hidden_state[0]


def pooled(hidden, pooling, normalize):
    vector = {"LAST": hidden[-1], "MEAN": hidden.mean(0), "CLS": hidden[0]}[pooling]
    return torch.nn.functional.normalize(vector, dim=-1) if normalize else vector


def sentence_transformers_folder(model_dir, tmp_path, mode, normalize, extra_config=None):
    """A copy of the model folder with sentence-transformers' modules.json and Pooling config."""
    folder = tmp_path / f"st-{mode}-{normalize}"
    shutil.copytree(model_dir, folder)
    modules = [{"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"},
               {"idx": 1, "name": "1", "path": "1_Pooling", "type": "sentence_transformers.models.Pooling"}]
    if normalize:
        modules.append({"idx": 2, "name": "2", "path": "2_Normalize", "type": "sentence_transformers.models.Normalize"})
        (folder / "2_Normalize").mkdir()
    (folder / "modules.json").write_text(json.dumps(modules))
    (folder / "1_Pooling").mkdir()
    modes = ("cls_token", "mean_tokens", "max_tokens", "mean_sqrt_len_tokens", "weightedmean_tokens", "lasttoken")
    (folder / "1_Pooling" / "config.json").write_text(json.dumps(
        {"word_embedding_dimension": 64, **{f"pooling_mode_{m}": m == mode for m in modes}, "include_prompt": True}))
    if extra_config:
        config = json.loads((folder / "config.json").read_text())
        (folder / "config.json").write_text(json.dumps({**config, **extra_config}))
    return str(folder)


def embed(llm, prompts, params=None):
    return llm.embed([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)


def assert_all_blocks_free(llm):
    pool = llm.llm_engine.scheduler.block_pool
    assert pool.num_free_blocks == pool.num_blocks
    pool.check_invariants()


@pytest.fixture(scope="module")
def llama(tiny_model_dirs):
    return tiny_model_dirs["llama"]


@pytest.fixture(scope="module")
def last_llm(llama):
    return LLM(llama, runner="pooling", **SETTINGS)


@pytest.fixture(scope="module")
def mean_dir(llama, tmp_path_factory):
    return sentence_transformers_folder(llama, tmp_path_factory.mktemp("st"), "mean_tokens", normalize=False)


# ---- equal to Hugging Face's hidden states, pooled the same way --------------------------------------
def test_last_token_normalised_by_default_equals_hugging_face(last_llm, llama):
    assert last_llm.llm_engine.config.pooler_config.pooling_type == "LAST"      # vLLM's default for a decoder
    outputs = embed(last_llm, PROMPTS)
    for prompt, out in zip(PROMPTS, outputs):
        assert isinstance(out, EmbeddingRequestOutput) and out.finished and out.prompt_token_ids == prompt
        assert out.outputs.hidden_size == 64
        expected = pooled(hf_hidden(llama, prompt), "LAST", normalize=True)
        torch.testing.assert_close(torch.tensor(out.outputs.embedding), expected, atol=1e-5, rtol=0)
    assert_all_blocks_free(last_llm)


def test_normalize_false_gives_the_raw_hidden_state(last_llm, llama):
    [out] = embed(last_llm, PROMPTS[:1], PoolingParams(normalize=False))
    expected = pooled(hf_hidden(llama, PROMPTS[0]), "LAST", normalize=False)
    torch.testing.assert_close(torch.tensor(out.outputs.embedding), expected, atol=1e-5, rtol=0)


@pytest.mark.parametrize("mode, pooling", [("mean_tokens", "MEAN"), ("cls_token", "CLS"), ("lasttoken", "LAST")])
@pytest.mark.parametrize("normalize", [False, True])
def test_the_sentence_transformers_config_chooses_pooling_and_normalisation(llama, tmp_path, mode, pooling,
                                                                            normalize):
    folder = sentence_transformers_folder(llama, tmp_path, mode, normalize)
    llm = LLM(folder, runner="pooling", **SETTINGS, max_num_batched_tokens=8)   # several chunks per prompt
    assert (llm.llm_engine.config.pooler_config.pooling_type, llm.llm_engine.config.pooler_config.normalize) == (
        pooling, normalize)
    # MEAN and CLS need every position's hidden state: no prefix cache (vLLM turns it off too)
    assert llm.llm_engine.config.enable_prefix_caching == (pooling == "LAST")
    for prompt, out in zip(PROMPTS, embed(llm, PROMPTS)):
        expected = pooled(hf_hidden(llama, prompt), pooling, normalize)
        torch.testing.assert_close(torch.tensor(out.outputs.embedding), expected, atol=1e-5, rtol=0)
    assert_all_blocks_free(llm)


def test_pooler_config_overrides_the_folder(mean_dir, llama):
    llm = LLM(mean_dir, runner="pooling", pooler_config={"pooling_type": "cls", "normalize": True}, **SETTINGS)
    [out] = embed(llm, PROMPTS[:1])
    torch.testing.assert_close(torch.tensor(out.outputs.embedding),
                               pooled(hf_hidden(llama, PROMPTS[0]), "CLS", True), atol=1e-5, rtol=0)


# ---- the same vector whatever the schedule -------------------------------------------------------------
@pytest.mark.parametrize("folder", ["last", "mean"])
def test_one_chunk_or_many_alone_or_in_a_batch_give_the_same_vector(llama, mean_dir, folder):
    model = llama if folder == "last" else mean_dir
    whole = LLM(model, runner="pooling", **SETTINGS)
    alone = [embed(whole, [p])[0].outputs.embedding for p in PROMPTS]
    batch = [o.outputs.embedding for o in embed(whole, PROMPTS)]
    chunked = LLM(model, runner="pooling", **SETTINGS, max_num_batched_tokens=5)
    seen = []
    chunked.llm_engine.install(StepObserver(lambda step: seen.append([n for _, n in step.scheduler_output.scheduled])))
    in_chunks = [o.outputs.embedding for o in embed(chunked, PROMPTS)]
    assert max(map(len, seen)) > 1 and all(sum(s) <= 5 for s in seen)     # chunks, side by side
    for a, b, c in zip(alone, batch, in_chunks):
        torch.testing.assert_close(torch.tensor(b), torch.tensor(a), atol=1e-5, rtol=0)
        torch.testing.assert_close(torch.tensor(c), torch.tensor(a), atol=1e-5, rtol=0)
    assert_all_blocks_free(whole)
    assert_all_blocks_free(chunked)


def test_a_prefix_cache_hit_gives_the_same_last_token_vector(last_llm):
    prompt = list(range(200, 240))
    [first] = embed(last_llm, [prompt])
    [again] = embed(last_llm, [prompt])
    [longer] = embed(last_llm, [prompt + [5, 6, 7]])
    assert again.num_cached_tokens == 36 and longer.num_cached_tokens == 40       # whole blocks of 4
    torch.testing.assert_close(torch.tensor(again.outputs.embedding), torch.tensor(first.outputs.embedding),
                               atol=1e-5, rtol=0)
    fresh = LLM(last_llm.llm_engine.config.model, runner="pooling", **SETTINGS)
    torch.testing.assert_close(torch.tensor(longer.outputs.embedding),
                               torch.tensor(embed(fresh, [prompt + [5, 6, 7]])[0].outputs.embedding),
                               atol=1e-5, rtol=0)
    assert_all_blocks_free(last_llm)


def test_a_preempted_mean_pooling_request_starts_its_sum_again(mean_dir):
    """Preempted mid-prompt (as the scheduler does when blocks run out: `Scheduler._preempt`), it is
    recomputed from position 0, and its sum with it."""
    prompt = list(range(10, 50))
    [expected] = embed(LLM(mean_dir, runner="pooling", **SETTINGS), [prompt])
    llm = LLM(mean_dir, runner="pooling", **SETTINGS, max_num_batched_tokens=8)
    engine = llm.llm_engine
    engine.queue(engine.process_request("r", {"prompt_token_ids": prompt}, PoolingParams()))
    engine.step()
    engine.step()
    request = engine.scheduler.running.pop()
    assert request.num_computed_tokens == 16
    engine.scheduler._preempt(request)
    outputs = []
    while engine.has_unfinished_requests():
        outputs += engine.step()
    assert request.num_preemptions == 1 and outputs[-1].finished
    torch.testing.assert_close(outputs[-1].pooled, torch.tensor(expected.outputs.embedding), atol=1e-5, rtol=0)
    assert_all_blocks_free(llm)


def test_task_embed_and_text_prompts(llama):
    llm = LLM(llama, task="embed", **SETTINGS)
    assert llm.llm_engine.config.runner == "pooling"
    [a, b] = llm.embed(["Hello world", {"prompt": "Hello world"}], use_tqdm=False)
    assert a.prompt_token_ids == b.prompt_token_ids == llm.get_tokenizer().encode("Hello world")
    # the same tokens in two rows of one float32 step: MKL's blocking may round them apart (the reference
    # path promises no batch invariance; on an AMX host it does round them apart)
    torch.testing.assert_close(torch.tensor(a.outputs.embedding), torch.tensor(b.outputs.embedding),
                               atol=1e-6, rtol=0)


def test_matryoshka_dimensions_are_honoured(llama, tmp_path):
    folder = sentence_transformers_folder(llama, tmp_path, "lasttoken", False, {"matryoshka_dimensions": [16, 64]})
    llm = LLM(folder, runner="pooling", **SETTINGS)
    [out] = embed(llm, PROMPTS[:1], PoolingParams(dimensions=16, normalize=True))
    expected = torch.nn.functional.normalize(hf_hidden(llama, PROMPTS[0])[-1][:16], dim=-1)   # cut, then normalise
    torch.testing.assert_close(torch.tensor(out.outputs.embedding), expected, atol=1e-5, rtol=0)
    with pytest.raises(ValueError, match="dimensions=32"):
        embed(llm, PROMPTS[:1], PoolingParams(dimensions=32))


# ---- bad input -------------------------------------------------------------------------------------------
def test_embed_on_a_generating_llm_names_the_runner(llama):
    llm = LLM(llama, **SETTINGS)
    with pytest.raises(ValueError, match="runner='pooling'"):
        llm.embed(["Hello"], use_tqdm=False)


def test_generate_on_a_pooling_llm_names_the_runner(last_llm):
    with pytest.raises(ValueError, match="runner='pooling'.*runner='generate'"):
        last_llm.generate(["Hello"], SamplingParams(max_tokens=2), use_tqdm=False)
    with pytest.raises(ValueError, match="runner='pooling'"):
        last_llm.llm_engine.add_request("x", "Hello", SamplingParams())
    assert not last_llm.llm_engine.has_unfinished_requests()


@pytest.mark.parametrize("params, field", [
    (dict(dimensions=0), "dimensions"), (dict(dimensions=1.5), "dimensions"), (dict(normalize="yes"), "normalize"),
    (dict(task="generate"), "task"), (dict(truncate_prompt_tokens=0), "truncate_prompt_tokens")])
def test_bad_pooling_params_name_the_field(params, field):
    with pytest.raises(ValueError, match=field):
        PoolingParams(**params)


def test_bad_requests_to_a_pooling_llm(last_llm):
    with pytest.raises(ValueError, match="dimensions=8 is not supported"):       # not a Matryoshka model
        embed(last_llm, PROMPTS[:1], PoolingParams(dimensions=8))
    with pytest.raises(ValueError, match="pooling_params must be"):
        last_llm.embed(["Hello"], SamplingParams(), use_tqdm=False)
    with pytest.raises(ValueError, match="empty"):
        last_llm.embed([{"prompt_token_ids": []}], use_tqdm=False)
    with pytest.raises(ValueError, match="got 2 PoolingParams for 1 prompts"):
        last_llm.embed(["Hello"], [PoolingParams(), PoolingParams()], use_tqdm=False)
    assert_all_blocks_free(last_llm)


@pytest.mark.parametrize("settings, message", [
    (dict(runner="embed"), "runner must be one of"),
    (dict(pooler_config={"pooling_type": "MEAN"}), "pooler_config=.* needs runner='pooling'"),
    (dict(runner="pooling", pooler_config={"pooling_type": "MAX"}), "pooling_type must be one of"),
    (dict(runner="pooling", pooler_config={"softmax": True}), "pooler_config must be a dict with"),
    (dict(runner="pooling", pooler_config={"normalize": 1}), "normalize must be True or False"),
    (dict(runner="pooling", speculative_config={"method": "ngram", "num_speculative_tokens": 2}),
     "speculative_config"),
])
def test_bad_pooling_settings_name_the_setting(llama, settings, message):
    with pytest.raises(ValueError, match=message):
        LLM(llama, **SETTINGS, **settings)


@pytest.mark.parametrize("mode", ["max_tokens", "mean_sqrt_len_tokens"])
def test_a_sentence_transformers_mode_nanopaged_does_not_run_is_refused_by_name(llama, tmp_path, mode):
    folder = sentence_transformers_folder(llama, tmp_path, mode, False)
    with pytest.raises(ValueError, match=f"pooling_mode_{mode}"):
        LLM(folder, runner="pooling", **SETTINGS)


def test_a_dense_module_is_refused_by_name(llama, tmp_path):
    folder = sentence_transformers_folder(llama, tmp_path, "mean_tokens", False)
    modules = json.loads((tmp_path / "st-mean_tokens-False" / "modules.json").read_text())
    modules.append({"idx": 2, "name": "2", "path": "2_Dense", "type": "sentence_transformers.models.Dense"})
    (tmp_path / "st-mean_tokens-False" / "modules.json").write_text(json.dumps(modules))
    with pytest.raises(ValueError, match="sentence_transformers.models.Dense"):
        LLM(folder, runner="pooling", **SETTINGS)


def test_truncate_prompt_tokens_keeps_the_last_tokens(last_llm):
    [cut] = embed(last_llm, PROMPTS[:1], PoolingParams(truncate_prompt_tokens=5))
    [tail] = embed(last_llm, [PROMPTS[0][-5:]])
    assert cut.prompt_token_ids == PROMPTS[0][-5:]
    torch.testing.assert_close(torch.tensor(cut.outputs.embedding), torch.tensor(tail.outputs.embedding),
                               atol=1e-5, rtol=0)


def test_an_input_of_exactly_max_model_len_tokens_is_embedded(llama):
    """Nothing is generated after a pooled prompt, so it may fill the context (as vLLM); one token more is
    refused naming the limit, and a generating engine still keeps room for its first token."""
    pooling = LLM(llama, runner="pooling", max_model_len=32, **SETTINGS)
    [out] = embed(pooling, [list(range(3, 35))])                          # 32 tokens
    assert len(out.prompt_token_ids) == 32 and len(out.outputs.embedding) == 64
    with pytest.raises(ValueError, match=r"the prompt has 33 tokens; max_model_len=32 \(a prompt may be at most 32"):
        embed(pooling, [list(range(3, 36))])
    [cut] = embed(pooling, [list(range(3, 43))], PoolingParams(truncate_prompt_tokens=-1))
    assert cut.prompt_token_ids == list(range(11, 43))                   # -1 keeps as many as fit: all 32
    assert_all_blocks_free(pooling)
    generating = LLM(llama, max_model_len=32, **SETTINGS)
    with pytest.raises(ValueError, match="leaves no room for a generated token"):
        generating.generate({"prompt_token_ids": list(range(3, 35))}, use_tqdm=False)
