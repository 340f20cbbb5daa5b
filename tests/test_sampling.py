"""Sampling and sharing: vLLM's SamplingParams, the vectorised sampler, stop rules, n > 1 by fork."""
import math

import pytest
import torch

from conftest import EOS_TOKEN_ID, make_prompts
from nanopaged import LLM, SamplingParams
from nanopaged.core.block_pool import cdiv
from nanopaged.core.request import Request
from nanopaged.sampler import Sampler, apply_penalties, top_k_top_p_min_p


@pytest.fixture(scope="module")
def llm(tiny_model_dirs):
    return LLM(tiny_model_dirs["llama"], num_kv_blocks=200)


def ids(prompt):
    return {"prompt_token_ids": prompt}


def toks(outs):
    return [c.token_ids for o in outs for c in o.outputs]


# ---- the sampler on its own -------------------------------------------------------
def test_top_k_top_p_min_p_keep_the_right_tokens():
    probs = torch.tensor([[0.5, 0.3, 0.15, 0.05]] * 4)
    kept = top_k_top_p_min_p(probs, top_k=[2, 0, 0, 0], top_p=[1.0, 0.7, 1.0, 1.0],
                             min_p=[0.0, 0.0, 0.5, 0.0]) > 0
    assert kept.tolist() == [
        [True, True, False, False],     # top_k=2
        [True, True, False, False],     # top_p=0.7: 0.5 + 0.3 reaches it
        [True, True, False, False],     # min_p=0.5: drop below 0.25
        [True, True, True, True],       # no rule
    ]


def test_penalties_match_a_naive_loop():
    torch.manual_seed(0)
    logits = torch.randn(2, 10)
    reqs = [Request("a", [1, 2], SamplingParams(repetition_penalty=1.3, presence_penalty=0.5,
                                                frequency_penalty=0.25), 5, output_token_ids=[3, 3, 1]),
            Request("b", [4], SamplingParams(), 5, output_token_ids=[4])]
    got = apply_penalties(logits.clone(), reqs)
    want = logits.clone()
    for t in {1, 2, 3}:                                  # repetition: prompt + output tokens
        want[0, t] = want[0, t] / 1.3 if want[0, t] > 0 else want[0, t] * 1.3
    want[0, 3] -= 0.25 * 2 + 0.5                         # frequency x count + presence
    want[0, 1] -= 0.25 * 1 + 0.5
    assert torch.allclose(got, want)
    assert torch.equal(got[1], logits[1])                # a row without penalties is untouched


def test_exponential_race_samples_from_the_distribution():
    sampler = Sampler(torch.device("cpu"), seed=0)
    probs = torch.tensor([0.6, 0.3, 0.1])
    r = Request("x", [1], SamplingParams(temperature=1.0), 5)
    counts = torch.zeros(3)
    logits = probs.log()[None].repeat(2000, 1)
    res = sampler(logits, [r] * 2000)
    for t in res.token_ids:
        counts[t] += 1
    assert torch.allclose(counts / 2000, probs, atol=0.04)


# ---- end to end -----------------------------------------------------------------------
def test_top_k_1_top_p_tiny_and_min_p_1_are_greedy(llm):
    prompts = [ids(p) for p in make_prompts(512, n=4, seed=20)]
    greedy = toks(llm.generate(prompts, SamplingParams(temperature=0, max_tokens=8), use_tqdm=False))
    for kw in ({"top_k": 1}, {"top_p": 1e-6}, {"min_p": 1.0}):
        got = toks(llm.generate(prompts, SamplingParams(temperature=0.9, max_tokens=8, seed=3, **kw),
                                use_tqdm=False))
        assert got == greedy, kw


def test_seeded_output_is_the_same_with_and_without_preemption(tiny_model_dirs):
    prompts = [ids(p) for p in make_prompts(512, n=8, seed=21)]
    params = [SamplingParams(temperature=1.0, top_p=0.9, max_tokens=20, seed=100 + i, ignore_eos=True)
              for i in range(8)]
    roomy = LLM(tiny_model_dirs["qwen2"], num_kv_blocks=200)
    tight = LLM(tiny_model_dirs["qwen2"], num_kv_blocks=10, block_size=8)
    a = toks(roomy.generate(prompts, params, use_tqdm=False))
    b = toks(tight.generate(prompts, params, use_tqdm=False))
    assert tight.get_stats()["num_preemptions"] > 0
    assert a == b


