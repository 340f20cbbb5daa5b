"""Hybrid models (attention layers beside linear / state-space ones) over pages shared by K/V and state.

Two tiny random models as transformers saves them: Qwen3.5 (8 layers: three gated DeltaNet layers, then one
attention layer, twice) and Granite 4.0-H (6 layers: two Mamba-2 layers, then one attention layer without
positional encoding, twice; muP multipliers). Greedy float32 tokens equal transformers' under every setting
that changes how the engine computes (chunks, preemption, block sizes, prefix hits at several depths,
n > 1); a state restored from a snapshot is the state recomputed, bit for bit; every page comes back; what
does not run yet is refused by name.
"""
import pytest
import torch

from conftest import (_randomize, _tiny_tokenizer, check_logprobs_close, hf_greedy_logprobs, make_prompts,
                      nanopaged_greedy)
from nanopaged import LLM, SamplingParams
from nanopaged.cpu.build import available

MAX_TOKENS = 16


def qwen3_5_model(vocab_size):
    from transformers import Qwen3_5ForCausalLM, Qwen3_5TextConfig
    cfg = Qwen3_5TextConfig(
        vocab_size=vocab_size, hidden_size=64, num_hidden_layers=8, num_attention_heads=4, num_key_value_heads=2,
        head_dim=16, intermediate_size=128, max_position_embeddings=1024, linear_num_key_heads=2,
        linear_num_value_heads=4, linear_key_head_dim=16, linear_value_head_dim=16, linear_conv_kernel_dim=4,
        bos_token_id=1, eos_token_id=2, pad_token_id=2, tie_word_embeddings=False,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.25})
    model = Qwen3_5ForCausalLM(cfg).float()
    _randomize(model)
    return model


def granite_model(vocab_size):
    """Granite 4.0-H's layout in small: Mamba-2 layers (one group of B and C for 4 heads), attention without RoPE,
    the four multipliers away from 1, a 32-token chunk so that a prompt runs several."""
    from transformers import GraniteMoeHybridConfig, GraniteMoeHybridForCausalLM
    cfg = GraniteMoeHybridConfig(
        vocab_size=vocab_size, hidden_size=64, num_hidden_layers=6, num_attention_heads=4, num_key_value_heads=2,
        intermediate_size=128, shared_intermediate_size=96, num_local_experts=0, max_position_embeddings=1024,
        layer_types=["mamba", "mamba", "attention"] * 2, mamba_n_heads=4, mamba_n_groups=1, mamba_d_state=16,
        mamba_d_conv=4, mamba_expand=2, mamba_chunk_size=32, position_embedding_type=None,
        embedding_multiplier=6.0, residual_multiplier=0.4, attention_multiplier=0.2, logits_scaling=3.0,
        bos_token_id=1, eos_token_id=2, pad_token_id=2, tie_word_embeddings=True)
    model = GraniteMoeHybridForCausalLM(cfg).float()
    _randomize(model)
    with torch.no_grad():           # decays from slow to fast, time steps around 0.3: a state that remembers
        for name, p in model.named_parameters():
            if name.endswith("A_log"):
                p.copy_(torch.log(torch.empty_like(p).uniform_(0.5, 4.0)))
            elif name.endswith("dt_bias"):
                p.normal_(-1.0, 0.5)
    return model


FAMILIES = {"qwen3_5": qwen3_5_model, "granite": granite_model}


@pytest.fixture(scope="module", params=list(FAMILIES))
def hybrid_dir(request, tmp_path_factory):
    tok = _tiny_tokenizer()
    torch.manual_seed(0)
    model = FAMILIES[request.param](len(tok))
    folder = tmp_path_factory.mktemp(request.param)
    model.save_pretrained(folder, safe_serialization=True)
    tok.save_pretrained(folder)
    return str(folder)


@pytest.fixture(scope="module")
def reference(hybrid_dir, hf_greedy):
    prompts = make_prompts(512, n=8, seed=3, min_len=1, max_len=150)
    return prompts, hf_greedy(hybrid_dir, prompts, MAX_TOKENS)


