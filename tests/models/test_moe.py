"""Mixtures of experts (nanopaged/models/moe.py): tiny random Qwen3-MoE, Mixtral and OLMoE models saved by
transformers as they ship (experts stored one by one), greedy output token for token equal to Hugging Face
in float32, alone and under chunked prefill, preemption and the prefix cache; the routing block against
transformers' own on ties, an expert nobody chose, one token and many; Qwen3-MoE's decoder_sparse_step
above 1 (experts in every other layer) as transformers places them; every config this code does not
compute refused by name."""
import json
from pathlib import Path

import pytest
import torch

from conftest import EOS_TOKEN_ID, _randomize, _tiny_tokenizer, make_prompts
from nanopaged import LLM, SamplingParams
from nanopaged.models.config import ModelConfig
from nanopaged.models.moe import MoEConfig, SparseMoeBlock

COMMON = dict(hidden_size=64, num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2,
              max_position_embeddings=512, bos_token_id=1, eos_token_id=EOS_TOKEN_ID, pad_token_id=EOS_TOKEN_ID,
              tie_word_embeddings=False, dtype="float32")


def configs(vocab_size):
    from transformers import MixtralConfig, OlmoeConfig, Qwen3MoeConfig
    return {
        # 8 experts, top-2 renormalised, head_dim 32, the middle layer dense (mlp_only_layers)
        "qwen3_moe": Qwen3MoeConfig(vocab_size=vocab_size, **COMMON, head_dim=32, intermediate_size=96,
                                    moe_intermediate_size=32, num_experts=8, num_experts_per_tok=2,
                                    norm_topk_prob=True, mlp_only_layers=[1]),
        # decoder_sparse_step 2 over four layers: experts in layers 1 and 3 only, 0 and 2 dense
        "qwen3_moe_step2": Qwen3MoeConfig(vocab_size=vocab_size, **{**COMMON, "num_hidden_layers": 4}, head_dim=32,
                                          intermediate_size=96, moe_intermediate_size=32, num_experts=8,
                                          num_experts_per_tok=2, norm_topk_prob=True, decoder_sparse_step=2),
        # 4 experts, top-2, weights kept in float32
        "mixtral": MixtralConfig(vocab_size=vocab_size, **COMMON, intermediate_size=48, num_local_experts=4,
                                 num_experts_per_tok=2, sliding_window=None),
        # 16 experts, top-4, not renormalised, q/k norm over the whole projection
        "olmoe": OlmoeConfig(vocab_size=vocab_size, **COMMON, intermediate_size=32, num_experts=16,
                             num_experts_per_tok=4),
    }


@pytest.fixture(scope="module")
def moe_dirs(tmp_path_factory):
    from transformers import AutoModelForCausalLM
    tokenizer, root, dirs = _tiny_tokenizer(), tmp_path_factory.mktemp("moe"), {}
    for name, config in configs(len(tokenizer)).items():
        torch.manual_seed(0)
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
        _randomize(model)
        model.save_pretrained(root / name)
        tokenizer.save_pretrained(root / name)
        dirs[name] = str(root / name)
    return dirs


GREEDY = SamplingParams(temperature=0, max_tokens=12)


@pytest.mark.parametrize("name", ["qwen3_moe", "mixtral", "olmoe"])
def test_greedy_tokens_equal_hugging_face(moe_dirs, hf_greedy, name):
    prompts = make_prompts(512, n=6, seed=7)
    llm = LLM(moe_dirs[name], dtype="float32")
    assert llm.get_stats()["cpu_kernels"] == "reference"
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], GREEDY, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == hf_greedy(moe_dirs[name], prompts, 12)


