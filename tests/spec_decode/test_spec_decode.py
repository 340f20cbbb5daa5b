"""Speculative decoding end to end, on tiny random models in float32 (and the demo model): greedy
output is plain decoding's token for token, under preemption, chunked prefill, the prefix cache,
stops inside an accepted run and max_tokens reached mid-run; sampled output keeps its distribution;
the block pool stays whole after every step."""
import json
import random
import shutil
from collections import Counter

import pytest
import torch
from conftest import chi2_critical, torch_threads
from safetensors.torch import load_file, save_file

from nanopaged import LLM, SamplingParams
from nanopaged.spec_decode.extension import SpeculativeDecoding

NGRAM = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 3, "prompt_lookup_min": 1}


def draft(path, k=3):
    return {"method": "draft_model", "model": str(path), "num_speculative_tokens": k}


def perturbed_copy(model_dir, folder):
    """The model with noise on every weight: a draft that agrees with it often, not always."""
    shutil.copytree(model_dir, folder)
    weights = load_file(folder / "model.safetensors")
    g = torch.Generator().manual_seed(0)
    save_file({k: v + 0.005 * torch.randn(v.shape, generator=g) for k, v in weights.items()},
              folder / "model.safetensors")
    return folder


@pytest.fixture(scope="module")
def near_draft(tiny_model_dirs, tmp_path_factory):
    return perturbed_copy(tiny_model_dirs["llama"], tmp_path_factory.mktemp("near_draft") / "llama")


def repeating_prompts(n=8, seed=0):
    """Token ids whose second half repeats the first: something for the n-gram proposer to find."""
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        half = [rng.randrange(3, 500) for _ in range(rng.randint(4, 30))]
        out.append({"prompt_token_ids": half * 2})
    return out


@pytest.fixture(autouse=True)
def one_thread():
    """float32's matmuls (MKL) on two threads gave two identical engines of one process other seeded
    samples in about one process of three (on one thread: none of 7), and a thread count the governor
    changes with the machine's load would too: these tests compare engines bit for bit, so each runs
    on one fixed thread."""
    with torch_threads(1):
        yield


def engine(model, spec=None, **kw):
    return LLM(model, dtype="float32", speculative_config=spec, cpu_threads=None, **kw)


def token_ids(llm, prompts, params):
    return [[c.token_ids for c in o.outputs] for o in llm.generate(prompts, params, use_tqdm=False)]


def stats(llm):
    return llm.llm_engine.find(SpeculativeDecoding).counts


GREEDY = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_greedy_ngram_equals_plain_decoding(tiny_model_dirs, arch):
    prompts = repeating_prompts()
    plain = token_ids(engine(tiny_model_dirs[arch]), prompts, GREEDY)
    llm = engine(tiny_model_dirs[arch], NGRAM)
    assert token_ids(llm, prompts, GREEDY) == plain
    s = stats(llm)
    assert s.num_drafts > 0 and s.num_accepted_tokens > 0 and s.num_accepted_tokens < s.num_draft_tokens


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_greedy_draft_model_equals_plain_decoding(tiny_model_dirs, tmp_path, arch):
    prompts = repeating_prompts()
    plain = token_ids(engine(tiny_model_dirs[arch]), prompts, GREEDY)
    llm = engine(tiny_model_dirs[arch], draft(perturbed_copy(tiny_model_dirs[arch], tmp_path / arch)))
    assert token_ids(llm, prompts, GREEDY) == plain
    s = stats(llm)                       # accepted often, rejected too: both paths ran
    assert 0.2 * s.num_draft_tokens < s.num_accepted_tokens < s.num_draft_tokens


@pytest.mark.parametrize("spec", ["ngram", "draft"])
@pytest.mark.parametrize("settings", [
    {"num_kv_blocks": 24},                                     # forced preemption
    {"max_num_batched_tokens": 24},                            # chunked prefill; drafts cut by the budget
    {"enable_prefix_caching": True, "num_kv_blocks": 200},     # shared prompts hit the cache
])
def test_greedy_equality_holds_under(tiny_model_dirs, near_draft, spec, settings):
    prompts = repeating_prompts(10)
    prompts += [{"prompt_token_ids": prompts[0]["prompt_token_ids"] + [7, 8, 9]}] * 3   # a shared prefix
    plain_llm = engine(tiny_model_dirs["llama"], **settings)
    plain = token_ids(plain_llm, prompts, GREEDY)
    llm = engine(tiny_model_dirs["llama"], NGRAM if spec == "ngram" else draft(near_draft), **settings)
    assert token_ids(llm, prompts, GREEDY) == plain
    got = llm.get_stats()
    if "num_kv_blocks" in settings and settings["num_kv_blocks"] == 24:
        assert got["num_preemptions"] > 0
    if settings.get("enable_prefix_caching"):
        assert got["prefix_cache_hits"] > 0
    assert got["spec_decode"]["num_accepted_tokens"] > 0
    pool = llm.llm_engine.scheduler.block_pool
    pool.check_invariants()
    assert pool.num_free_blocks == pool.num_blocks


