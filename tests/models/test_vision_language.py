"""Vision-language models through the whole engine: greedy float32 tokens equal transformers' generate.

Two tiny random families as transformers saves them (tests/models/vlm_fixtures.py): Idefics3 (SmolVLM's: a
SigLIP tower, pixel shuffle, images split into tiles) and Qwen2.5-VL (its own encoder, multimodal rotary
positions). Each under what changes how the engine computes: one and two images, a batch beside text-only
requests, chunked prefill cutting through an image, preemption (the encoder output recomputed or reused),
prefix hits with the same image and misses with another; shared images encoded once; bad images refused.
"""
import re

import numpy as np
import pytest
import torch
from PIL import Image

from conftest import check_logprobs_close
from nanopaged import LLM, SamplingParams
from nanopaged.worker.vision_runner import VISION_LANGUAGE_MODELS
from vlm_fixtures import tiny_idefics3, tiny_qwen2_5_vl

MAX_TOKENS = 8
GREEDY = SamplingParams(temperature=0, max_tokens=MAX_TOKENS)     # stops at EOS, as transformers' generate
FAMILIES = {
    # family: (builder, the placeholder one image takes in a prompt's text)
    "idefics3": (tiny_idefics3, "<image>"),
    "qwen2_5_vl": (tiny_qwen2_5_vl, "<|vision_start|><|image_pad|><|vision_end|>"),
}


def image(seed: int, size=(96, 64)) -> Image.Image:
    pixels = np.random.default_rng(seed).integers(0, 256, (size[1], size[0], 3), dtype=np.uint8)
    return Image.fromarray(pixels)


def prompt(family: str, num_images: int, text: str = "what is here?") -> str:
    return "User:" + FAMILIES[family][1] * num_images + f" {text}\nAssistant:"


@pytest.fixture(scope="module", params=sorted(FAMILIES))
def vlm(request, tmp_path_factory):
    family = request.param
    folder = tmp_path_factory.mktemp(family)
    FAMILIES[family][0](folder)
    return family, str(folder)


@pytest.fixture(scope="module")
def hf_generate(vlm):
    """transformers' own greedy continuation of (prompt, images)."""
    from transformers import AutoModelForImageTextToText
    family, folder = vlm
    model = AutoModelForImageTextToText.from_pretrained(folder, dtype=torch.float32).eval()
    processor = VISION_LANGUAGE_MODELS[model.config.architectures[0]].load_processor(folder)

    def run(text: str, images: list) -> list[int]:
        inputs = processor(text=text, images=images or None, return_tensors="pt")
        with torch.no_grad():
            out = model.generate(**inputs, max_new_tokens=MAX_TOKENS, do_sample=False)
        return out[0, inputs["input_ids"].shape[1]:].tolist()
    return run


def make_llm(folder, **kwargs) -> LLM:
    return LLM(folder, dtype="float32", **kwargs)


def tokens(llm, prompts) -> list[list[int]]:
    return [list(o.outputs[0].token_ids) for o in llm.generate(prompts, GREEDY, use_tqdm=False)]


def mm(family, images, text="what is here?"):
    return {"prompt": prompt(family, len(images), text), "multi_modal_data": {"image": images}}


def test_one_and_two_images_equal_transformers(vlm, hf_generate):
    family, folder = vlm
    llm = make_llm(folder)
    one, two = [image(1)], [image(2), image(3, (40, 90))]
    got = tokens(llm, [mm(family, one), mm(family, two)])
    assert got == [hf_generate(prompt(family, 1), one), hf_generate(prompt(family, 2), two)]


def test_a_batch_beside_text_only_requests_equals_each_alone(vlm, hf_generate):
    family, folder = vlm
    llm = make_llm(folder)
    batch = [mm(family, [image(4)]), prompt(family, 0, "just text"), mm(family, [image(5), image(4)])]
    got = tokens(llm, batch)
    assert got[0] == hf_generate(prompt(family, 1), [image(4)])
    assert got[1] == hf_generate(prompt(family, 0, "just text"), [])
    assert got[2] == hf_generate(prompt(family, 2), [image(5), image(4)])
    assert llm.get_stats()["multimodal"]["encoder_calls"] == 2        # image(4) twice: encoded once