def test_decoder_sparse_step_2_puts_the_experts_where_transformers_does(moe_dirs):
    """Qwen3-MoE: layer i has experts when (i + 1) % decoder_sparse_step == 0 and it is not in
    mlp_only_layers. Every other model here has step 1, where a wrong formula agrees; at 2 the dense
    layers must be transformers' own, and the tokens and logprobs (float32) theirs."""
    from transformers import AutoModelForCausalLM
    from conftest import hf_greedy_logprobs, nanopaged_greedy
    folder = moe_dirs["qwen3_moe_step2"]
    theirs = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32, local_files_only=True)
    dense = {i for i, layer in enumerate(theirs.model.layers) if not hasattr(layer.mlp, "experts")}
    ours = ModelConfig.from_dict(json.loads((Path(folder) / "config.json").read_text()))
    assert ours.moe.dense_layers == dense == {0, 2}
    prompts = make_prompts(512, n=4, seed=9)
    llm = LLM(folder, dtype="float32")
    got = nanopaged_greedy(llm, prompts, 8)
    want = hf_greedy_logprobs(folder, prompts, 8, "float32")
    assert [t for t, _ in got] == [t for t, _ in want]
    for (tokens, ours_lp), (_, theirs_lp) in zip(got, want):
        for token, a, b in zip(tokens, ours_lp, theirs_lp):
            assert abs(a[token] - b[token]) < 1e-4, (token, a[token], b[token])


def test_chunked_prefill_preemption_and_the_prefix_cache_keep_the_tokens(moe_dirs, hf_greedy):
    prompts = make_prompts(512, n=6, seed=8, min_len=20, max_len=60)
    prompts += [prompts[0][:40] + [9, 9]]                      # shares a prefix with the first
    want = hf_greedy(moe_dirs["olmoe"], prompts, 12)
    llm = LLM(moe_dirs["olmoe"], dtype="float32", block_size=4, num_kv_blocks=40, max_num_batched_tokens=24)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], GREEDY, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == want
    stats = llm.get_stats()
    assert stats["num_preemptions"] > 0 and stats["prefix_cache_hits"] > 0


def block_pair(experts, top_k, norm, tokens, tie=False):
    """transformers' Qwen3-MoE block and nanopaged's with the same weights, and an input."""
    from transformers import Qwen3MoeConfig
    from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeSparseMoeBlock
    config = Qwen3MoeConfig(hidden_size=16, moe_intermediate_size=8, num_experts=experts, num_experts_per_tok=top_k,
                            norm_topk_prob=norm)
    torch.manual_seed(1)
    theirs = Qwen3MoeSparseMoeBlock(config)
    with torch.no_grad():
        for p in theirs.parameters():
            p.normal_(0, 0.5)
        if tie:
            theirs.gate.weight[1:3] = theirs.gate.weight[0]     # experts 0, 1, 2 score alike for every token
    ours = SparseMoeBlock(16, MoEConfig(experts, top_k, 8, norm, False, frozenset()))
    with torch.no_grad():
        ours.gate.weight.copy_(theirs.gate.weight)
        for e, expert in enumerate(ours.experts):
            expert.gate_up_proj.weight.copy_(theirs.experts.gate_up_proj[e])
            expert.down_proj.weight.copy_(theirs.experts.down_proj[e])
    return theirs, ours, torch.randn(1, tokens, 16)


@pytest.mark.parametrize("experts, top_k, norm, tokens, tie", [
    (8, 2, True, 1, False), (8, 2, False, 300, False), (6, 3, True, 40, True), (64, 2, False, 3, False)])
def test_the_routing_block_equals_transformers(experts, top_k, norm, tokens, tie):
    theirs, ours, x = block_pair(experts, top_k, norm, tokens, tie)
    with torch.no_grad():
        want, got = theirs(x)[0], ours(x[0])
        chosen = ours.route(x[0])[1]
    assert torch.equal(got, want)
    if experts == 64:
        assert len(chosen.unique()) < experts                  # experts no token chose are skipped


@pytest.mark.parametrize("field, value, named", [
    ("shared_expert_intermediate_size", 64, "shared experts"),
    ("n_group", 4, "grouped top-k"),
    ("clip_qkv", 8.0, "clip_qkv"),
    ("num_experts_per_tok", 99, "num_experts_per_tok=99 is more than the 16 experts"),
])
def test_a_config_this_code_does_not_compute_is_refused_by_name(moe_dirs, field, value, named):
    cfg = json.loads((Path(moe_dirs["olmoe"]) / "config.json").read_text())
    with pytest.raises(ValueError, match=named):
        ModelConfig.from_dict({**cfg, field: value})


