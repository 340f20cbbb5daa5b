"""Shared prefixes read once, end to end: `disable_cascade_attn` (vLLM's engine argument) switches the
cpu attention kernel's sharing of blocks between rows (csrc/attention_jobs.h); on or off, every request
gets the same tokens and the same logprobs, bit for bit.

A tiny random model with head_dim 64 (the kernel's vector path, where rows are read together), many
requests behind one system prompt (prefix-cache hits, so their tables begin with the same blocks), and
n > 1 samples (forked tables). The kernel: tests/cpu/test_shared_prefix.py.
"""
import pytest
from conftest import _randomize

from nanopaged import LLM, SamplingParams
from nanopaged.cpu.build import available, cpu_ops
from nanopaged.cpu.choose import choose
from nanopaged.config import EngineConfig

SYSTEM = list(range(100, 180))          # 80 tokens: 5 full blocks of 16 shared by every request


@pytest.fixture(scope="module")
def head64_model(tiny_model_dirs, tmp_path_factory):
    """2 layers, 3 query heads of 64 on one KV head, bfloat16: the fused path with the vector kernel."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer, LlamaConfig
    if available() is not None:
        pytest.skip(available())
    folder = tmp_path_factory.mktemp("head64")
    config = LlamaConfig(vocab_size=512, hidden_size=192, num_hidden_layers=2, num_attention_heads=3,
                         num_key_value_heads=1, intermediate_size=256, max_position_embeddings=512,
                         bos_token_id=1, eos_token_id=2, pad_token_id=2, tie_word_embeddings=True)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    _randomize(model)
    model.save_pretrained(folder, safe_serialization=True)
    AutoTokenizer.from_pretrained(tiny_model_dirs["llama"]).save_pretrained(folder)
    if choose(EngineConfig(str(folder), device="cpu")).layers != "fused":
        pytest.skip("the fused layers do not run here (they need a CPU with bfloat16 matrix units)")
    return str(folder)


def requests(n=12):
    return [{"prompt_token_ids": SYSTEM + [200 + i] * (1 + i % 5)} for i in range(n)]


def run(llm, params):
    outs = llm.generate(requests(), params, use_tqdm=False)
    return [[(c.token_ids, [sorted(p.items()) for p in c.logprobs]) for c in o.outputs] for o in outs]


@pytest.mark.parametrize("params", [
    SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, logprobs=2),
    SamplingParams(n=4, temperature=1.0, seed=3, max_tokens=12, ignore_eos=True, logprobs=2),
], ids=["greedy", "n=4 samples"])
def test_sharing_on_or_off_gives_the_same_tokens_and_logprobs(head64_model, params, monkeypatch):
    seen = []
    forward = cpu_ops().decoder_forward
    monkeypatch.setattr(cpu_ops(), "decoder_forward", lambda *a: seen.append(a[-1]) or forward(*a))
    on = LLM(head64_model, dtype="bfloat16")
    off = LLM(head64_model, dtype="bfloat16", disable_cascade_attn=True)
    run(on, params)                      # the system prompt's blocks are cached: every table begins with them
    run(off, params)
    seen.clear()
    got_on = run(on, params)
    assert on.get_stats()["prefix_cache_hits"] > 0
    assert set(seen) == {True}
    seen.clear()
    assert run(off, params) == got_on
    assert set(seen) == {False}


def test_disable_cascade_attn_must_be_a_bool(tiny_model_dirs):
    with pytest.raises(ValueError, match="disable_cascade_attn must be True or False"):
        LLM(tiny_model_dirs["llama"], disable_cascade_attn="yes")
