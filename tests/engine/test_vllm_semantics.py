"""Where nanopaged follows vLLM V1 to the letter: logprob reporting, the stop rules, the
prefix cache's bookkeeping, and prompt logprobs (checked against Hugging Face's logits)."""
import math

import pytest
import torch

from conftest import make_prompts
from nanopaged import LLM, SamplingParams
from nanopaged.core.block_pool import BlockPool


@pytest.fixture(scope="module")
def llm(tiny_model_dirs):
    return LLM(tiny_model_dirs["llama"], dtype="float32", num_kv_blocks=128)


def greedy_run(llm, prompt, n=30):
    out = llm.generate({"prompt_token_ids": prompt}, SamplingParams(temperature=0, max_tokens=n, ignore_eos=True),
                       use_tqdm=False)[0].outputs[0]
    tok = llm.get_tokenizer()
    texts = [tok.decode(out.token_ids[:i]) for i in range(n + 1)]    # texts[i]: the first i tokens' text
    return out, texts


def test_cumulative_logprob_only_when_logprobs_are_asked_for(llm):
    prompt = {"prompt_token_ids": [5, 6, 7]}
    plain = llm.generate(prompt, SamplingParams(temperature=0, max_tokens=3), use_tqdm=False)[0].outputs[0]
    asked = llm.generate(prompt, SamplingParams(temperature=0, max_tokens=3, logprobs=0), use_tqdm=False)[0].outputs[0]
    assert plain.cumulative_logprob is None and plain.logprobs is None
    assert isinstance(asked.cumulative_logprob, float) and asked.cumulative_logprob < 0
    assert math.isclose(asked.cumulative_logprob, sum(d[t].logprob for d, t in zip(asked.logprobs, asked.token_ids)),
                        abs_tol=1e-5)


def first_new_text(texts):
    """(m, s): token m (1-based) adds text s that appears nowhere in the text before it."""
    for m in range(2, len(texts)):
        new = texts[m][len(texts[m - 1]):]
        if new.strip() and texts[m].find(new) == len(texts[m - 1]):
            return m, new
    pytest.skip("no token adds fresh text: pick another prompt")


def test_a_stop_string_ends_the_output_only_after_min_tokens(llm):
    """vLLM checks stop strings once more than min_tokens tokens are out, as EOS can come
    at token min_tokens + 1 at the earliest; a stop string completed by token min_tokens
    does not count."""
    prompt = make_prompts(512, n=1, seed=70)[0]
    full, texts = greedy_run(llm, prompt)
    m, stop = first_new_text(texts)
    run = lambda min_tokens: llm.generate(   # noqa: E731
        {"prompt_token_ids": prompt}, SamplingParams(temperature=0, max_tokens=30, ignore_eos=True, stop=[stop],
                                                     min_tokens=min_tokens), use_tqdm=False)[0].outputs[0]
    early = run(m - 1)
    assert early.finish_reason == "stop" and len(early.token_ids) == m and early.text == texts[m - 1]
    late = run(m)
    assert len(late.token_ids) > m                     # token m completed it, but min_tokens = m: go on


def test_of_two_stop_strings_completed_in_one_step_the_earlier_match_wins(llm):
    """Token m's text holds two stop strings ending at different places: the one that ends
    first cuts the text, whatever their order in the list."""
    prompt = make_prompts(512, n=1, seed=71)[0]
    full, texts = greedy_run(llm, prompt)
    for m in range(2, len(texts)):
        new = texts[m][len(texts[m - 1]):]
        if len(new) >= 2 and texts[m].find(new[0]) == len(texts[m - 1]):   # new[0] is fresh here
            break
    else:
        pytest.skip("no token adds two fresh characters: pick another prompt")
    short, long = new[0], new              # both complete in step m; `short` ends first
    for stops in ([long, short], [short, long]):
        c = llm.generate({"prompt_token_ids": prompt}, SamplingParams(temperature=0, max_tokens=30, stop=stops,
                                                                       ignore_eos=True), use_tqdm=False)[0].outputs[0]
        assert c.stop_reason == short and c.text == texts[m - 1] and len(c.token_ids) == m


def test_a_second_block_with_the_same_prefix_keeps_it_cached_when_the_first_is_evicted():
    pool = BlockPool(num_blocks=3, block_size=4, enable_caching=True)
    a, b = pool.allocate(2)
    pool.cache_block(a, b"prefix")
    pool.cache_block(b, b"prefix")         # the same tokens computed twice (two requests at once)
    pool.free([a])
    pool.free([b])
    assert pool.cached_block_hash_to_block[b"prefix"] == [a, b]
    pool.allocate(2)                       # takes the never-used block, then a: a's copy is evicted
    assert pool.find_cached_blocks([b"prefix"]) == [b]
    pool.check_invariants()


# ---- prompt logprobs --------------------------------------------------------------------
def hf_prompt_logprobs(model_dir, prompt):
    from transformers import AutoModelForCausalLM
    hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    with torch.no_grad():
        logits = hf(torch.tensor([prompt])).logits[0]
    return torch.log_softmax(logits, -1)          # row p scores token p + 1


def check_prompt_logprobs(out, prompt, ref, k):
    entries = out.prompt_logprobs
    assert len(entries) == len(prompt) and entries[0] is None
    for p in range(1, len(prompt)):
        entry, row = entries[p], ref[p - 1]
        token = prompt[p]
        assert token in entry and len(entry) in (k, k + 1)
        assert math.isclose(entry[token].logprob, row[token].item(), abs_tol=1e-4)
        assert entry[token].rank == int((row > row[token]).sum()) + 1
        assert set(row.topk(k).indices.tolist()) <= set(entry)


@pytest.mark.parametrize("settings", [{}, {"max_num_batched_tokens": 8}, {"num_kv_blocks": 5, "block_size": 8}],
                         ids=["one_step", "chunked_prefill", "preemption"])
def test_prompt_logprobs_equal_hugging_face(tiny_model_dirs, settings):
    prompts = make_prompts(512, n=3, seed=72, min_len=12, max_len=30)
    llm = LLM(tiny_model_dirs["llama"], dtype="float32", **{"num_kv_blocks": 64, **settings})
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True, prompt_logprobs=3)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    if "num_kv_blocks" in settings:
        assert llm.get_stats()["num_preemptions"] > 0          # prompts recomputed: no entry twice
    for out, prompt in zip(outs, prompts):
        check_prompt_logprobs(out, prompt, hf_prompt_logprobs(tiny_model_dirs["llama"], prompt), 3)


def test_prompt_logprobs_recompute_what_the_prefix_cache_holds(tiny_model_dirs):
    prompt = make_prompts(512, n=1, seed=73, min_len=40, max_len=40)[0]
    llm = LLM(tiny_model_dirs["llama"], dtype="float32", num_kv_blocks=64)
    plain = SamplingParams(temperature=0, max_tokens=2)
    llm.generate({"prompt_token_ids": prompt}, plain, use_tqdm=False)
    assert llm.generate({"prompt_token_ids": prompt}, plain, use_tqdm=False)[0].num_cached_tokens == 32
    out = llm.generate({"prompt_token_ids": prompt}, SamplingParams(temperature=0, max_tokens=2, prompt_logprobs=1),
                       use_tqdm=False)[0]
    assert out.num_cached_tokens == 0                          # cached K/V has no logits: computed again
    check_prompt_logprobs(out, prompt, hf_prompt_logprobs(tiny_model_dirs["llama"], prompt), 1)
    assert llm.generate({"prompt_token_ids": prompt}, plain, use_tqdm=False)[0].prompt_logprobs is None