def test_stop_string_spanning_tokens_cuts_the_text(llm):
    prompt = ids(make_prompts(512, n=1, seed=22)[0])
    full = llm.generate(prompt, SamplingParams(temperature=0, max_tokens=30, ignore_eos=True),
                        use_tqdm=False)[0].outputs[0]
    # a stop string made of the end of token 3's text and the start of token 4's
    tok = llm.get_tokenizer()
    before = tok.decode(full.token_ids[:3])
    upto4 = tok.decode(full.token_ids[:4])
    assert len(upto4) > len(before) >= 1
    stop = before[-1:] + upto4[len(before):]
    start = full.text.find(stop)
    for include in (False, True):
        c = llm.generate(prompt, SamplingParams(temperature=0, max_tokens=30, stop=[stop], ignore_eos=True,
                                                include_stop_str_in_output=include),
                         use_tqdm=False)[0].outputs[0]
        assert c.finish_reason == "stop" and c.stop_reason == stop
        assert c.text == full.text[:start + (len(stop) if include else 0)]
        assert c.token_ids == full.token_ids[:len(c.token_ids)]


def test_stop_token_ids_and_min_tokens(llm):
    prompt = ids(make_prompts(512, n=1, seed=23)[0])
    full = llm.generate(prompt, SamplingParams(temperature=0, max_tokens=30, ignore_eos=True),
                        use_tqdm=False)[0].outputs[0]
    stop_id = full.token_ids[4]
    first = full.token_ids.index(stop_id)
    c = llm.generate(prompt, SamplingParams(temperature=0, max_tokens=30, stop_token_ids=[stop_id]),
                     use_tqdm=False)[0].outputs[0]
    assert c.token_ids == full.token_ids[:first + 1]
    assert c.finish_reason == "stop" and c.stop_reason == stop_id
    assert c.text == llm.get_tokenizer().decode(full.token_ids[:first])   # the stop token is not in the text
    # min_tokens: the stop token cannot be drawn before 10 tokens exist
    m = llm.generate(prompt, SamplingParams(temperature=0, max_tokens=30, stop_token_ids=[stop_id],
                                            min_tokens=10), use_tqdm=False)[0].outputs[0]
    assert len(m.token_ids) > 10 and stop_id not in m.token_ids[:10]


def test_logprobs_report_the_chosen_token_and_the_top_k(llm, tiny_model_dirs):
    prompt = make_prompts(512, n=1, seed=24)[0]
    c = llm.generate(ids(prompt), SamplingParams(temperature=0, max_tokens=5, logprobs=3, ignore_eos=True),
                     use_tqdm=False)[0].outputs[0]
    assert len(c.logprobs) == 5
    from transformers import AutoModelForCausalLM
    hf = AutoModelForCausalLM.from_pretrained(tiny_model_dirs["llama"], dtype=torch.float32)
    with torch.no_grad():
        logits = hf(torch.tensor([prompt + c.token_ids])).logits[0, len(prompt) - 1:-1]
    ref = torch.log_softmax(logits, -1)
    total = 0.0
    for step, (token, entry) in enumerate(zip(c.token_ids, c.logprobs)):
        assert entry[token].rank == 1                      # greedy: the chosen token is the best
        assert len(entry) == 3
        top3 = ref[step].topk(3).indices.tolist()
        assert sorted(entry) == sorted(top3)
        for t, lp in entry.items():
            assert math.isclose(lp.logprob, ref[step, t].item(), abs_tol=1e-4)
        total += ref[step, token].item()
    assert math.isclose(c.cumulative_logprob, total, abs_tol=1e-3)


# ---- n > 1: fork and copy-on-write -------------------------------------------------------
def test_greedy_samples_are_identical_and_equal_hugging_face(tiny_model_dirs, hf_greedy):
    """If a copy-on-write copy were missing or wrong, forked samples would diverge."""
    prompts = make_prompts(512, n=4, seed=25, min_len=5, max_len=40)
    expected = hf_greedy(tiny_model_dirs["qwen3"], prompts, 12)
    llm = LLM(tiny_model_dirs["qwen3"], block_size=8, num_kv_blocks=40)
    outs = llm.generate([ids(p) for p in prompts], SamplingParams(n=3, temperature=0, max_tokens=12),
                        use_tqdm=False)
    for o, want in zip(outs, expected):
        assert [c.index for c in o.outputs] == [0, 1, 2]
        assert all(c.token_ids == want for c in o.outputs)