def greedy(llm, prompts, **params):
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts],
                        SamplingParams(temperature=0, max_tokens=MAX_TOKENS, **params), use_tqdm=False)
    return outs


def assert_every_page_came_back(llm):
    """No request holds a page; the only pages held are snapshots kept by cached blocks, which count as free."""
    scheduler = llm.llm_engine.scheduler
    pool = scheduler.block_pool
    assert not scheduler.running and not scheduler.waiting
    pool.check_invariants()
    snapshots = [p for b in pool.blocks for p in b.state_snapshot]
    assert all(pool.blocks[b].ref_count == 1 for b in snapshots)
    assert all(b.ref_count == 0 for b in pool.blocks if b.block_id not in set(snapshots))
    assert llm.get_stats()["kv_cache_usage"] == 0.0


SETTINGS = {
    "default": {},                                    # the decode token in C++ where it builds (cpu/recurrent.py)
    "reference_kernels": {"cpu_kernels": "reference", "cpu_linear": "reference"},
    "no_prefix_caching": {"enable_prefix_caching": False},
    "chunked_prefill": {"max_num_batched_tokens": 24},
    "preemption": {"num_kv_blocks": 10},
    "block_size_128": {"block_size": 128},
    "everything_at_once": {"num_kv_blocks": 14, "max_num_batched_tokens": 40, "max_num_seqs": 5},
}


@pytest.mark.parametrize("setting", list(SETTINGS))
def test_greedy_tokens_equal_transformers(hybrid_dir, reference, setting):
    prompts, expected = reference
    llm = LLM(hybrid_dir, dtype="float32", **SETTINGS[setting])
    assert [o.outputs[0].token_ids for o in greedy(llm, prompts)] == expected
    assert llm.get_stats()["state_steps"] == ("reference" if setting == "reference_kernels" or available() else "cpp")
    stats = llm.get_stats()
    if setting in ("preemption", "everything_at_once"):
        assert stats["num_preemptions"] > 0
    if setting == "chunked_prefill":
        assert stats["num_steps"] >= sum(len(p) for p in prompts) / 24
    assert_every_page_came_back(llm)


def test_the_reference_is_not_degenerate(reference):
    _, expected = reference
    assert len({tuple(e) for e in expected}) > 5 and all(len(e) >= 2 for e in expected)


def test_the_block_size_is_raised_to_the_layers_chunk_and_the_figures_follow(hybrid_dir):
    llm = LLM(hybrid_dir, dtype="float32", block_size=16, num_kv_blocks=200)
    cfg = llm.llm_engine.config
    hybrid, bs = cfg.model_config.hybrid, cfg.block_size
    kv_per_token = 2 * 2 * 16 * 4                                  # one attention layer: K and V, 2 heads x 16
    assert bs % hybrid.chunk == 0 and bs * kv_per_token >= hybrid.state_bytes()
    assert bs == hybrid.chunk or (bs - hybrid.chunk) * kv_per_token < hybrid.state_bytes()    # the smallest
    figures = llm.get_stats()["hybrid"]
    groups = len(hybrid.linear_layers) // 2                        # two attention layers: groups of two
    assert figures["page_bytes"] == 2 * bs * kv_per_token
    assert figures["state_pages_per_request"] == groups
    assert figures["state_bytes_per_request"] == groups * figures["page_bytes"]
    assert figures["state_bytes_per_request_filled"] == len(hybrid.linear_layers) * hybrid.state_bytes()
    assert figures["kv_bytes_per_token"] == 2 * kv_per_token
    assert figures["requests_at_4096_tokens"] == 200 // (-(-4096 // bs) + groups)


