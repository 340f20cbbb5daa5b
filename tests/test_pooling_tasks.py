"""vLLM's other pooling tasks (runner="pooling"): classify, reward, score, encode.

Tiny random Llama-, Qwen2- and Qwen3ForSequenceClassification models, saved with save_pretrained, against
transformers in float32: classify's probabilities are softmax(logits), in a batch of prompts of
different lengths and across chunked prefill; reward is a classifier's per-token scores; a cross-encoder's
score is sigmoid of its logit on the tokenizer's pair encoding; an embedding model's is the cosine of the
two embeddings. Every call a model cannot answer is refused by name.
"""
import functools
import json
import shutil

import pytest
import torch

from nanopaged import LLM, PoolingParams
from nanopaged.pooling.outputs import ClassificationRequestOutput, PoolingRequestOutput, ScoringRequestOutput

SETTINGS = dict(dtype="float32", block_size=4, num_kv_blocks=64)
PROMPTS = [list(range(3, 40)), list(range(50, 55)), [7], list(range(100, 121))]   # no pad (2) among them


def save_classifier(model_dir, folder, num_labels, **config_fields):
    """A *ForSequenceClassification with the tiny causal LM's config, random weights, its tokenizer."""
    from transformers import AutoConfig, AutoModelForSequenceClassification, AutoTokenizer
    config = AutoConfig.from_pretrained(model_dir)
    config.num_labels, config.pad_token_id = num_labels, None     # no pad: transformers scores the last token
    for name, value in config_fields.items():
        setattr(config, name, value)
    torch.manual_seed(1)
    model = AutoModelForSequenceClassification.from_config(config, dtype=torch.float32)
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.copy_(1 + 0.2 * torch.randn_like(p)) if "norm" in name else p.normal_(0.0, 0.15)
    model.save_pretrained(folder, safe_serialization=True)
    AutoTokenizer.from_pretrained(model_dir).save_pretrained(folder)
    return str(folder)


@pytest.fixture(scope="module")
def classifiers(tiny_model_dirs, tmp_path_factory):
    root = tmp_path_factory.mktemp("classifiers")
    return {"llama": save_classifier(tiny_model_dirs["llama"], root / "llama", 3),
            "qwen2": save_classifier(tiny_model_dirs["qwen2"], root / "qwen2", 3),
            "qwen3": save_classifier(tiny_model_dirs["qwen3"], root / "qwen3", 2),
            "cross": save_classifier(tiny_model_dirs["qwen2"], root / "cross", 1)}


@functools.lru_cache(maxsize=4)
def hf_classifier(folder):
    from transformers import AutoModelForSequenceClassification
    return AutoModelForSequenceClassification.from_pretrained(folder, dtype=torch.float32).eval()


def hf_logits(folder, ids):
    """transformers' logits for the sequence, (num_labels,)."""
    with torch.no_grad():
        return hf_classifier(folder)(torch.tensor([ids])).logits[0]


def hf_token_logits(folder, ids):
    """The score head over every position's hidden state, (len(ids), num_labels)."""
    model = hf_classifier(folder)
    with torch.no_grad():
        return model.score(model.model(torch.tensor([ids])).last_hidden_state[0])


def tokens(prompts):
    return [{"prompt_token_ids": p} for p in prompts]


def assert_all_blocks_free(llm):
    pool = llm.llm_engine.scheduler.block_pool
    assert pool.num_free_blocks == pool.num_blocks
    pool.check_invariants()


@pytest.fixture(scope="module")
def cross(classifiers):
    return LLM(classifiers["cross"], runner="pooling", **SETTINGS)


# ---- classify ----------------------------------------------------------------------------------------------
@pytest.mark.parametrize("name", ["llama", "qwen2", "qwen3"])
@pytest.mark.parametrize("budget", [None, 5])                  # 5: several chunks per prompt, side by side
def test_classify_probabilities_equal_transformers_softmax(classifiers, name, budget):
    llm = LLM(classifiers[name], runner="pooling", **SETTINGS, max_num_batched_tokens=budget)
    assert llm.llm_engine.config.model_config.architecture == f"{name.capitalize()}ForSequenceClassification"
    outputs = llm.classify(tokens(PROMPTS), use_tqdm=False)
    for prompt, out in zip(PROMPTS, outputs):
        assert isinstance(out, ClassificationRequestOutput) and out.prompt_token_ids == prompt
        assert out.outputs.num_classes == (2 if name == "qwen3" else 3)
        expected = torch.softmax(hf_logits(classifiers[name], prompt), dim=-1)
        torch.testing.assert_close(torch.tensor(out.outputs.probs), expected, atol=1e-5, rtol=0)
    assert_all_blocks_free(llm)


