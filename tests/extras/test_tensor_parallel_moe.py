"""Tensor parallelism for mixtures of experts: every expert split like a dense MLP, the router replicated.

Greedy tokens with tensor_parallel_size=2 equal tensor_parallel_size=1 on tiny Qwen3-MoE (a dense layer
among the sparse ones), Mixtral (w1/w2/w3 names) and OLMoE (q/k norm over the whole projection), under a
pool small enough to preempt and a token budget small enough to chunk prompts; each rank holds half of
every expert and the whole router; one all-reduce per MoE layer, not one per expert; get_stats()["moe"]
counts on rank 0 what one process counts; an expert width N does not divide is refused by name before
any process starts. With enable_expert_parallel=True (whole experts, E/N a rank) the same tokens and
counts, each rank holding only its own experts, at full width; its refusals by name.
docs/09_tensor_parallel.md.
"""
import json
import multiprocessing
import shutil

import pytest
import torch
import torch.distributed as dist

from conftest import EOS_TOKEN_ID, _randomize, _tiny_tokenizer, make_prompts
from nanopaged import LLM, SamplingParams
from nanopaged.config import EngineConfig
from nanopaged.extras.tensor_parallel.layers import rank_config

# a hang guard, for a busy machine: the module's first test runs the fixture below, six LLMs, three
# of them with two ranks
pytestmark = pytest.mark.timeout(900)

ARCHS = ["qwen3_moe", "mixtral", "olmoe"]
# preemption (24 blocks of 8 for 8 prompts of up to 60 tokens), chunked prefill (20 tokens a step)
TIGHT = {"block_size": 8, "num_kv_blocks": 24, "max_num_batched_tokens": 20, "max_num_seqs": 4}
PROMPTS = make_prompts(512, n=8, seed=1, min_len=3, max_len=60)
GREEDY = SamplingParams(temperature=0, max_tokens=16)
COMMON = dict(hidden_size=64, num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2,
              max_position_embeddings=512, bos_token_id=1, eos_token_id=EOS_TOKEN_ID, pad_token_id=EOS_TOKEN_ID,
              tie_word_embeddings=False, dtype="float32")


def configs(vocab_size):
    """tests/models/test_moe.py's three tiny mixtures of experts, smaller still where that keeps them apart."""
    from transformers import MixtralConfig, OlmoeConfig, Qwen3MoeConfig
    return {
        # 8 experts of width 32, top-2 renormalised; layer 1 dense (mlp_only_layers), width 96
        "qwen3_moe": Qwen3MoeConfig(vocab_size=vocab_size, **COMMON, head_dim=32, intermediate_size=96,
                                    moe_intermediate_size=32, num_experts=8, num_experts_per_tok=2,
                                    norm_topk_prob=True, mlp_only_layers=[1]),
        # 4 experts of width 48, top-2, weights kept in float32
        "mixtral": MixtralConfig(vocab_size=vocab_size, **COMMON, intermediate_size=48, num_local_experts=4,
                                 num_experts_per_tok=2, sliding_window=None),
        # 16 experts of width 32, top-4, not renormalised, q/k norm over the whole projection
        "olmoe": OlmoeConfig(vocab_size=vocab_size, **COMMON, intermediate_size=32, num_experts=16,
                             num_experts_per_tok=4),
    }


@pytest.fixture(scope="module")
def moe_dirs(tmp_path_factory):
    from transformers import AutoModelForCausalLM
    tokenizer, root, dirs = _tiny_tokenizer(), tmp_path_factory.mktemp("tp-moe"), {}
    for name, config in configs(len(tokenizer)).items():
        torch.manual_seed(0)
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
        _randomize(model)
        model.save_pretrained(root / name)
        tokenizer.save_pretrained(root / name)
        dirs[name] = str(root / name)
    return dirs


def run_workload(llm) -> dict:
    llm.reset_stats()
    tokens = [o.outputs[0].token_ids for o in llm.generate([{"prompt_token_ids": p} for p in PROMPTS], GREEDY,
                                                           use_tqdm=False)]
    return {"tokens": tokens, "stats": llm.get_stats()}


