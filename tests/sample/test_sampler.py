"""Sampling and sharing: vLLM's SamplingParams, the vectorised sampler, stop rules, n > 1 by fork."""
import math

import pytest
import torch

from conftest import EOS_TOKEN_ID, make_prompts
from nanopaged import LLM, SamplingParams
from nanopaged.core.block_pool import cdiv
from nanopaged.core.request import Request
from nanopaged.sample.logits_processors import apply_penalties, apply_token_rules, block_stop_tokens
from nanopaged.sample.sampler import Sampler, top_k_top_p_min_p, top_logprobs


@pytest.fixture(scope="module")
def llm(tiny_model_dirs):
    return LLM(tiny_model_dirs["llama"], dtype="float32", num_kv_blocks=200)


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



def test_top_p_and_min_p_at_their_exact_boundaries():
    """top-p keeps the smallest set whose mass reaches p; min-p drops only what is strictly below
    min_p x the best probability (vLLM's rules; binary fractions make the boundaries exact)."""
    probs = torch.tensor([[0.5, 0.25, 0.125, 0.125]] * 3)
    kept = top_k_top_p_min_p(probs, top_k=[0, 0, 0], top_p=[0.5, 0.75, 1.0],
                             min_p=[0.0, 0.0, 0.5]) > 0
    assert kept.tolist() == [
        [True, False, False, False],     # 0.5 already reaches top_p=0.5
        [True, True, False, False],      # 0.5 + 0.25 reaches 0.75
        [True, True, False, False],      # 0.25 == 0.5 x 0.5 stays, 0.125 goes
    ]


def test_each_penalty_on_hand_computed_logits():
    """Repetition divides a positive logit and multiplies a negative one, for every token seen
    in the prompt or the output (even once); presence and frequency count output tokens only."""
    logits = torch.tensor([[0.5, 2.0, -1.0, 0.8, 0.0, 1.5]])
    r = Request("a", [0, 2], SamplingParams(repetition_penalty=2.0, presence_penalty=0.5,
                                            frequency_penalty=0.25), 5, output_token_ids=[1, 3, 3])
    got = apply_penalties(logits, [r])
    want = [0.5 / 2,                     # prompt token, 0 < logit < 1
            2.0 / 2 - 0.25 - 0.5,        # output once
            -1.0 * 2,                    # prompt token, negative logit
            0.8 / 2 - 0.25 * 2 - 0.5,    # output twice
            0.0, 1.5]                    # never seen: untouched
    assert torch.allclose(got, torch.tensor([want]))


def test_min_tokens_blocks_eos_and_stop_ids_of_every_row_until_it_is_reached():
    def request(n_out, **kw):
        return Request("r", [1], SamplingParams(stop_token_ids=[4], **kw), 20,
                       eos_token_ids=frozenset({2, 3}), output_token_ids=[7] * n_out)
    reqs = [request(0, min_tokens=2),                  # blocked: EOS 2, 3 and stop id 4
            request(1, min_tokens=2),                  # blocked too (the other row's entries stay)
            request(2, min_tokens=2),                  # reached min_tokens: nothing blocked
            request(0, min_tokens=2, ignore_eos=True)]  # ignore_eos: EOS is an ordinary token
    blocked = block_stop_tokens(torch.zeros(4, 6), reqs) == float("-inf")
    assert blocked.tolist() == [
        [False, False, True, True, True, False],
        [False, False, True, True, True, False],
        [False] * 6,
        [False, False, False, False, True, False],
    ]


def test_token_rules_allowed_ids_bad_words_and_logit_bias_on_hand_made_rows():
    """allowed_token_ids keeps only its tokens; a bad word's last token is blocked only when the
    output ends with the word's other tokens (a one-token word: always); logit_bias adds."""
    def request(out, **kw):
        params = SamplingParams(**{k: v for k, v in kw.items() if k != "words"})
        params.bad_words_token_ids = kw.get("words")        # as the input processor tokenizes them
        return Request("r", [1], params, 20, output_token_ids=out)
    reqs = [request([], allowed_token_ids=[1, 4]),
            request([3, 5], words=[[5, 2], [4], [3, 3, 1]]),   # ends with 5: block 2; 4 always; [3, 3] is not the end
            request([5], words=[[9, 5, 2]]),                   # the output is too short to end with [9, 5]
            request([], logit_bias={0: 1.5, 5: -2.0}),
            request([])]
    got = apply_token_rules(torch.zeros(5, 6), reqs)
    inf = float("-inf")
    assert got.tolist() == [
        [inf, 0.0, inf, inf, 0.0, inf],
        [0.0, 0.0, inf, 0.0, inf, 0.0],
        [0.0] * 6,
        [1.5, 0.0, 0.0, 0.0, 0.0, -2.0],
        [0.0] * 6,
    ]


