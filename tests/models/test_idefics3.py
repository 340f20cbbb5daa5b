"""Idefics3 / SmolVLM (models/idefics3.py, models/siglip.py) against transformers, on a tiny random model.

An image's encoder rows equal transformers' get_image_features for it alone (one tile, a split image, a tile
with padding); processing leaves each image's span where the processor put its tokens, and its rows go where
transformers' own merge puts them; the logits of a whole prompt with one and two images equal transformers'
in float32; the fast path's stages leave the vision tower working; wrong input is refused by name.
"""
import json
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

from nanopaged import EngineConfig, SamplingParams
from nanopaged.core.block_pool import cdiv
from nanopaged.core.request import Request
from nanopaged.core.scheduler import SchedulerOutput
from nanopaged.cpu.build import available
from nanopaged.models.config import ModelConfig
from nanopaged.models.idefics3 import Idefics3ForConditionalGeneration
from nanopaged.worker.vision_runner import VisionLanguageModelRunner
from models.vlm_fixtures import IDEFICS3_IMAGE_SEQ_LEN, tiny_idefics3

BLOCK_SIZE = 16


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    return tiny_idefics3(tmp_path_factory.mktemp("idefics3"))


@pytest.fixture(scope="module")
def processor(folder):
    from transformers import AutoProcessor
    return AutoProcessor.from_pretrained(folder)


@pytest.fixture(scope="module")
def hf_model(folder):
    from transformers import Idefics3ForConditionalGeneration as HFIdefics3
    return HFIdefics3.from_pretrained(folder, dtype=torch.float32).eval()


@pytest.fixture(scope="module")
def runner(folder):
    config = EngineConfig(folder, device="cpu", dtype="float32", block_size=BLOCK_SIZE, num_kv_blocks=32,
                          cpu_kernels="reference", cpu_linear="reference", attention_backend="torch")
    return VisionLanguageModelRunner(config)


def image(height, width, seed):
    return Image.fromarray(np.random.default_rng(seed).integers(0, 256, (height, width, 3), dtype=np.uint8))


def chat(processor, num_images):
    content = [{"type": "text", "text": "Look: "}]
    for i in range(num_images):
        content += [{"type": "image"}, {"type": "text", "text": f" and {i} then"}]
    content.append({"type": "text", "text": " what is it?"})
    return processor.apply_chat_template([{"role": "user", "content": content}], add_generation_prompt=True)


def prompt_logits(runner, mm):
    """Our logits for every row of the prompt, its images' rows in place of their tokens' embeddings: one
    request's first step, through the runner's own inputs."""
    model, n = runner.model, len(mm.token_ids)
    embeds = model.embed_input_ids(torch.tensor(mm.token_ids))
    for img in mm.images:
        embeds[[img.offset + p for p in img.embed_positions]] = model.encode_image(img.data)
    request = Request("r", mm.token_ids, SamplingParams(), max_tokens=1, block_ids=list(range(cdiv(n, BLOCK_SIZE))))
    inputs = runner.prepare_inputs(SchedulerOutput(scheduled=[(request, n)]))
    hidden = model(inputs.input_ids, inputs.positions, runner.kv_cache, inputs.meta, inputs_embeds=embeds)
    return model.compute_logits(hidden)


# ---- the encoder ---------------------------------------------------------------------------------------
def one_tile(processor):
    out = processor.image_processor([[image(50, 70, 1)]], do_image_splitting=False, return_tensors="pt")
    return out["pixel_values"][0], out["pixel_attention_mask"][0]


def split(processor):
    out = processor.image_processor([[image(64, 96, 2)]], return_tensors="pt")
    return out["pixel_values"][0], out["pixel_attention_mask"][0]


def padded_tile(processor):
    """A tile whose lower 12 and right 20 pixels are padding: its patches take bucketed positions."""
    pixels, mask = one_tile(processor)
    mask = mask.clone()
    mask[:, 20:, :] = 0
    mask[:, :, 12:] = 0
    return pixels * mask[:, None], mask


@pytest.mark.parametrize("tiles", [one_tile, split, padded_tile])
def test_an_images_encoder_rows_equal_transformers_image_features(runner, hf_model, processor, tiles):
    pixels, mask = tiles(processor)
    with torch.no_grad():
        want = hf_model.get_image_features(pixels[None], mask[None]).pooler_output[0]
        got = runner.model.encode_image({"pixel_values": pixels, "pixel_attention_mask": mask})
    assert got.shape == (pixels.shape[0] * IDEFICS3_IMAGE_SEQ_LEN, 64) and got.dtype == torch.float32
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