def all_reduces_in_one_step(llm) -> int:
    """The all-reduces rank 0 calls in one prefill step of a short prompt."""
    group, calls = llm.llm_engine.runner.group, []
    reduce = group.all_reduce

    def counted(x):
        calls.append(tuple(x.shape))
        return reduce(x)
    group.all_reduce = counted            # the parallel layers call it through this same group
    try:
        llm.generate([{"prompt_token_ids": [5, 6, 7]}], SamplingParams(temperature=0, max_tokens=1), use_tqdm=False)
    finally:
        del group.all_reduce
    return len(calls)


def one_and_two_ranks(moe_dirs, **settings) -> dict:
    """Per architecture: the workload at N = 1 and N = 2 (`settings` beside tensor_parallel_size=2), rank 0's
    parameter shapes, every rank's weight bytes, and the all-reduces of one step. One N = 2 LLM at a time,
    shut down before the next."""
    found = {}
    for arch in ARCHS:
        one = LLM(moe_dirs[arch], dtype="float32", **TIGHT)
        two = LLM(moe_dirs[arch], dtype="float32", tensor_parallel_size=2, **settings, **TIGHT)
        runner = two.llm_engine.runner
        found[arch] = {
            1: run_workload(one), 2: run_workload(two),
            "shapes": ({n: tuple(p.shape) for n, p in one.llm_engine.runner.model.named_parameters()},
                       {n: tuple(p.shape) for n, p in runner.model.named_parameters()}),
            "memory": runner.memory, "share_bytes": runner.share_bytes(),
            "all_reduces": all_reduces_in_one_step(two),
        }
        runner.shutdown()
    return found


@pytest.fixture(scope="module")
def results(moe_dirs):
    """Experts sliced: each rank holds 1/N of every expert."""
    return one_and_two_ranks(moe_dirs)


@pytest.mark.parametrize("arch", ARCHS)
def test_greedy_tokens_with_two_ranks_equal_one_rank(results, arch):
    one, two = results[arch][1], results[arch][2]
    assert two["tokens"] == one["tokens"]
    assert two["stats"]["num_preemptions"] > 0                        # the pool really was too small
    assert two["stats"]["num_steps"] >= sum(map(len, PROMPTS)) / 20   # prompts were chunked
    assert len({tuple(t) for t in two["tokens"]}) > 4                 # not a vacuous comparison


@pytest.mark.parametrize("arch", ARCHS)
def test_rank_0_counts_the_tokens_each_expert_took(results, arch):
    # every rank routes alike, so rank 0's count is the whole model's
    one, two = results[arch][1]["stats"]["moe"], results[arch][2]["stats"]["moe"]
    assert two["tokens_per_expert"] == one["tokens_per_expert"]
    assert two["max_over_mean"] == one["max_over_mean"] >= 1.0