def test_use_activation_false_gives_the_logits(classifiers):
    llm = LLM(classifiers["qwen2"], runner="pooling", **SETTINGS)
    [out] = llm.classify(tokens(PROMPTS[:1]), PoolingParams(use_activation=False), use_tqdm=False)
    torch.testing.assert_close(torch.tensor(out.outputs.probs), hf_logits(classifiers["qwen2"], PROMPTS[0]),
                               atol=1e-5, rtol=0)


def test_one_label_classifies_with_sigmoid_and_regression_with_none(classifiers, tmp_path):
    llm = LLM(classifiers["cross"], runner="pooling", **SETTINGS)
    [out] = llm.classify(tokens(PROMPTS[:1]), use_tqdm=False)
    torch.testing.assert_close(torch.tensor(out.outputs.probs),
                               torch.sigmoid(hf_logits(classifiers["cross"], PROMPTS[0])), atol=1e-5, rtol=0)
    folder = tmp_path / "regression"
    shutil.copytree(classifiers["qwen2"], folder)
    config = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**config, "problem_type": "regression"}))
    [raw] = LLM(str(folder), runner="pooling", **SETTINGS).classify(tokens(PROMPTS[:1]), use_tqdm=False)
    torch.testing.assert_close(torch.tensor(raw.outputs.probs), hf_logits(classifiers["qwen2"], PROMPTS[0]),
                               atol=1e-5, rtol=0)


# ---- reward ------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("budget", [None, 5])
def test_reward_is_every_tokens_score_as_transformers_computes_it(classifiers, budget):
    llm = LLM(classifiers["cross"], runner="pooling", **SETTINGS, max_num_batched_tokens=budget)
    outputs = llm.reward(tokens(PROMPTS), use_tqdm=False)
    for prompt, out in zip(PROMPTS, outputs):
        assert isinstance(out, PoolingRequestOutput) and out.outputs.data.shape == (len(prompt), 1)
        logits = hf_token_logits(classifiers["cross"], prompt)
        torch.testing.assert_close(out.outputs.data, torch.sigmoid(logits), atol=1e-5, rtol=0)
        # its last row is the sequence's score: transformers' own logits for the sequence
        torch.testing.assert_close(logits[-1], hf_logits(classifiers["cross"], prompt), atol=1e-5, rtol=0)
    [raw] = llm.reward(tokens(PROMPTS[:1]), PoolingParams(use_activation=False), use_tqdm=False)
    torch.testing.assert_close(raw.outputs.data, hf_token_logits(classifiers["cross"], PROMPTS[0]), atol=1e-5, rtol=0)
    assert_all_blocks_free(llm)


def test_reward_after_a_cached_prefix_still_has_every_row(cross, classifiers):
    """A token task needs every position's hidden state: its prompt never reads the prefix cache."""
    prompt = list(range(200, 240))
    [first] = cross.classify(tokens([prompt]), use_tqdm=False)
    [again] = cross.classify(tokens([prompt]), use_tqdm=False)
    assert again.num_cached_tokens > 0                           # classify (LAST) does use the cache
    [out] = cross.reward(tokens([prompt]), use_tqdm=False)
    assert out.num_cached_tokens == 0 and out.outputs.data.shape == (40, 1)
    torch.testing.assert_close(out.outputs.data, torch.sigmoid(hf_token_logits(classifiers["cross"], prompt)),
                               atol=1e-5, rtol=0)
    assert_all_blocks_free(cross)


# ---- score -------------------------------------------------------------------------------------------------
def test_cross_encoder_score_is_sigmoid_of_transformers_on_the_pair_encoding(cross, classifiers):
    tokenizer = cross.get_tokenizer()
    query, documents = "what is a cat", ["a cat is an animal", "the sky is blue", "cats purr"]

    def expected(a, b):
        ids = tokenizer(text=a, text_pair=b)["input_ids"]
        return ids, torch.sigmoid(hf_logits(classifiers["cross"], ids)).item()

    one_to_n = cross.score(query, documents, use_tqdm=False)
    n_to_n = cross.score([query, "blue", "purr"], documents, use_tqdm=False)
    one_to_one = cross.score([query], documents[0], use_tqdm=False)
    assert len(one_to_n) == len(n_to_n) == 3 and len(one_to_one) == 1
    for outputs, firsts in ((one_to_n, [query] * 3), (n_to_n, [query, "blue", "purr"]), (one_to_one, [query])):
        for out, a, b in zip(outputs, firsts, documents):
            ids, score = expected(a, b)
            assert isinstance(out, ScoringRequestOutput) and out.prompt_token_ids == ids
            assert abs(out.outputs.score - score) < 1e-5
    assert_all_blocks_free(cross)