def test_chunked_prefill_cutting_through_an_image_changes_no_token(vlm, hf_generate):
    family, folder = vlm
    images = [image(6), image(7)]
    for budget in (5, 16):                 # chunks of 5 and 16 tokens cut through both images' spans
        llm = make_llm(folder, max_num_batched_tokens=budget, max_num_encoder_input_tokens=64,
                       enable_prefix_caching=False)
        assert tokens(llm, [mm(family, images)]) == [hf_generate(prompt(family, 2), images)]


def test_preemption_recomputes_or_reuses_the_encoder_output_and_changes_no_token(vlm):
    """Long outputs in a small cache preempt; every token equals the run with room to spare (itself equal to
    transformers' above), whether the image's encoder output was recomputed or found in the cache."""
    family, folder = vlm
    requests = [mm(family, [image(10 + i)], f"question {i} " * 3) for i in range(4)]
    params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    roomy = make_llm(folder, enable_prefix_caching=False)
    want = [o.outputs[0].token_ids for o in roomy.generate(requests, params, use_tqdm=False)]
    longest = max(len(o.prompt_token_ids) for o in roomy.generate(requests, params, use_tqdm=False))
    # room for two requests' prompts and a little: their outputs' growth preempts the newest
    llm = make_llm(folder, block_size=16, num_kv_blocks=2 * (longest // 16 + 1) + 1, enable_prefix_caching=False)
    assert [o.outputs[0].token_ids for o in llm.generate(requests, params, use_tqdm=False)] == want
    stats = llm.get_stats()
    assert stats["num_preemptions"] > 0 and stats["multimodal"]["encoder_calls"] >= len(requests)


def test_a_prefix_hit_needs_the_same_image_and_another_image_misses(vlm):
    family, folder = vlm
    llm = make_llm(folder, block_size=16)
    cat, dog = image(20), image(21)
    first = llm.generate(mm(family, [cat]), GREEDY, use_tqdm=False)[0]
    same = llm.generate(mm(family, [cat]), GREEDY, use_tqdm=False)[0]
    other = llm.generate(mm(family, [dog]), GREEDY, use_tqdm=False)[0]
    span = llm.llm_engine.input_processor.process("probe", mm(family, [dog]))[0].encoder_inputs[0]
    assert same.num_cached_tokens > span.offset + span.length - 16     # past the image: its K/V reused
    assert same.outputs[0].token_ids == first.outputs[0].token_ids
    assert other.num_cached_tokens <= span.offset                       # stops before the image's first block
    fresh = make_llm(folder, enable_prefix_caching=False)
    assert other.outputs[0].token_ids == fresh.generate(mm(family, [dog]), GREEDY, use_tqdm=False)[0].outputs[0].token_ids


@pytest.mark.parametrize("bad, match", [
    (b"not an image", r"multi_modal_data\['image'\]\[0\]"),
    ("a string", r"multi_modal_data\['image'\]\[0\]"),
])
def test_a_bad_image_is_refused_by_name_and_the_engine_serves_on(vlm, bad, match):
    family, folder = vlm
    llm = make_llm(folder)
    with pytest.raises(ValueError, match=match):
        llm.generate(mm(family, [bad]), GREEDY, use_tqdm=False)
    with pytest.raises(ValueError, match="2 images"):
        llm.generate({"prompt": prompt(family, 1), "multi_modal_data": {"image": [image(1), image(2)]}}, GREEDY,
                     use_tqdm=False)
    assert tokens(llm, [mm(family, [image(1)])])          # the engine serves the next request


def test_the_default_bfloat16_path_is_close_to_transformers_in_bfloat16(vlm):
    """LLM(folder) as it runs by default (bfloat16; on a CPU with bfloat16 units the packed linears, the
    vision tower's included, and the fused layer loop taking the images' rows) by vLLM's logprob rule."""
    from transformers import AutoModelForImageTextToText
    family, folder = vlm
    requests = [mm(family, [image(30)]), mm(family, [image(31), image(32, (40, 90))])]
    params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True, logprobs=5)
    ours = [(o.outputs[0].token_ids, [{t: lp.logprob for t, lp in d.items()} for d in o.outputs[0].logprobs])
            for o in LLM(folder, dtype="bfloat16").generate(requests, params, use_tqdm=False)]
    model = AutoModelForImageTextToText.from_pretrained(folder, dtype=torch.bfloat16).eval()
    processor = VISION_LANGUAGE_MODELS[model.config.architectures[0]].load_processor(folder)
    theirs = []
    for r in requests:
        inputs = processor(text=r["prompt"], images=r["multi_modal_data"]["image"], return_tensors="pt")
        with torch.no_grad():
            out = model.generate(**inputs, max_new_tokens=MAX_TOKENS, min_new_tokens=MAX_TOKENS, do_sample=False,
                                 output_logits=True, return_dict_in_generate=True)
        tops = [dict(zip(*[x.tolist() for x in reversed(torch.log_softmax(l[0].float(), -1).topk(5))]))
                for l in out.logits]
        theirs.append((out.sequences[0, inputs["input_ids"].shape[1]:].tolist(), tops))
    check_logprobs_close(ours, theirs)


def test_ngram_drafts_verified_over_an_image_prompt_change_no_token(vlm):
    family, folder = vlm
    requests = [mm(family, [image(40)], "repeat repeat repeat"), mm(family, [image(41), image(40)])]
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    plain = [o.outputs[0].token_ids for o in make_llm(folder).generate(requests, params, use_tqdm=False)]
    spec = make_llm(folder, speculative_config={"method": "ngram", "num_speculative_tokens": 3,
                                                "prompt_lookup_max": 3, "prompt_lookup_min": 1})
    assert [o.outputs[0].token_ids for o in spec.generate(requests, params, use_tqdm=False)] == plain
    assert spec.get_stats()["spec_decode"]["num_draft_tokens"] > 0        # drafts were verified


@pytest.mark.parametrize("setting, says", [
    ({"runner": "pooling"}, "runner='pooling'"),
    ({"quantization": "w8a8"}, "quantization='w8a8'"),
    ({"enable_lora": True}, "enable_lora=True"),
    ({"async_scheduling": True}, "async_scheduling=True cannot run with a vision-language model"),
])
def test_what_a_vision_language_model_cannot_run_with_is_refused_by_name(vlm, setting, says):
    with pytest.raises(ValueError, match=re.escape(says)):
        make_llm(vlm[1], **setting)


def test_a_text_model_refuses_images_by_name(tiny_model_dirs):
    llm = LLM(tiny_model_dirs["llama"], dtype="float32")
    with pytest.raises(ValueError, match="LlamaForCausalLM is a text-only model and takes no images"):
        llm.generate({"prompt": "x", "multi_modal_data": {"image": image(1)}}, GREEDY, use_tqdm=False)
    with pytest.raises(ValueError, match="takes no images"):
        llm.chat([{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "data:image/png;base64,"}}]}],
                 GREEDY, use_tqdm=False)


def test_a_text_far_past_the_context_beside_an_image_is_refused_before_the_processor_runs(vlm, monkeypatch):
    family, folder = vlm
    llm = make_llm(folder, max_model_len=256)
    processor = llm.llm_engine.input_processor
    monkeypatch.setattr(processor, "process_images", lambda *a: pytest.fail("the processor ran"))
    with pytest.raises(ValueError, match="the prompt has at least"):
        llm.generate(mm(family, [image(1)], "word " * 20_000), GREEDY, use_tqdm=False)


def test_a_step_that_fails_while_encoding_leaves_no_hole_in_the_encoder_cache(vlm):
    """The scheduler counted the image in before the step failed: the next request with it still gets its rows."""
    family, folder = vlm
    want = tokens(make_llm(folder), [mm(family, [image(50)])])
    llm = make_llm(folder)
    model = llm.llm_engine.runner.model
    encode = model.encode_image
    model.encode_image = lambda data: (_ for _ in ()).throw(RuntimeError("the encoder failed"))
    with pytest.raises(RuntimeError, match="the encoder failed"):
        llm.generate(mm(family, [image(50)]), GREEDY, use_tqdm=False)
    model.encode_image = encode
    assert tokens(llm, [mm(family, [image(50)])]) == want