@pytest.mark.parametrize("kwargs, named", [
    ({"enable_lora": True}, "enable_lora=True runs on dense models"),
])
def test_settings_moe_cannot_run_with_are_refused_by_name(moe_dirs, kwargs, named):
    with pytest.raises(ValueError, match=named):
        LLM(moe_dirs["mixtral"], **{"dtype": "float32", **kwargs})


def test_bfloat16_is_close_to_hugging_face_by_vllms_rule(moe_dirs):
    from conftest import check_logprobs_close, hf_greedy_logprobs, nanopaged_greedy
    prompts = make_prompts(512, n=4, seed=9)
    for name in ("qwen3_moe", "olmoe"):
        llm = LLM(moe_dirs[name], dtype="bfloat16")
        check_logprobs_close(nanopaged_greedy(llm, prompts, 8), hf_greedy_logprobs(moe_dirs[name], prompts, 8, "bfloat16"))


@pytest.mark.parametrize("name", ["qwen3_moe", "mixtral", "olmoe"])
def test_grouped_experts_on_the_fused_path_keep_the_reference_answer_and_batch_invariance(moe_dirs, name):
    """bfloat16 runs the fused layers with the experts grouped (cpu/moe.py) by default: close to the
    reference layers by vLLM's rule, and a request's tokens and logprobs alone equal to those it gets in
    a batch of others (tests/cpu/test_moe_experts.py holds the experts' values to the reference loop)."""
    from conftest import check_logprobs_close, nanopaged_greedy
    from nanopaged.cpu.choose import own_kernel_builds
    if not own_kernel_builds("dpbf16"):
        pytest.skip("no AVX512-BF16 here: the fused path runs nanopaged's bfloat16 kernel")
    prompts = make_prompts(512, n=6, seed=12, min_len=3, max_len=40)
    fused = LLM(moe_dirs[name], dtype="bfloat16", max_num_batched_tokens=32)
    assert fused.get_stats()["cpu_kernels"] == "fused" and fused.get_stats()["batch_invariant"]
    batched = nanopaged_greedy(fused, prompts, 10)
    reference = LLM(moe_dirs[name], dtype="bfloat16", cpu_kernels="reference")
    check_logprobs_close(batched, nanopaged_greedy(reference, prompts, 10))
    alone = [nanopaged_greedy(fused, [p], 10)[0] for p in prompts[:3]]     # alone, and from the prefix cache
    assert alone == batched[:3]
    load = fused.get_stats()["moe"]["tokens_per_expert"]            # counted by the grouped blocks too
    assert load and all(sum(layer) % {"olmoe": 4}.get(name, 2) == 0 and sum(layer) > 0 for layer in load)


@pytest.fixture(scope="module")
def dequantized_olmoe(moe_dirs, tmp_path_factory):
    """The OLMoE folder with every linear nanopaged quantizes replaced by its int4 codes' dequantized values:
    the dense model the int4 one stands for."""
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from nanopaged.cpu.quantized_linear import int4_codes
    folder = tmp_path_factory.mktemp("olmoe-int4-dequantized")
    model = AutoModelForCausalLM.from_pretrained(moe_dirs["olmoe"], dtype=torch.float32)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "layers." in name and ("proj" in name or "experts" in name) and p.dim() >= 2:
                w = p.reshape(-1, p.shape[-1])
                codes, scale, zero = int4_codes(w, 32)
                deq = ((codes.float() - 8).reshape(w.shape[0], -1, 32) * scale[..., None].float()
                       + zero[..., None].float()).reshape(w.shape)
                p.copy_(deq.reshape(p.shape))
    model.save_pretrained(folder)
    AutoTokenizer.from_pretrained(moe_dirs["olmoe"]).save_pretrained(folder)
    return str(folder)


def test_quantized_experts_stay_close_to_the_model_they_stand_for(moe_dirs, dequantized_olmoe):
    """int8 against the dense model, int4 against its own dequantized weights (vLLM's rule both)."""
    from conftest import check_logprobs_close, nanopaged_greedy
    prompts = make_prompts(512, n=4, seed=10)
    for method, dense_dir in (("int8", moe_dirs["olmoe"]), ("int4", dequantized_olmoe)):
        llm = LLM(moe_dirs["olmoe"], dtype="bfloat16", quantization=method)
        assert llm.get_stats()["quantization"]["quantized_linears"] == 3 * (2 + 2 * 16)   # attention, 16 experts x 2
        check_logprobs_close(nanopaged_greedy(llm, prompts, 8), nanopaged_greedy(LLM(dense_dir, dtype="bfloat16"),
                                                                                   prompts, 8))