def test_embedding_model_score_is_the_cosine_of_the_embeddings(tiny_model_dirs):
    llm = LLM(tiny_model_dirs["llama"], runner="pooling", **SETTINGS)
    texts = ["Hello world", "The quick brown fox", "a"]
    embeddings = [torch.tensor(o.outputs.embedding) for o in llm.embed(texts, use_tqdm=False)]
    outputs = llm.score(texts[0], texts[1:], use_tqdm=False)
    pad = llm.get_tokenizer().pad_token_id
    for out, text, other in zip(outputs, texts[1:], embeddings[1:]):
        expected = torch.nn.functional.cosine_similarity(embeddings[0], other, dim=0).item()
        assert abs(out.outputs.score - expected) < 1e-5
        ids = llm.get_tokenizer().encode(texts[0]) + [pad] + llm.get_tokenizer().encode(text)
        assert out.prompt_token_ids == ids
    assert_all_blocks_free(llm)


@pytest.mark.parametrize("data_1, data_2, message", [
    (["a", "b"], ["c", "d", "e"], "data_1 has 2 texts and data_2 3"),
    ([], ["c"], "data_1 must be a text"), ("a", [], "data_2 must be a text"), ("a", [5], "data_2 must be a text"),
])
def test_score_inputs_must_pair_1_to_1_1_to_n_or_n_to_n(cross, data_1, data_2, message):
    with pytest.raises(ValueError, match=message):
        cross.score(data_1, data_2, use_tqdm=False)


# ---- encode ------------------------------------------------------------------------------------------------
def test_encode_token_embed_normalises_every_row(tiny_model_dirs):
    from transformers import AutoModelForCausalLM
    llm = LLM(tiny_model_dirs["llama"], runner="pooling", **SETTINGS, max_num_batched_tokens=8)
    [out] = llm.encode(tokens(PROMPTS[:1]), pooling_task="token_embed", use_tqdm=False)
    with torch.no_grad():
        hidden = AutoModelForCausalLM.from_pretrained(tiny_model_dirs["llama"], dtype=torch.float32).model(
            torch.tensor([PROMPTS[0]])).last_hidden_state[0]
    torch.testing.assert_close(out.outputs.data, torch.nn.functional.normalize(hidden, dim=-1), atol=1e-5, rtol=0)


# ---- refused by name ---------------------------------------------------------------------------------------
def test_a_generating_llm_refuses_every_pooling_call_naming_the_runner(tiny_model_dirs):
    llm = LLM(tiny_model_dirs["llama"], **SETTINGS)
    for call in (lambda: llm.classify(["a"]), lambda: llm.reward(["a"]), lambda: llm.score("a", "b"),
                 lambda: llm.encode(["a"])):
        with pytest.raises(ValueError, match="runner='generate'"):
            call()


def test_a_classifier_runs_with_runner_pooling_only(classifiers):
    with pytest.raises(ValueError, match="Qwen2ForSequenceClassification is a sequence-classification model.*"
                                         "runner='pooling' only"):
        LLM(classifiers["qwen2"], **SETTINGS)                  # the default runner: generate
    assert LLM(classifiers["qwen2"], runner="auto", **SETTINGS).llm_engine.config.runner == "pooling"   # as vLLM
    for task in ("classify", "score", "reward"):                 # vLLM's older way to say it
        assert LLM(classifiers["qwen2"], task=task, **SETTINGS).llm_engine.config.runner == "pooling"


def test_an_embedding_model_refuses_the_classifier_tasks_by_name(tiny_model_dirs):
    llm = LLM(tiny_model_dirs["llama"], runner="pooling", **SETTINGS)
    with pytest.raises(ValueError, match="task='classify' needs a sequence-classification model"):
        llm.classify(["a"], use_tqdm=False)
    with pytest.raises(ValueError, match="task='token_classify' needs a sequence-classification model"):
        llm.reward(["a"], use_tqdm=False)
    assert_all_blocks_free(llm)


def test_a_classifier_refuses_embed_and_more_labels_refuse_score(classifiers, cross):
    with pytest.raises(ValueError, match="task='embed' needs an embedding model"):
        cross.embed(["a"], use_tqdm=False)
    llm = LLM(classifiers["qwen2"], runner="pooling", **SETTINGS)
    with pytest.raises(ValueError, match="num_labels=3"):
        llm.score("a", "b", use_tqdm=False)
    assert_all_blocks_free(llm)


@pytest.mark.parametrize("params, message", [
    (PoolingParams(normalize=True), r"task='classify' takes \['use_activation'\] only, not \['normalize'\]"),
    (PoolingParams(task="embed"), r"PoolingParams\(task='embed'\) cannot run as task='classify'"),
])
def test_pooling_params_of_another_task_are_refused(cross, params, message):
    with pytest.raises(ValueError, match=message):
        cross.classify(["a"], params, use_tqdm=False)