@pytest.mark.parametrize("arch", ARCHS)
def test_each_rank_holds_half_of_every_expert_and_the_whole_router(results, arch):
    full, rank0 = results[arch]["shapes"]
    assert full.keys() == rank0.keys()
    hidden, width = full["model.layers.0.mlp.experts.0.down_proj.weight"]
    for name, shape in full.items():
        if ".experts." in name and "gate_up_proj" in name:            # (2 I, hidden): gate's half, up's half
            assert rank0[name] == (shape[0] // 2, shape[1]), name
        elif ".experts." in name:                                      # down_proj (hidden, I)
            assert rank0[name] == (shape[0], shape[1] // 2), name
        elif name.endswith("mlp.gate.weight"):                         # the router: replicated
            assert rank0[name] == shape, name
    assert rank0["model.layers.0.mlp.experts.0.down_proj.weight"] == (hidden, width // 2)
    if arch == "qwen3_moe":                                            # layer 1 is dense and sharded as today
        assert rank0["model.layers.1.mlp.gate_up_proj.weight"] == (96, 64)
        assert rank0["model.layers.1.mlp.down_proj.weight"] == (64, 48)
    if arch == "olmoe":                                                # q/k norm: this rank's heads only
        name = "model.layers.0.self_attn.q_norm.weight"
        assert rank0[name] == (full[name][0] // 2,)
    (w0, _), (w1, _) = results[arch]["memory"]
    assert w0 == w1


@pytest.mark.parametrize("arch", ARCHS)
def test_one_all_reduce_per_moe_layer_not_one_per_expert(results, arch):
    # the embedding, then per layer o_proj and the MLP (dense or MoE); OLMoE adds its q and k norms
    per_layer = 2 + 2 * (arch == "olmoe")
    assert results[arch]["all_reduces"] == 1 + 3 * per_layer


# ---- bad settings ---------------------------------------------------------------------
@pytest.mark.parametrize("arch, field, value, message", [
    ("qwen3_moe", "moe_intermediate_size", 33, "must divide the model's moe_intermediate_size=33"),
    ("mixtral", "intermediate_size", 47, "must divide the model's moe_intermediate_size=47"),   # its experts' width
    ("qwen3_moe", "intermediate_size", 95, "must divide the model's intermediate_size=95"),    # its dense layer's
])
def test_an_expert_width_two_ranks_cannot_split_is_refused_by_name(moe_dirs, tmp_path, arch, field, value, message):
    folder = tmp_path / arch
    shutil.copytree(moe_dirs[arch], folder)
    cfg = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**cfg, field: value}))
    with pytest.raises(ValueError) as e:
        LLM(str(folder), dtype="float32", tensor_parallel_size=2)
    assert f"tensor_parallel_size=2 {message}" in str(e.value)
    assert not multiprocessing.active_children() and not dist.is_initialized()


def test_weights_larger_than_the_machine_are_refused_before_any_rank_starts(moe_dirs, monkeypatch):
    """On CPU every rank shares this machine's memory: the whole model must fit, checked before a process starts."""
    import nanopaged.config
    import nanopaged.extras.tensor_parallel.runner as tp_runner
    from nanopaged.models.loader import weight_bytes
    need = weight_bytes(moe_dirs["olmoe"], torch.float32)
    monkeypatch.setattr(nanopaged.config, "_free_memory", lambda device: need - 1)
    monkeypatch.setattr(tp_runner.ps, "host_store", lambda n: pytest.fail("a rank was started"))
    with pytest.raises(ValueError, match=rf"the model's weights, over its 2 ranks needs .* \({need:,} bytes needed"):
        LLM(moe_dirs["olmoe"], dtype="float32", tensor_parallel_size=2)


def test_experts_stacked_in_one_tensor_are_refused_by_the_shard_loader_by_name():
    from nanopaged.extras.tensor_parallel.shard_loader import shard_of
    with pytest.raises(ValueError, match=r"experts\.gate_up_proj: tensor parallelism reads a mixture's experts "
                                         r"stored one by one"):
        shard_of(None, "model.layers.0.mlp.experts.gate_up_proj")


# ---- expert parallelism: whole experts, E/N a rank -------------------------------------
@pytest.fixture(scope="module")
def ep_results(moe_dirs):
    """Expert parallelism: two ranks holding half of the experts each, whole."""
    return one_and_two_ranks(moe_dirs, enable_expert_parallel=True)


@pytest.mark.parametrize("arch", ARCHS)
def test_greedy_tokens_with_experts_placed_across_two_ranks_equal_one_rank(ep_results, arch):
    one, ep = ep_results[arch][1], ep_results[arch][2]
    assert ep["tokens"] == one["tokens"]
    assert ep["stats"]["num_preemptions"] > 0                        # the pool really was too small
    assert ep["stats"]["num_steps"] >= sum(map(len, PROMPTS)) / 20   # prompts were chunked
    assert len({tuple(t) for t in ep["tokens"]}) > 4                 # not a vacuous comparison


@pytest.mark.parametrize("arch", ARCHS)
def test_rank_0_counts_every_experts_tokens_though_it_holds_half_of_them(ep_results, arch):
    one, ep = ep_results[arch][1]["stats"]["moe"], ep_results[arch][2]["stats"]["moe"]
    assert len(ep["tokens_per_expert"][0]) == len(one["tokens_per_expert"][0])   # all E, not E/N
    assert ep["tokens_per_expert"] == one["tokens_per_expert"]


def _expert(name: str) -> int | None:
    parts = name.split(".")
    return int(parts[parts.index("experts") + 1]) if "experts" in parts else None


@pytest.mark.parametrize("arch", ARCHS)
def test_each_rank_holds_half_of_the_experts_whole_and_the_whole_router(ep_results, arch):
    full, rank0 = ep_results[arch]["shapes"]
    num_experts = 1 + max(_expert(n) for n in full if _expert(n) is not None)
    local = {n for n in rank0 if _expert(n) is not None}
    assert {_expert(n) for n in local} == set(range(num_experts // 2))    # experts 0 .. E/2 - 1, renumbered
    assert all(rank0[n] == full[n] for n in local)                         # each at full width
    assert len(local) == sum(_expert(n) is not None for n in full) // 2
    for name, shape in full.items():
        if name.endswith("mlp.gate.weight"):                               # the router scores all E
            assert rank0[name] == shape, name
    expert_values = sum(torch.Size(s).numel() for n, s in full.items() if _expert(n) is not None)
    assert sum(torch.Size(rank0[n]).numel() for n in local) == expert_values // 2
    (w0, _), (w1, _) = ep_results[arch]["memory"]
    assert w0 == w1 == 4 * sum(torch.Size(s).numel() for s in rank0.values())   # float32; rank 1 alike


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("placement", ["sliced", "whole"])
def test_the_bytes_a_rank_checks_before_loading_are_the_bytes_it_holds(results, ep_results, arch, placement):
    found = (results if placement == "sliced" else ep_results)[arch]
    (w0, _), (w1, _) = found["memory"]
    assert found["share_bytes"] == w0 == w1
    full = results[arch]["shapes"][0]
    assert w0 < 4 * sum(torch.Size(s).numel() for s in full.values()) * 0.6     # about half the model, not all of it


@pytest.mark.parametrize("arch", ARCHS)
def test_experts_across_ranks_add_no_all_reduce(ep_results, arch):
    per_layer = 2 + 2 * (arch == "olmoe")                   # as test_one_all_reduce_per_moe_layer_not_one_per_expert
    assert ep_results[arch]["all_reduces"] == 1 + 3 * per_layer


def _edited(moe_dirs, tmp_path, arch, **fields):
    folder = tmp_path / arch
    shutil.copytree(moe_dirs[arch], folder)
    cfg = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**cfg, **fields}))
    return str(folder)