def test_logit_bias_comes_before_the_repetition_penalty_as_in_vllm():
    r = Request("a", [3], SamplingParams(repetition_penalty=2.0, logit_bias={3: 1.0}), 5)
    r.sampling_params.temperature = 0.0
    out = Sampler(torch.device("cpu"), seed=0)(torch.tensor([[0.0, 0.0, 0.0, 1.0, 0.0, 0.0]]), [r])
    assert out.token_ids == [3]                             # (1 + 1) / 2 = 1.0 > 0: still the best
    r.sampling_params.logit_bias = {3: 1.0, 4: 1.1}         # 1.1 beats (1 + 1) / 2
    assert Sampler(torch.device("cpu"), seed=0)(torch.tensor([[0.0, 0.0, 0.0, 1.0, 0.0, 0.0]]), [r]).token_ids == [4]


def test_a_seeded_request_draws_from_one_generator_across_steps():
    """Its generator is made once and advances every step (not re-seeded each step, which
    would repeat the same draw), and is dropped when the request is forgotten."""
    logits = torch.zeros(1, 8)                           # uniform: every draw is the noise
    r = Request("s", [1], SamplingParams(temperature=1.0, seed=7), 20)

    def draws(sampler):
        return [sampler(logits, [r]).token_ids[0] for _ in range(12)]
    first = draws(sampler := Sampler(torch.device("cpu"), seed=0))
    assert len(set(first)) > 1
    assert draws(Sampler(torch.device("cpu"), seed=1)) == first     # the request's seed, not the engine's
    sampler.forget(r)
    assert sampler.request_generators == {}


def test_top_logprobs_lists_the_chosen_token_then_the_best_others_with_ranks():
    logprobs = torch.tensor([[-0.5, -1.0, -2.0, -3.0]] * 3)
    got = top_logprobs(logprobs, torch.tensor([1, 3, 2]), [2, None, 0])
    assert got == [
        [(1, -1.0, 2), (0, -0.5, 1)],      # the chosen token is among the best two: listed once
        None,                               # this row did not ask
        [(2, -2.0, 3)],                     # logprobs=0: only the chosen token
    ]

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
    roomy = LLM(tiny_model_dirs["qwen2"], dtype="float32", num_kv_blocks=200)
    tight = LLM(tiny_model_dirs["qwen2"], dtype="float32", num_kv_blocks=10, block_size=8)
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
    llm = LLM(tiny_model_dirs["qwen3"], dtype="float32", block_size=8, num_kv_blocks=40)
    outs = llm.generate([ids(p) for p in prompts], SamplingParams(n=3, temperature=0, max_tokens=12),
                        use_tqdm=False)
    for o, want in zip(outs, expected):
        assert [c.index for c in o.outputs] == [0, 1, 2]
        assert all(c.token_ids == want for c in o.outputs)


def test_n4_peak_blocks_are_what_the_arithmetic_predicts(tiny_model_dirs):
    """200-token prompt, 16 output tokens, block size 16, prefix caching off."""
    prompt, n, out_len, bs = [7] * 200, 4, 16, 16
    params = SamplingParams(n=n, temperature=1.0, seed=0, max_tokens=out_len, ignore_eos=True)
    forked = LLM(tiny_model_dirs["llama"], dtype="float32", num_kv_blocks=100, enable_prefix_caching=False)
    forked.generate(ids(prompt), params, use_tqdm=False)
    separate = LLM(tiny_model_dirs["llama"], dtype="float32", num_kv_blocks=100, enable_prefix_caching=False)
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
    a = LLM(tiny_model_dirs["llama"], dtype="float32", num_kv_blocks=64).generate(prompt, params, use_tqdm=False)[0]
    b = LLM(tiny_model_dirs["llama"], dtype="float32", num_kv_blocks=12, block_size=8).generate(prompt, params, use_tqdm=False)[0]
    assert [c.token_ids for c in a.outputs] == [c.token_ids for c in b.outputs]
    assert len({tuple(c.token_ids) for c in a.outputs}) == 4
    assert a.finished and all(c.finish_reason == "length" for c in a.outputs)