def test_max_tokens_reached_in_the_middle_of_a_run(tiny_model_dirs):
    """A self-draft accepts everything: each verify step emits k + 1 = 5 tokens, so most max_tokens
    fall inside a run; the drafts are cut to fit, and the output is plain decoding's prefix."""
    prompts = repeating_prompts(4)
    long = token_ids(engine(tiny_model_dirs["llama"]), prompts, GREEDY)
    llm = engine(tiny_model_dirs["llama"], draft(tiny_model_dirs["llama"], k=4))
    for n in range(1, 13):
        got = token_ids(llm, prompts, SamplingParams(temperature=0, max_tokens=n, ignore_eos=True))
        assert got == [[seq[0][:n]] for seq in long]


def test_stops_inside_an_accepted_run(tiny_model_dirs):
    """Stop strings and stop tokens that complete in the middle of a 5-token verify step: nothing after
    them is emitted, and text, tokens and reasons are plain decoding's."""
    model = tiny_model_dirs["llama"]
    prompts = repeating_prompts(3)
    plain_llm, llm = engine(model), engine(model, draft(model, k=4))
    full = plain_llm.generate(prompts, SamplingParams(temperature=0, max_tokens=30, ignore_eos=True), use_tqdm=False)
    for out in full:
        text, ids = out.outputs[0].text, out.outputs[0].token_ids
        cases = [{"stop": [text[i:i + 3]]} for i in (5, 11, 17, 23) if len(text[i:i + 3]) == 3]
        cases += [{"stop_token_ids": [ids[i]]} for i in (6, 13, 22)]
        for case in cases:
            p = SamplingParams(temperature=0, max_tokens=30, **case)
            [a] = plain_llm.generate([{"prompt_token_ids": out.prompt_token_ids}], p, use_tqdm=False)
            [b] = llm.generate([{"prompt_token_ids": out.prompt_token_ids}], p, use_tqdm=False)
            assert (b.outputs[0].text, b.outputs[0].token_ids, b.outputs[0].finish_reason,
                    b.outputs[0].stop_reason) == (a.outputs[0].text, a.outputs[0].token_ids,
                                                  a.outputs[0].finish_reason, a.outputs[0].stop_reason), case
    assert stats(llm).mean_acceptance_length > 4


def test_min_tokens_and_eos(tiny_model_dirs, near_draft):
    prompts = repeating_prompts(6)
    p = SamplingParams(temperature=0, max_tokens=40, min_tokens=10)
    assert token_ids(engine(tiny_model_dirs["llama"], draft(near_draft)), prompts, p) == \
        token_ids(engine(tiny_model_dirs["llama"]), prompts, p)


def test_logprobs_and_prompt_logprobs_stay_right(tiny_model_dirs, near_draft):
    prompts = repeating_prompts(4)
    p = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True, logprobs=3, prompt_logprobs=2)
    a = engine(tiny_model_dirs["llama"]).generate(prompts, p, use_tqdm=False)
    b = engine(tiny_model_dirs["llama"], draft(near_draft)).generate(prompts, p, use_tqdm=False)
    for x, y in zip(a, b):
        assert x.outputs[0].token_ids == y.outputs[0].token_ids
        assert x.outputs[0].cumulative_logprob == pytest.approx(y.outputs[0].cumulative_logprob, abs=1e-3)
        for lx, ly in zip(x.outputs[0].logprobs, y.outputs[0].logprobs):
            assert {t: (v.rank, round(v.logprob, 3)) for t, v in lx.items()} == \
                   {t: (v.rank, round(v.logprob, 3)) for t, v in ly.items()}
        assert [None if e is None else sorted(e) for e in x.prompt_logprobs] == \
               [None if e is None else sorted(e) for e in y.prompt_logprobs]


def test_parallel_samples(tiny_model_dirs, near_draft):
    prompts = repeating_prompts(3)
    greedy = SamplingParams(n=2, temperature=0, max_tokens=24, ignore_eos=True)
    assert token_ids(engine(tiny_model_dirs["llama"], NGRAM), prompts, greedy) == \
        token_ids(engine(tiny_model_dirs["llama"]), prompts, greedy)
    sampled = SamplingParams(n=3, temperature=0.8, seed=11, max_tokens=24, ignore_eos=True)
    llm = engine(tiny_model_dirs["llama"], draft(near_draft))
    first = token_ids(llm, prompts, sampled)
    assert token_ids(engine(tiny_model_dirs["llama"], draft(near_draft)), prompts, sampled) == first   # reproducible
    assert len({tuple(seq) for out in first for seq in out}) > len(first)                          # the samples differ