def test_prefix_hits_at_several_depths_equal_transformers(hybrid_dir, hf_greedy):
    """One long prompt computed; then prompts sharing 64, 128 and 192 of its tokens hit the blocks whose state
    was kept, restore it and compute the rest; their tokens stay transformers'."""
    base = make_prompts(512, n=1, seed=9, min_len=230, max_len=230)[0]
    tails = make_prompts(512, n=3, seed=10, min_len=5, max_len=30)
    prompts = [base[:depth] + tail for depth, tail in zip((64, 128, 192), tails)]
    llm = LLM(hybrid_dir, dtype="float32")
    greedy(llm, [base])
    got = [o.outputs[0].token_ids for o in greedy(llm, prompts)]
    assert got == hf_greedy(hybrid_dir, prompts, MAX_TOKENS)
    stats = llm.get_stats()
    assert stats["hybrid"]["state_snapshots_restored"] == 3
    assert stats["prefix_cache_hits"] == 64 + 128 + 192
    assert_every_page_came_back(llm)


def final_states(llm, prompt):
    """Each DeltaNet layer's (conv, recurrent) state after `prompt`'s prefill (one token generated)."""
    engine = llm.llm_engine
    kept, give_back = [], engine.scheduler.states.give_back
    engine.scheduler.states.give_back = lambda request: (kept.append(list(request.state_pages)), give_back(request))
    llm.generate([{"prompt_token_ids": prompt}], SamplingParams(temperature=0, max_tokens=1), use_tqdm=False)
    engine.scheduler.states.give_back = give_back
    runner, hybrid = engine.runner, engine.config.model_config.hybrid
    [pages] = kept
    return [tuple(t[pages[hybrid.place(i)[1]]].clone() for t in runner.kv_cache[i]) for i in hybrid.linear_layers]


def test_a_restored_state_is_the_recomputed_state_bit_for_bit(hybrid_dir):
    """A prompt that hits 128 cached tokens continues from the kept state; the same prompt in a fresh engine
    computes those 128 tokens itself (its prompt cut at the same boundary): every state equal in every bit."""
    base = make_prompts(512, n=1, seed=11, min_len=200, max_len=200)[0]
    prompt = base[:128] + make_prompts(512, n=1, seed=12, min_len=40, max_len=40)[0]
    warm = LLM(hybrid_dir, dtype="float32")
    greedy(warm, [base])
    restored = final_states(warm, prompt)
    assert warm.get_stats()["hybrid"]["state_snapshots_restored"] == 1
    recomputed = final_states(LLM(hybrid_dir, dtype="float32"), prompt)
    for got, want in zip(restored, recomputed):
        assert all(torch.equal(a, b) for a, b in zip(got, want))
    assert any(a.abs().sum() > 0 for state in recomputed for a in state)


def test_n_samples_fork_the_state(hybrid_dir, reference):
    """n = 3 greedy samples share the prompt's blocks and each gets a copy of its state: all three are
    transformers' greedy answer (a fork reading a zero or foreign state would part from it)."""
    prompts, expected = reference
    llm = LLM(hybrid_dir, dtype="float32")
    outs = greedy(llm, prompts[:4], n=3)
    assert [[c.token_ids for c in o.outputs] for o in outs] == [[e] * 3 for e in expected[:4]]
    assert_every_page_came_back(llm)


def test_bfloat16_is_close_to_transformers(hybrid_dir):
    prompts = make_prompts(512, n=6, seed=21, min_len=4, max_len=100)
    ours = nanopaged_greedy(LLM(hybrid_dir, dtype="bfloat16"), prompts, 12)
    check_logprobs_close(ours, hf_greedy_logprobs(hybrid_dir, prompts, 12, "bfloat16"))


@pytest.mark.parametrize("setting, value", [
    ("tensor_parallel_size", 2), ("speculative_config", {"method": "ngram", "num_speculative_tokens": 2}),
    ("enable_lora", True), ("runner", "pooling"), ("quantization", "int8"), ("kv_cache_dtype", "fp8"),
    ("async_scheduling", True), ("attention_backend", "cpu"), ("cpu_kernels", "fused")])
def test_what_a_hybrid_does_not_run_yet_is_refused_by_name(hybrid_dir, setting, value):
    with pytest.raises(ValueError, match=rf"{setting}=.*hybrid model \w+ForCausalLM"):
        LLM(hybrid_dir, dtype="float32", **{setting: value})