def test_fork_with_preemption_and_prefix_cache_keeps_greedy_outputs(tiny_model_dirs, hf_greedy):
    prompts = make_prompts(512, n=6, seed=27, min_len=10, max_len=50)
    expected = hf_greedy(tiny_model_dirs["llama"], prompts, 16)
    llm = LLM(tiny_model_dirs["llama"], dtype="float32", block_size=8, num_kv_blocks=24, max_num_seqs=8)
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


# ---- what each rule does, pinned -----------------------------------------------------------
def test_two_requests_with_the_same_seed_in_one_batch_draw_the_same_tokens(llm):
    """Each request has its own generator: two with seed 5 in one batch do not share one
    (which would give the second the first's next random numbers)."""
    prompt = ids(make_prompts(512, n=1, seed=40)[0])
    seeded = SamplingParams(temperature=1.0, seed=5, max_tokens=12, ignore_eos=True)
    alone = toks(llm.generate(prompt, seeded, use_tqdm=False))[0]
    batch = toks(llm.generate([prompt, prompt, ids([9, 8, 7])],
                              [seeded, seeded, SamplingParams(temperature=1.0, max_tokens=12)], use_tqdm=False))
    assert batch[0] == batch[1] == alone


@pytest.mark.parametrize("temperature", [0.5, 2.0])
def test_temperature_divides_the_logits(temperature):
    """Drawn often enough, tokens come with the frequencies of softmax(logits / T)."""
    sampler = Sampler(torch.device("cpu"), seed=0)
    logits = torch.tensor([2.0, 1.0, 0.0, -1.0])
    r = Request("x", [1], SamplingParams(temperature=temperature), 5)
    drawn = torch.tensor(sampler(logits[None].repeat(4000, 1), [r] * 4000).token_ids)
    freq = torch.bincount(drawn, minlength=4) / 4000
    assert torch.allclose(freq, torch.softmax(logits / temperature, -1), atol=0.03)
    assert not torch.allclose(freq, torch.softmax(logits * temperature, -1), atol=0.03)


def test_reported_logprobs_are_the_raw_distribution_not_the_penalized_one(llm, tiny_model_dirs):
    """Penalties change which token is chosen, not the logprobs reported (vLLM's default)."""
    prompt = make_prompts(512, n=1, seed=41)[0]
    params = SamplingParams(temperature=0, max_tokens=10, logprobs=2, ignore_eos=True,
                            repetition_penalty=1.8, presence_penalty=1.5, frequency_penalty=1.0)
    c = llm.generate(ids(prompt), params, use_tqdm=False)[0].outputs[0]
    plain = llm.generate(ids(prompt), SamplingParams(temperature=0, max_tokens=10, ignore_eos=True),
                         use_tqdm=False)[0].outputs[0]
    assert c.token_ids != plain.token_ids                     # the penalties did change the choice
    from transformers import AutoModelForCausalLM
    hf = AutoModelForCausalLM.from_pretrained(tiny_model_dirs["llama"], dtype=torch.float32)
    with torch.no_grad():
        raw = torch.log_softmax(hf(torch.tensor([prompt + c.token_ids])).logits[0, len(prompt) - 1:-1], -1)
    for step, (token, entry) in enumerate(zip(c.token_ids, c.logprobs)):
        assert math.isclose(entry[token].logprob, raw[step, token].item(), abs_tol=1e-4)
        assert entry[token].rank == int((raw[step] > raw[step, token]).sum()) + 1