def test_quantization_gguf_on_a_moe_folder_without_its_file_names_what_is_missing(moe_dirs):
    """GGUF files of mixtures run as they ship (tests/models/test_moe_gguf.py); a folder needs its file."""
    with pytest.raises(ValueError, match=r"quantization='gguf' needs the model's GGUF file"):
        LLM(moe_dirs["olmoe"], dtype="bfloat16", quantization="gguf")


def test_get_stats_counts_the_tokens_each_expert_took(moe_dirs):
    llm = LLM(moe_dirs["qwen3_moe"], dtype="float32", enable_prefix_caching=False)
    assert llm.get_stats()["moe"]["max_over_mean"] == 0.0    # nothing routed yet
    outs = llm.generate([{"prompt_token_ids": [5, 6, 7, 8]}] * 3, GREEDY, use_tqdm=False)
    load = llm.get_stats()["moe"]
    computed = 3 * (4 + 12 - 1)                               # every prompt token and every output but the last
    assert len(load["tokens_per_expert"]) == 2                # layers 0 and 2: layer 1 is dense (mlp_only_layers)
    assert all(sum(layer) == 2 * computed for layer in load["tokens_per_expert"])     # top-2
    assert load["max_over_mean"] >= 1.0 and all(len(o.outputs[0].token_ids) == 12 for o in outs)
    assert load["steps"] == 12                                # one prefill step of the three, eleven decode steps
    assert all(sum(layer) == 2 * 3 for layer in load["last_step"])     # the last step: one token of each request
    llm.reset_stats()
    reset = llm.get_stats()["moe"]
    assert all(sum(layer) == 0 for layer in reset["tokens_per_expert"] + reset["last_step"]) and reset["steps"] == 0


def test_a_bfloat16_model_is_built_in_bfloat16_not_in_float32_first(moe_dirs):
    """OLMoE-1B-7B's 6.9B parameters take 28 GB in float32: the layers are made in the model's dtype, and the
    process's default dtype is given back."""
    llm = LLM(moe_dirs["olmoe"], dtype="bfloat16", cpu_kernels="reference")
    model = llm.llm_engine.runner.build_model()
    assert {p.dtype for p in model.parameters()} == {torch.bfloat16}
    assert torch.get_default_dtype() == torch.float32


@pytest.mark.parametrize("name", ["qwen3_moe", "mixtral", "olmoe"])
def test_experts_stacked_in_one_tensor_load_as_experts_stored_one_by_one(moe_dirs, tmp_path, name):
    """A checkpoint of transformers' own parameters: each layer's experts in one (experts, 2 x width, hidden)
    gate_up_proj and one (experts, hidden, width) down_proj; the same greedy tokens as the folder that stores
    them one by one (itself equal to Hugging Face's)."""
    import shutil
    from safetensors.torch import save_file
    from transformers import AutoModelForCausalLM
    state = AutoModelForCausalLM.from_pretrained(moe_dirs[name], dtype=torch.float32).state_dict()
    assert any(k.endswith("experts.gate_up_proj") and v.dim() == 3 for k, v in state.items())
    for f in Path(moe_dirs[name]).iterdir():
        if f.suffix != ".safetensors":
            shutil.copy(f, tmp_path / f.name)
    save_file({k: v.contiguous() for k, v in state.items()}, str(tmp_path / "model.safetensors"))
    prompts = [{"prompt_token_ids": p} for p in make_prompts(512, n=3, seed=13)]
    stacked = LLM(str(tmp_path), dtype="float32").generate(prompts, GREEDY, use_tqdm=False)
    one_by_one = LLM(moe_dirs[name], dtype="float32").generate(prompts, GREEDY, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in stacked] == [o.outputs[0].token_ids for o in one_by_one]
