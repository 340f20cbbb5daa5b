"""bench.py --workload multimodal (benchmarks/multimodal.py) on a tiny random SmolVLM: the folder loads as
transformers' own model and processor, the trace shares its images and uses every one, a shared image is encoded
once, and vLLM (where scripts/setup_vllm_peer.sh has set it up) answers the same conversations with the same
prompt tokens."""
import json
import os

import pytest

import bench
from benchmarks.multimodal import chat_trace
from benchmarks.peers import side_python

REQUESTS, IMAGES, TOKENS = 4, 2, 3
VLLM = side_python(bench.parse_args(["--workload", "multimodal"]), "vllm") is not None


@pytest.fixture(scope="module")
def tiny_vlm(tmp_path_factory):
    cache = tmp_path_factory.mktemp("vlm-cache")
    old = os.environ.get("NANOPAGED_CACHE")
    os.environ["NANOPAGED_CACHE"] = str(cache)
    try:
        result = bench.main(["--random-weights", "tiny-smolvlm", "--num-requests", str(REQUESTS), "--num-images",
                             str(IMAGES), "--output-len", str(TOKENS), str(TOKENS), "--dtype", "float32",
                             "--peers", "vllm" if VLLM else "none"])
    finally:
        os.environ.pop("NANOPAGED_CACHE") if old is None else os.environ.__setitem__("NANOPAGED_CACHE", old)
    return result, cache / "bench" / "tiny-smolvlm-random-v2"


def test_the_random_vlm_folder_loads_as_transformers_model_and_processor(tiny_vlm):
    from transformers import AutoProcessor, Idefics3ForConditionalGeneration
    _, folder = tiny_vlm
    model, info = Idefics3ForConditionalGeneration.from_pretrained(folder, output_loading_info=True)
    assert not any(info.values()), info
    processor = AutoProcessor.from_pretrained(folder)
    assert processor.image_seq_len == 4 and model.config.image_token_id == processor.image_token_id
    assert json.loads((folder / "config.json").read_text())["architectures"] == ["Idefics3ForConditionalGeneration"]


def test_the_trace_shares_its_images_uses_every_one_and_is_the_same_for_a_seed():
    conversations, which, warm = chat_trace(6, 3, seed=0)
    assert len(conversations) == len(which) == 6 and sorted(set(which)) == [0, 1, 2]
    url = [c[0]["content"][1]["image_url"]["url"] for c in conversations]
    assert all((url[i] == url[j]) == (which[i] == which[j]) for i in range(6) for j in range(6))
    assert warm[0]["content"][1]["image_url"]["url"] not in url          # the warm-up's image is its own
    assert chat_trace(6, 3, seed=0)[0] == conversations and chat_trace(6, 3, seed=1)[0] != conversations


def test_a_shared_image_is_encoded_once_and_every_request_gets_its_tokens(tiny_vlm):
    r, _ = tiny_vlm
    e = r["engine"]
    assert r["settings"]["distinct_images"] == IMAGES and e["output_tokens"] == REQUESTS * TOKENS
    assert e["multimodal"]["encoder_calls"] == IMAGES
    assert r["targets"]["shared images encoded once (encoder calls = distinct images)"]["met"]
    assert 0 < e["ttft"]["p50_s"] <= e["ttft"]["max_s"] <= e["wall_s"]
    assert e["prompt_tokens"] > REQUESTS * 4         # every prompt holds at least one tile of 4 image tokens


@pytest.mark.skipif(not VLLM, reason="no vLLM environment: scripts/setup_vllm_peer.sh builds it")
def test_vllm_answers_the_same_conversations_with_the_same_prompt_tokens(tiny_vlm):
    r, _ = tiny_vlm
    v = r["vllm"]
    assert "error" not in v, v.get("error")
    assert v["output_tokens"] == REQUESTS * TOKENS and v["prompt_tokens"] == r["engine"]["prompt_tokens"]
    assert 0 < v["ttft"]["p50_s"] <= v["ttft"]["max_s"] <= v["wall_s"]
    assert "out tok/s >= 1.5x vLLM CPU's" in r["targets"]


def test_the_image_pool_must_fit_the_trace(capsys):
    with pytest.raises(SystemExit):
        bench.parse_args(["--workload", "multimodal", "--num-requests", "2", "--num-images", "3"])
    assert "--num-images needs 1 <= IMAGES <= --num-requests (2), got 3" in capsys.readouterr().err
    assert bench.parse_args(["--random-weights", "tiny-smolvlm"]).workload == "multimodal"
    assert bench.parse_args(["--workload", "multimodal"]).random_weights == "smolvlm-256m"