def test_n4_peak_blocks_are_what_the_arithmetic_predicts(tiny_model_dirs):
    """200-token prompt, 16 output tokens, block size 16, prefix caching off."""
    prompt, n, out_len, bs = [7] * 200, 4, 16, 16
    params = SamplingParams(n=n, temperature=1.0, seed=0, max_tokens=out_len, ignore_eos=True)
    forked = LLM(tiny_model_dirs["llama"], num_kv_blocks=100, enable_prefix_caching=False)
    forked.generate(ids(prompt), params, use_tqdm=False)
    separate = LLM(tiny_model_dirs["llama"], num_kv_blocks=100, enable_prefix_caching=False)
    separate.generate([ids(prompt)] * n, SamplingParams(temperature=1.0, seed=0, max_tokens=out_len,
                                                        ignore_eos=True), use_tqdm=False)
    per_seq = cdiv(len(prompt) + out_len - 1, bs)          # 14 blocks hold 215 tokens
    shared = len(prompt) // bs                             # 12 full prompt blocks, never copied
    assert separate.get_stats()["peak_kv_blocks_used"] == n * per_seq            # 56
    assert forked.get_stats()["peak_kv_blocks_used"] == shared + n * (per_seq - shared)  # 20
    assert forked.get_stats()["peak_kv_blocks_used"] <= n * per_seq / 2
    # the time-averaged saving the bench reports: positive with forks, zero without sharing
    assert forked.get_stats()["kv_sharing_saving"] > 0.5
    assert separate.get_stats()["kv_sharing_saving"] == 0.0


def test_seeded_n4_is_reproducible_and_the_samples_differ(tiny_model_dirs):
    params = SamplingParams(n=4, temperature=1.0, seed=7, max_tokens=16, ignore_eos=True)
    prompt = ids(make_prompts(512, n=1, seed=26)[0])
    a = LLM(tiny_model_dirs["llama"], num_kv_blocks=64).generate(prompt, params, use_tqdm=False)[0]
    b = LLM(tiny_model_dirs["llama"], num_kv_blocks=12, block_size=8).generate(prompt, params, use_tqdm=False)[0]
    assert [c.token_ids for c in a.outputs] == [c.token_ids for c in b.outputs]
    assert len({tuple(c.token_ids) for c in a.outputs}) == 4
    assert a.finished and all(c.finish_reason == "length" for c in a.outputs)


def test_fork_with_preemption_and_prefix_cache_keeps_greedy_outputs(tiny_model_dirs, hf_greedy):
    prompts = make_prompts(512, n=6, seed=27, min_len=10, max_len=50)
    expected = hf_greedy(tiny_model_dirs["llama"], prompts, 16)
    llm = LLM(tiny_model_dirs["llama"], block_size=8, num_kv_blocks=24, max_num_seqs=8)
    outs = llm.generate([ids(p) for p in prompts] * 2, SamplingParams(n=2, temperature=0, max_tokens=16),
                        use_tqdm=False)
    assert llm.get_stats()["num_preemptions"] > 0
    for o, want in zip(outs, expected * 2):
        assert [c.token_ids for c in o.outputs] == [want, want]
    assert llm.get_stats()["kv_cache_usage"] == 0.0


def test_stop_string_completed_by_the_last_allowed_token_is_a_stop(llm):
    prompt = ids(make_prompts(512, n=1, seed=28)[0])
    full = llm.generate(prompt, SamplingParams(temperature=0, max_tokens=6, ignore_eos=True),
                        use_tqdm=False)[0].outputs[0]
    last_text = llm.get_tokenizer().decode(full.token_ids)[-1:]
    assert last_text and last_text not in full.text[:-1]
    c = llm.generate(prompt, SamplingParams(temperature=0, max_tokens=6, stop=[last_text], ignore_eos=True),
                     use_tqdm=False)[0].outputs[0]
    assert c.finish_reason == "stop" and c.stop_reason == last_text and c.text == full.text[:-1]