def test_experts_whose_width_two_ranks_cannot_split_may_still_be_placed_whole(moe_dirs, tmp_path):
    folder = _edited(moe_dirs, tmp_path, "mixtral", intermediate_size=47)      # Mixtral's experts' width
    with pytest.raises(ValueError, match="must divide the model's moe_intermediate_size=47"):
        EngineConfig(folder, dtype="float32", tensor_parallel_size=2)
    cfg = EngineConfig(folder, dtype="float32", tensor_parallel_size=2, enable_expert_parallel=True)
    moe = rank_config(cfg.model_config, 2, expert_parallel=True).moe
    assert (moe.num_experts, moe.intermediate_size) == (2, 47)


@pytest.mark.parametrize("settings, message", [
    ({"tensor_parallel_size": 1}, r"enable_expert_parallel=True needs tensor_parallel_size > 1 .*got "
                                  r"tensor_parallel_size=1"),
    ({"tensor_parallel_size": 2, "dense": True}, r"enable_expert_parallel=True needs a mixture-of-experts model; "
                                                 r"this one is dense"),
    ({"tensor_parallel_size": 2, "num_local_experts": 3}, r"tensor_parallel_size=2 must divide the model's "
                                                          r"num_experts=3"),
])
def test_expert_parallelism_without_ranks_a_mixture_or_a_divisible_expert_count_is_refused_by_name(
        moe_dirs, tiny_model_dirs, tmp_path, settings, message):
    settings = dict(settings)
    folder = moe_dirs["mixtral"]
    if settings.pop("dense", False):
        folder = tiny_model_dirs["llama"]
    if "num_local_experts" in settings:
        folder = _edited(moe_dirs, tmp_path, "mixtral", num_local_experts=settings.pop("num_local_experts"))
    with pytest.raises(ValueError, match=message):
        LLM(folder, dtype="float32", enable_expert_parallel=True, **settings)
    assert not multiprocessing.active_children() and not dist.is_initialized()


def test_an_expert_load_balancer_is_refused_by_name(moe_dirs):
    with pytest.raises(ValueError, match=r"enable_eplb=True is not supported: nanopaged has no expert load balancer"):
        LLM(moe_dirs["mixtral"], dtype="float32", tensor_parallel_size=2, enable_expert_parallel=True,
            enable_eplb=True)
    assert not multiprocessing.active_children() and not dist.is_initialized()
