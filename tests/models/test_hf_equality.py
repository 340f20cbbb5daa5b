"""Greedy float32 output equals Hugging Face transformers token for token.

One batch of 10 prompts of different lengths, through tiny random Llama, Qwen2 and Qwen3
models, under settings that change *how* the engine computes (block sizes, a pool so small
that requests are preempted and recomputed, a token budget so small that prompts are
chunked) but must never change *what* it computes.
"""
import pytest

from conftest import make_prompts
from nanopaged import LLM, SamplingParams

MAX_TOKENS = 24

SETTINGS = {
    "default": {},
    "block_size_8": {"block_size": 8},
    "block_size_32": {"block_size": 32},
    "preemption": {"num_kv_blocks": 12},
    "chunked_prefill": {"max_num_batched_tokens": 16},
    "everything_at_once": {"block_size": 8, "num_kv_blocks": 24, "max_num_batched_tokens": 20,
                           "max_num_seqs": 5},
}


@pytest.fixture(scope="module")
def references(tiny_model_dirs, hf_greedy):
    refs = {}
    for arch, folder in tiny_model_dirs.items():
        prompts = make_prompts(512, n=10, seed=1, min_len=3, max_len=60)
        refs[arch] = (prompts, hf_greedy(folder, prompts, MAX_TOKENS))
    return refs


@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3"])
@pytest.mark.parametrize("setting", list(SETTINGS))
def test_greedy_tokens_equal_hugging_face(tiny_model_dirs, references, arch, setting):
    prompts, expected = references[arch]
    llm = LLM(tiny_model_dirs[arch], dtype="float32", **SETTINGS[setting])
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts],
                        SamplingParams(temperature=0, max_tokens=MAX_TOKENS), use_tqdm=False)
    got = [o.outputs[0].token_ids for o in outs]
    assert got == expected
    stats = llm.get_stats()
    if setting == "preemption":
        assert stats["num_preemptions"] > 0
    if setting == "chunked_prefill":
        # the 16-token budget really limited the steps: the prompts alone needed this many
        assert stats["num_steps"] >= sum(len(p) for p in prompts) / 16
    assert stats["kv_cache_usage"] == 0.0          # every block came back


def test_reference_outputs_are_not_degenerate(references):
    """Guard against a vacuous comparison: the tiny models say different things."""
    for arch, (_, expected) in references.items():
        assert len({tuple(e) for e in expected}) > 5, arch
        assert all(len(e) >= 2 for e in expected), arch


@pytest.mark.parametrize("setting", ["default", "everything_at_once"])
def test_a_mistral_architecture_model_equals_hugging_face(tiny_model_dirs, references, setting):
    prompts, expected = references["mistral"]
    llm = LLM(tiny_model_dirs["mistral"], dtype="float32", **SETTINGS[setting])
    assert llm.llm_engine.config.model_config.architecture == "MistralForCausalLM"
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts],
                        SamplingParams(temperature=0, max_tokens=MAX_TOKENS), use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == expected