def test_granite_with_rope_equals_transformers(tmp_path, hf_greedy):
    """Granite 4.0-H's attention takes no positional encoding; a config that asks for RoPE gets it."""
    tok = _tiny_tokenizer()
    torch.manual_seed(1)
    model = granite_model(len(tok))
    model.config.position_embedding_type = "rope"
    model.save_pretrained(tmp_path, safe_serialization=True)
    tok.save_pretrained(tmp_path)
    prompts = make_prompts(512, n=4, seed=5, min_len=3, max_len=90)
    got = [o.outputs[0].token_ids for o in greedy(LLM(str(tmp_path), dtype="float32"), prompts)]
    assert got == hf_greedy(str(tmp_path), prompts, MAX_TOKENS)


def test_granite_reads_both_names_of_its_layer_types_and_refuses_its_mixtures_by_name():
    from nanopaged.models.hybrid import granite_hybrid
    cfg = granite_model(64).config.to_dict()
    cfg["time_step_limit"] = [0.0, 1e9]
    new = granite_hybrid({**cfg, "layer_types": ["linear_attention", "linear_attention", "full_attention"] * 2})
    old = granite_hybrid({**cfg, "layer_types": ["mamba", "mamba", "attention"] * 2})
    assert new == old and new.layer_types == ("linear", "linear", "attention") * 2
    with pytest.raises(ValueError, match="num_local_experts=8: Granite 4.0-H's mixtures of experts"):
        granite_hybrid({**cfg, "num_local_experts": 8})
    with pytest.raises(ValueError, match="no attention layer"):
        granite_hybrid({**cfg, "layer_types": ["mamba"] * 6})


def test_batch_invariance_is_not_claimed_where_the_attention_is_the_torch_reference(hybrid_dir):
    """A hybrid's attention runs on the torch backend, which groups decode rows by length: its default path does
    not claim batch invariance, and asking for it is refused with the reason (cpu/choose.py)."""
    assert LLM(hybrid_dir, dtype="bfloat16", num_kv_blocks=40).get_stats()["batch_invariant"] is False
    with pytest.raises(ValueError, match="batch_invariant=True cannot hold here"):
        LLM(hybrid_dir, dtype="bfloat16", batch_invariant=True)


def test_a_qwen3_5_vision_language_checkpoint_runs_as_its_language_model(tmp_path):
    """Qwen3.5's checkpoints ship as Qwen3_5ForConditionalGeneration (a vision tower beside the language model,
    the latter's weights under model.language_model.): read for text, its tokens are transformers' own model's
    on text alone, and the vision tower's weights are skipped, not refused."""
    from transformers import Qwen3_5Config, Qwen3_5ForConditionalGeneration
    tok = _tiny_tokenizer()
    text = qwen3_5_model(len(tok)).config.to_dict()
    text["rope_parameters"] = {**text["rope_parameters"], "mrope_section": [1, 1, 0], "mrope_interleaved": True}
    vision = dict(depth=1, hidden_size=32, intermediate_size=64, num_heads=2, out_hidden_size=64, patch_size=4,
                  spatial_merge_size=2, temporal_patch_size=2)
    torch.manual_seed(2)
    model = Qwen3_5ForConditionalGeneration(Qwen3_5Config(text_config=text, vision_config=vision)).float()
    _randomize(model)
    model.save_pretrained(tmp_path, safe_serialization=True)
    tok.save_pretrained(tmp_path)
    prompts = make_prompts(512, n=4, seed=6, min_len=3, max_len=80)
    expected = []
    for p in prompts:
        ids = torch.tensor([p])
        new = model.eval().generate(input_ids=ids, attention_mask=torch.ones_like(ids), do_sample=False,
                                    max_new_tokens=MAX_TOKENS, pad_token_id=2)[0, len(p):].tolist()
        expected.append(new[:new.index(2) + 1] if 2 in new else new)
    llm = LLM(str(tmp_path), dtype="float32")
    assert llm.llm_engine.config.model_config.language_model_of == "Qwen3_5ForConditionalGeneration"
    assert [o.outputs[0].token_ids for o in greedy(llm, prompts)] == expected