@pytest.mark.parametrize("prompt_len", [37, 40])     # the last prompt block partly filled, or full
def test_forked_samples_that_diverge_equal_separate_requests(tiny_model_dirs, prompt_len):
    """n = 4 seeded samples share the prompt's blocks and write their own tokens into copies
    of the partly filled one (copy-on-write); they must equal 4 separate requests with seeds
    seed + i, which share nothing. A missing or wrong copy lets one sample's K/V leak into another's."""
    prompt = ids(make_prompts(512, n=1, seed=42, min_len=prompt_len, max_len=prompt_len)[0])
    forked = LLM(tiny_model_dirs["llama"], dtype="float32", block_size=8, num_kv_blocks=60, enable_prefix_caching=False)
    out = forked.generate(prompt, SamplingParams(n=4, temperature=1.0, seed=11, max_tokens=16, ignore_eos=True),
                          use_tqdm=False)[0]
    separate = LLM(tiny_model_dirs["llama"], dtype="float32", block_size=8, num_kv_blocks=60, enable_prefix_caching=False)
    alone = toks(separate.generate([prompt] * 4, [SamplingParams(temperature=1.0, seed=11 + i, max_tokens=16,
                                                                 ignore_eos=True) for i in range(4)], use_tqdm=False))
    assert [c.token_ids for c in out.outputs] == alone
    assert len({tuple(t) for t in alone}) == 4                # they do diverge
    assert forked.get_stats()["kv_sharing_saving"] > 0


def test_skip_special_tokens_false_keeps_them_in_the_text(llm):
    """A token-selection rule that always picks <|im_start|> (id 1, a special token) shows the
    text with and without special tokens."""
    from nanopaged.core.request import SampledToken
    engine = llm.llm_engine
    engine.add_request("kept", ids([5, 6, 7]), SamplingParams(max_tokens=3, skip_special_tokens=False))
    engine.add_request("skipped", ids([5, 6, 7]), SamplingParams(max_tokens=3))
    finished = {}
    while engine.has_unfinished_requests():
        for o in engine.step(lambda runner_output: {r: [SampledToken(1)] for r in runner_output.requests}):
            finished[o.request_id] = o.outputs[0]
    assert finished["kept"].token_ids == finished["skipped"].token_ids == [1, 1, 1]
    assert finished["kept"].text == "<|im_start|>" * 3 and finished["skipped"].text == ""


def test_the_engine_seed_drives_requests_without_their_own(tiny_model_dirs):
    params = SamplingParams(temperature=1.0, max_tokens=12, ignore_eos=True)
    prompt = ids(make_prompts(512, n=1, seed=44)[0])
    run = lambda seed: toks(LLM(tiny_model_dirs["llama"], dtype="float32", num_kv_blocks=16, seed=seed).generate(  # noqa: E731
        prompt, params, use_tqdm=False))[0]
    assert run(1) == run(1) != run(2)


def test_xxhash_prefix_cache_hits_as_sha256_does(tiny_model_dirs):
    system = make_prompts(512, n=1, seed=45, min_len=40, max_len=40)[0]
    prompts = [ids(system + q) for q in make_prompts(512, n=4, seed=46, min_len=3, max_len=9)]
    results = {}
    for prefix_hash in ("sha256", "xxhash"):
        llm = LLM(tiny_model_dirs["llama"], dtype="float32", num_kv_blocks=64, prefix_hash=prefix_hash)
        outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=6), use_tqdm=False)
        results[prefix_hash] = (toks(outs), [o.num_cached_tokens for o in outs], llm.get_stats()["prefix_cache_hits"])
    assert results["xxhash"] == results["sha256"] and results["sha256"][2] > 0


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_half_precision_end_to_end_on_cpu(tiny_model_dirs, dtype):
    """bf16/fp16 run on CPU too: the first tokens agree with float32 (later ones may flip on near-ties)."""
    prompts = [ids(p) for p in make_prompts(512, n=6, seed=47)]
    greedy = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    full = toks(LLM(tiny_model_dirs["qwen2"], dtype="float32", num_kv_blocks=32).generate(prompts, greedy, use_tqdm=False))
    llm = LLM(tiny_model_dirs["qwen2"], num_kv_blocks=32, dtype=dtype)
    assert llm.llm_engine.runner.kv_cache.dtype == getattr(torch, dtype)
    half = toks(llm.generate(prompts, greedy, use_tqdm=False))
    assert sum(h[:3] == f[:3] for h, f in zip(half, full)) >= 5