# ---- processing -------------------------------------------------------------------------------------------
def test_each_images_span_holds_exactly_its_image_tokens_in_the_processors_ids(processor):
    prompt, images = chat(processor, 2), [image(64, 96, 3), image(40, 40, 4)]
    mm = Idefics3ForConditionalGeneration.process(processor, prompt, images)
    out = processor(text=[prompt], images=[images], return_tensors="pt")
    ids = out["input_ids"][0].tolist()
    assert mm.token_ids == ids
    fake = processor.fake_image_token_id
    placed = [img.offset + p for img in mm.images for p in img.embed_positions]
    assert placed == [i for i, t in enumerate(ids) if t == processor.image_token_id]     # all of them, in order
    for img, tiles in zip(mm.images, (7, 10)):       # a 2 x 3 grid and a 3 x 3 grid, each with its global tile
        span = ids[img.offset:img.offset + img.length]
        assert span[0] == fake and span[-1] == fake       # ... <fake><global-img><image> x 4<fake>
        assert span[-3 - IDEFICS3_IMAGE_SEQ_LEN:-1 - IDEFICS3_IMAGE_SEQ_LEN] == [fake, processor.global_image_token_id]
        assert img.num_embeds == tiles * IDEFICS3_IMAGE_SEQ_LEN
        assert img.data["pixel_values"].shape == (tiles, 3, 32, 32)
    torch.testing.assert_close(torch.cat([img.data["pixel_values"] for img in mm.images]), out["pixel_values"][0],
                               rtol=0, atol=0)


def test_images_rows_go_where_transformers_merges_them(runner, hf_model, processor):
    prompt, images = chat(processor, 2), [image(40, 40, 5), image(64, 96, 6)]
    mm = Idefics3ForConditionalGeneration.process(processor, prompt, images)
    out = processor(text=[prompt], images=[images], return_tensors="pt")
    model, ids = runner.model, torch.tensor(mm.token_ids)
    with torch.no_grad():
        features = hf_model.get_image_features(out["pixel_values"], out["pixel_attention_mask"]).pooler_output
        want = hf_model.model.inputs_merger(ids[None], hf_model.get_input_embeddings()(ids[None]),
                                            torch.cat(features))[0]
        got = model.embed_input_ids(ids)
        for img in mm.images:
            got[[img.offset + p for p in img.embed_positions]] = model.encode_image(img.data)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def test_a_prompt_with_more_placeholders_than_images_is_refused_by_count(processor):
    with pytest.raises(ValueError, match="2 <image> placeholders but 1 images"):
        Idefics3ForConditionalGeneration.process(processor, chat(processor, 2), [image(40, 40, 7)])
    with pytest.raises(ValueError, match="0 <image> placeholders but 1 images"):
        Idefics3ForConditionalGeneration.process(processor, "no image here", [image(40, 40, 7)])


# ---- the whole model -----------------------------------------------------------------------------------
@pytest.mark.parametrize("num_images", [1, 2])
def test_prompt_logits_with_images_equal_transformers_in_float32(runner, hf_model, processor, num_images):
    images = [image(64, 96, 8), image(40, 40, 9)][:num_images]
    prompt = chat(processor, num_images)
    mm = Idefics3ForConditionalGeneration.process(processor, prompt, images)
    out = processor(text=[prompt], images=[images], return_tensors="pt")
    with torch.no_grad():
        want = hf_model(**out).logits[0]
        got = prompt_logits(runner, mm)
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
    assert torch.equal(got.argmax(-1), want.argmax(-1))


def test_the_head_is_tied_as_the_top_level_config_says(folder):
    """transformers ties lm_head by config.json's own tie_word_embeddings, whatever text_config says."""
    saved = json.loads((Path(folder) / "config.json").read_text())
    assert ModelConfig.from_folder(folder).tie_word_embeddings is False
    tied = {**saved, "tie_word_embeddings": True, "text_config": {**saved["text_config"], "tie_word_embeddings": False}}
    assert ModelConfig.from_dict(tied).tie_word_embeddings is True


def test_a_vision_tower_it_cannot_run_is_refused_by_name(folder):
    saved = json.loads((Path(folder) / "config.json").read_text())
    with pytest.raises(ValueError, match="hidden_act 'gelu'"):
        ModelConfig.from_dict({**saved, "vision_config": {**saved["vision_config"], "hidden_act": "gelu"}})
    with pytest.raises(ValueError, match="scale_factor .* 4 patches.* got 3"):
        ModelConfig.from_dict({**saved, "scale_factor": 3})


# ---- the fast path ---------------------------------------------------------------------------------------
@pytest.mark.skipif(available() is not None, reason="nanopaged's CPU kernels did not build here")
def test_the_fast_path_fuses_the_text_model_and_the_packed_tower_still_encodes(folder, runner, processor):
    """bfloat16 on the CPU's fast path: every plain linear packed (the tower's too), the text layers fused;
    the tower's rows stay within bfloat16 rounding of the float32 reference."""
    from nanopaged.cpu.fused import FusedLlamaModel
    fast = VisionLanguageModelRunner(EngineConfig(folder, device="cpu", dtype="bfloat16", block_size=BLOCK_SIZE,
                                                  num_kv_blocks=32, cpu_linear="packed", cpu_kernels="fused"))
    assert isinstance(fast.model.model, FusedLlamaModel)
    assert type(fast.model.vision_model.encoder.layers[0].mlp.fc1) is not torch.nn.Linear     # packed
    pixels, mask = split(processor)
    with torch.no_grad():
        want = runner.model.encode_image({"pixel_values": pixels, "pixel_attention_mask": mask})
        got = fast.model.encode_image({"pixel_values": pixels, "pixel_attention_mask": mask})
    assert got.dtype == torch.bfloat16
    assert ((got.float() - want).norm() / want.norm()).item() < 0.05
