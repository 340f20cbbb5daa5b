"""A request's tokens do not depend on what runs beside it (`batch_invariant`, on by default where the
CPU's fast path holds it: bfloat16 on a CPU with AVX512-BF16, the kernels built).

Each case runs the same greedy requests one at a time on an engine without a prefix cache (the
baseline), then together in another arrangement, and asks for the same tokens, bit for bit, in the
model's default dtype: in a batch of 16, in reverse order after their shared prefix was cached (prefix
hits), under a 32-token budget (prompts chunked), in a KV cache too small for all of them
(preemption), beside sampled requests with n > 1 siblings, with their drafts verified by speculative
decoding, and with 4- and 8-bit weights (each against itself alone). Seeded sampled requests draw
the same tokens too. The kernels themselves: tests/cpu/test_row_invariance.py.
"""
import random

import pytest
import torch

from nanopaged import LLM, EngineConfig, SamplingParams
from nanopaged.spec_decode.extension import SpeculativeDecoding
from nanopaged.cpu.choose import choose


def invariant_by_default(model_dir) -> bool:
    return choose(EngineConfig(model_dir, device="cpu")).batch_invariant


@pytest.fixture(scope="module", autouse=True)
def needs_the_invariant_path(tiny_model_dirs):
    if not invariant_by_default(tiny_model_dirs["llama"]):
        pytest.skip("batch invariance is not the default here (it needs AVX512-BF16 and the C++ kernels)")


PREFIX = list(range(100, 140))          # 40 shared tokens: two full blocks of 16 for the prefix cache


def prompts(n=16, seed=0):
    """n prompts behind one shared prefix, each tail of its own length; some tails repeat themselves
    (something for an n-gram proposer to find)."""
    rng = random.Random(seed)
    out = []
    for i in range(n):
        tail = [rng.randrange(3, 500) for _ in range(rng.randint(3, 30))]
        out.append({"prompt_token_ids": PREFIX + (tail * 2 if i % 2 else tail)})
    return out


GREEDY = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)


def answers(llm, batch, params=GREEDY):
    return [o.outputs[0].token_ids for o in llm.generate(batch, params, use_tqdm=False)]


def alone(llm, batch, params=GREEDY):
    return [answers(llm, [p], params)[0] for p in batch]


@pytest.fixture(scope="module", params=["llama", "qwen2", "qwen3"])
def case(request, tiny_model_dirs):
    """(model folder, the prompts, their answers one at a time on a cold engine)."""
    model, batch = tiny_model_dirs[request.param], prompts()
    baseline = LLM(model, enable_prefix_caching=False)
    assert baseline.get_stats()["batch_invariant"]
    return model, batch, alone(baseline, batch)


def test_alone_equals_in_a_batch_and_in_reverse_after_the_prefix_was_cached(case):
    model, batch, want = case
    llm = LLM(model)
    assert answers(llm, batch) == want
    assert answers(llm, batch[::-1]) == want[::-1]
    assert llm.get_stats()["prefix_cache_hits"] > 0


def test_alone_equals_under_a_32_token_budget(case):
    model, batch, want = case
    assert answers(LLM(model, max_num_batched_tokens=32), batch) == want


def test_alone_equals_after_preemption(case):
    model, batch, want = case
    llm = LLM(model, num_kv_blocks=24)
    assert answers(llm, batch) == want
    assert llm.get_stats()["num_preemptions"] > 0


def test_alone_equals_beside_sampled_requests_with_siblings(case):
    model, batch, want = case
    sampled = SamplingParams(n=3, temperature=0.9, seed=5, max_tokens=24, ignore_eos=True)
    mixed = [p for pair in zip(batch, prompts(16, seed=1)) for p in pair]
    params = [GREEDY, sampled] * 16
    outs = LLM(model).generate(mixed, params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs[::2]] == want
    assert all(len(o.outputs) == 3 for o in outs[1::2])


def test_alone_equals_with_drafts_verified_in_the_batch(case):
    model, batch, want = case
    llm = LLM(model, speculative_config={"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 3,
                                         "prompt_lookup_min": 1})
    assert answers(llm, batch) == want
    assert llm.llm_engine.find(SpeculativeDecoding).counts.num_draft_tokens > 0


@pytest.mark.parametrize("method", ["int4", "int8", "w8a8"])
def test_quantized_weights_answer_alone_as_in_a_batch(tiny_model_dirs, method):
    """A quantized layer runs its quantized weight at every row count (no dense twin for big steps); W8A8's
    scale per token depends on its row alone."""
    model, batch = tiny_model_dirs["llama"], prompts()
    want = alone(LLM(model, quantization=method, quantization_group_size=32, enable_prefix_caching=False), batch)
    llm = LLM(model, quantization=method, quantization_group_size=32)
    assert answers(llm, batch) == want
    assert answers(llm, batch[::-1]) == want[::-1]


def test_a_seeded_sampled_request_draws_the_same_tokens_in_any_batch(case):
    model, batch, _ = case
    params = [SamplingParams(temperature=0.8, top_p=0.95, seed=100 + i, max_tokens=24, ignore_eos=True)
              for i in range(len(batch))]
    cold = LLM(model, enable_prefix_caching=False)
    want = [answers(cold, [p], [sp])[0] for p, sp in zip(batch, params)]
    llm = LLM(model, max_num_batched_tokens=48)
    assert answers(llm, batch, params) == want
    assert answers(llm, batch[::-1], params[::-1]) == want[::-1]


def test_off_a_quantized_layer_still_runs_its_quantized_weight(tiny_model_dirs):
    """batch_invariant=False changes the dense kernels' blocking, not what a quantized layer holds."""
    llm = LLM(tiny_model_dirs["llama"], quantization="int4", quantization_group_size=32, batch_invariant=False)
    assert not llm.get_stats()["batch_invariant"]
    assert llm.get_stats()["quantization"]["quantized_linears"] == 2 * 4
    assert not any(isinstance(m, torch.nn.Linear) for m in llm.llm_engine.runner.model.model.layers.modules())


TOPICS = ["the sea", "a red fox", "bread", "the moon", "winter", "a small town", "music", "rain", "an old clock",
          "the mountains", "coffee", "a train", "the library", "a garden", "the desert", "a lighthouse"]


@pytest.mark.parametrize("quantization", [None, "gguf"])
def test_the_demo_models_answers_alone_equal_them_in_a_batch(demo_model_dir, quantization):
    """The report that opened the issue: 16 short chat prompts, greedy, 48 tokens, one at a time, all
    together, then in reverse order; in bfloat16, and with the GGUF file's own 4-bit blocks."""
    if not invariant_by_default(demo_model_dir):
        pytest.skip("batch invariance is not the default here")
    llm = LLM(demo_model_dir, quantization=quantization)
    tokenizer = llm.get_tokenizer()
    batch = [{"prompt": tokenizer.apply_chat_template([{"role": "user", "content": f"Write two sentences about {t}."}],
                                                      add_generation_prompt=True, tokenize=False)} for t in TOPICS]
    params = SamplingParams(temperature=0, max_tokens=48)
    want = alone(llm, batch, params)
    assert answers(llm, batch, params) == want
    assert answers(llm, batch[::-1], params) == want[::-1]
