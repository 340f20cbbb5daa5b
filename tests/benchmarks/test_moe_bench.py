"""bench.py --workload moe (benchmarks/moe.py) on a tiny random OLMoE: the model written a layer at a time
and loaded as transformers would lay it out, the figures and targets it reports, and the active-weight
floor's bytes counted by hand."""
import json

import pytest

import bench
from benchmarks.moe import active_bytes


@pytest.fixture(scope="module")
def tiny_moe(tmp_path_factory):
    import os
    cache = tmp_path_factory.mktemp("moe-cache")
    old = os.environ.get("NANOPAGED_CACHE")
    os.environ["NANOPAGED_CACHE"] = str(cache)
    try:
        result = bench.main(["--random-weights", "tiny-olmoe", "--num-requests", "3", "--input-len", "4", "8",
                             "--output-len", "2", "6"])
    finally:
        os.environ.pop("NANOPAGED_CACHE") if old is None else os.environ.__setitem__("NANOPAGED_CACHE", old)
    return result, cache / "bench" / "tiny-olmoe-random-v2"


def test_random_moe_weights_are_written_a_layer_at_a_time_as_transformers_lays_them_out(tiny_moe):
    _, folder = tiny_moe
    assert sorted(p.name for p in folder.glob("*.safetensors")) == ["model-layer00.safetensors",
                                                                     "model-layer01.safetensors",
                                                                     "model-outer.safetensors"]
    from transformers import AutoModelForCausalLM
    model, info = AutoModelForCausalLM.from_pretrained(folder, output_loading_info=True)
    assert not any(info.values()), info
    assert json.loads((folder / "config.json").read_text())["architectures"] == ["OlmoeForCausalLM"]


def test_the_moe_workload_reports_the_trace_one_request_and_the_floor(tiny_moe):
    r, _ = tiny_moe
    assert r["workload"] == "moe" and 3 * 2 <= r["engine"]["output_tokens"] <= 3 * 6
    assert r["engine"]["output_tokens_per_s"] > 0 and r["engine"]["decode_tokens_per_s"] > 0
    assert r["engine"]["stats"]["cpu_kernels"] in ("fused", "reference")
    floor = r["floor"]
    assert floor["decode_tokens_per_s"] == pytest.approx(floor["read_bytes_per_s"] / floor["active_weight_bytes"])
    assert floor["fraction"] == pytest.approx(r["engine"]["decode_tokens_per_s"] / floor["decode_tokens_per_s"])
    assert list(r["targets"]) == ["one request at a time >= 60% of the active-weight floor"]   # no peer asked
    assert "vllm" not in r and r["machine"]["matrix_flags"] is not None


def test_the_active_weight_floor_counts_attention_router_top_k_experts_and_the_head(tiny_moe):
    _, folder = tiny_moe
    from nanopaged import LLM
    llm = LLM(str(folder), dtype="bfloat16", num_kv_blocks=16)
    attention, expert, router, head = 128 * (2 * 128 + 2 * 128), 3 * 128 * 64, 8 * 128, 4096 * 128
    assert active_bytes(llm) == 2 * (2 * (attention + 2 * expert + router) + head)    # bfloat16, 2 layers, top-2


def test_the_moe_workload_takes_a_mixture_of_experts_only(capsys):
    with pytest.raises(SystemExit):
        bench.parse_args(["--workload", "moe", "--random-weights", "tiny-qwen3"])
    assert "--workload moe takes --random-weights" in capsys.readouterr().err
    assert bench.parse_args(["--random-weights", "tiny-olmoe"]).workload == "moe"