def test_the_pool_stays_whole_after_every_step(tiny_model_dirs, near_draft):
    llm = engine(tiny_model_dirs["llama"], draft(near_draft), num_kv_blocks=30, max_num_batched_tokens=40)
    e, pool = llm.llm_engine, llm.llm_engine.scheduler.block_pool
    rng = random.Random(3)
    for i, prompt in enumerate(repeating_prompts(16, seed=3)):
        e.add_request(str(i), prompt, SamplingParams(temperature=rng.choice([0, 0.7, 1.0]), seed=i,
                                                     max_tokens=rng.randint(5, 40), ignore_eos=True))
    steps = 0
    while e.has_unfinished_requests():
        e.step()
        pool.check_invariants()
        for r in e.scheduler.running:     # a table never holds a block past its tokens' and next draft's
            assert len(r.block_ids) <= -(-r.num_tokens_with_spec // pool.block_size)
        steps += 1
    assert pool.num_free_blocks == pool.num_blocks
    s = stats(llm)
    assert s.num_accepted_tokens < s.num_draft_tokens and s.num_accepted_tokens > 0
    assert steps > 0


# Six tokens only (allowed_token_ids), all in the prompt: a random model's distribution over 512
# tokens is nearly flat, and the n-gram proposer finds a draft for every token.
ALLOWED = list(range(11, 17))
SIX_TOKEN_PROMPT = {"prompt_token_ids": ALLOWED * 2}


def sampled_tokens(llm, params, first_seed, n=1000):
    """Output tokens 2-6 of n seeded requests: drawn in verify steps when drafting. Samples that are
    compared get other seeds: with the same ones they would be coupled, not independent."""
    reqs = [SamplingParams(**params, seed=first_seed + i, max_tokens=6, ignore_eos=True, allowed_token_ids=ALLOWED)
            for i in range(n)]
    outs = llm.generate([SIX_TOKEN_PROMPT] * n, reqs, use_tqdm=False)
    return [t for o in outs for t in o.outputs[0].token_ids[1:]]


def two_sample_chi2_passes(a: list[int], b: list[int]) -> bool:
    """Do two samples come from one distribution? Chi-square (p = 0.001) over the 15 commonest tokens
    and the rest."""
    common = [t for t, _ in Counter(a + b).most_common(15)]
    def counts(xs):
        c = [xs.count(t) for t in common]
        return c + [len(xs) - sum(c)]
    ca, cb = counts(a), counts(b)
    stat, na, nb = 0.0, len(a), len(b)
    for x, y in zip(ca, cb):
        if x + y:
            stat += (x * (nb / na) ** 0.5 - y * (na / nb) ** 0.5) ** 2 / (x + y)
    return stat < chi2_critical(sum(1 for x, y in zip(ca, cb) if x + y) - 1)


@pytest.mark.parametrize("params", [{"temperature": 1.0}, {"temperature": 0.7, "top_p": 0.9}])
@pytest.mark.parametrize("spec", ["ngram", "draft"])
def test_sampled_output_keeps_its_distribution(tiny_model_dirs, near_draft, params, spec):
    """5,000 tokens each, with and without speculation: the token distributions agree. The near
    draft's q differs from p (it even puts mass outside the six tokens); the n-gram's q is one-hot."""
    model = tiny_model_dirs["llama"]
    plain = sampled_tokens(engine(model), params, 0)
    llm = engine(model, NGRAM if spec == "ngram" else draft(near_draft, k=2))
    fast = sampled_tokens(llm, params, 10_000)
    s = stats(llm)
    assert s.num_drafts > 1000 and 100 < s.num_accepted_tokens < s.num_draft_tokens
    assert two_sample_chi2_passes(plain, fast)


def test_the_chi2_test_sees_a_shift(tiny_model_dirs):
    """The test has the power the issue asks for (a 5% shift): it fails for temperatures 1.0 and 0.6,
    whose six-token distributions differ by 3.3% in total variation (measured: 2.3% passes)."""
    llm = engine(tiny_model_dirs["llama"])
    assert not two_sample_chi2_passes(sampled_tokens(llm, {"temperature": 1.0}, 0),
                                      sampled_tokens(llm, {"temperature": 0.6}, 10_000))


def test_beam_search_is_refused(tiny_model_dirs):
    from nanopaged import BeamSearchParams
    with pytest.raises(ValueError, match="beam_search does not run on an engine with speculative_config"):
        engine(tiny_model_dirs["llama"], NGRAM).beam_search([{"prompt_token_ids": [1, 2, 3]}],
                                                            BeamSearchParams(beam_width=2, max_tokens=4))


def test_stats_bar_and_metrics(tiny_model_dirs):
    llm = engine(tiny_model_dirs["llama"], NGRAM)
    llm.generate(repeating_prompts(4), GREEDY, use_tqdm=False)
    got = llm.get_stats()["spec_decode"]
    assert set(got) == {"num_drafts", "num_draft_tokens", "num_accepted_tokens", "accepted_per_pos",
                        "mean_acceptance_length", "draft_acceptance_rate",
                        # the drafter's own: forced drafts, each request's rate the draft budget reads
                        "num_forced_draft_tokens", "num_accepted_forced_tokens", "acceptance"}
    assert got["acceptance"] and all(0 <= a <= 1 for a in got["acceptance"].values())
    assert got["num_drafts"] > 0 and len(got["accepted_per_pos"]) == 4
    llm.reset_stats()                                                   # counted from here, as the rest
    assert llm.get_stats()["spec_decode"]["num_drafts"] == 0
    assert engine(tiny_model_dirs["llama"]).get_stats()["spec_decode"] is None
    pytest.importorskip("prometheus_client")
    from nanopaged.entrypoints.core_messages import figures_of
    from nanopaged.entrypoints.openai.metrics import ServerMetrics
    metrics = ServerMetrics()
    metrics.engine(figures_of(llm.llm_engine, llm.stats))
    llm.generate(repeating_prompts(4), GREEDY, use_tqdm=False)
    metrics.engine(figures_of(llm.llm_engine, llm.stats))
    text = metrics.exposition().decode()
    s = stats(llm)
    for name in ("drafts", "draft_tokens", "accepted_tokens"):
        line = next(x for x in text.splitlines() if x.startswith(f"nanopaged:spec_decode_num_{name}_total "))
        assert float(line.split()[1]) > 0
    assert 'nanopaged:spec_decode_num_accepted_tokens_per_pos_total{position="0"}' in text
    assert s.num_drafts > 0


def test_structured_requests_get_the_drafts_their_grammar_forces(tiny_model_dirs):
    """After "yes" or "no" the grammar forces the end: drafted, verified, and the output is plain decoding's."""
    pytest.importorskip("xgrammar")
    from nanopaged import StructuredOutputsParams
    llm = engine(tiny_model_dirs["llama"], NGRAM)
    p = SamplingParams(temperature=0, max_tokens=10, structured_outputs=StructuredOutputsParams(choice=["yes", "no"]))
    [out] = llm.generate(["Answer:"], p, use_tqdm=False)
    assert out.outputs[0].text in ("yes", "no")
    assert stats(llm).num_forced_draft_tokens > 0
    [plain] = engine(tiny_model_dirs["llama"]).generate(["Answer:"], p, use_tqdm=False)
    assert out.outputs[0].token_ids == plain.outputs[0].token_ids


def test_demo_model_greedy_ngram(demo_model_dir):
    """The real model repeating a passage: the drafts are accepted, the output is unchanged."""
    passage = "The quick brown fox jumps over the lazy dog. A journey of a thousand miles begins with one step."
    prompts = [f"Repeat this sentence exactly: {passage}\n{passage}\n", f"Copy: {passage}\nCopy:"]
    p = SamplingParams(temperature=0, max_tokens=24)
    plain = token_ids(engine(demo_model_dir), prompts, p)
    llm = engine(demo_model_dir, {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 4,
                                  "prompt_lookup_min": 2})
    assert token_ids(llm, prompts, p) == plain
    assert stats(llm).mean_acceptance_length > 1.5
    json.dumps(llm.get_stats())          # the stats stay JSON


def test_demo_model_greedy_draft_model(demo_model_dir):
    """A draft model with the demo model's vocabulary: its own first 4 layers (the bench's early-exit
    draft). Its drafts are poor; the output is the target's all the same."""
    from benchmarks.models import build_draft_model
    prompts = ["Name three colours.", "Write the word blue four times."]
    p = SamplingParams(temperature=0, max_tokens=12)
    plain = token_ids(engine(demo_model_dir), prompts, p)
    llm = engine(demo_model_dir, draft(build_draft_model(demo_model_dir, 4), k=2))
    assert token_ids(llm, prompts, p) == plain
    assert stats(llm).num_draft_tokens > 0
