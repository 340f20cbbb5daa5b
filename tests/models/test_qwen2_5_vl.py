"""Qwen2.5-VL (models/qwen2_5_vl.py) against transformers on a tiny random model, in float32.

The vision encoder gives transformers' image features one image at a time, with one window and with several;
processing gives get_rope_index's M-RoPE positions; the whole model, its K/V in the paged cache, gives
transformers' logits for a prompt with one image and with two, and for a decode step past them.
"""
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

import nanopaged.cpu.build as cpu_build
from nanopaged import EngineConfig, SamplingParams
from nanopaged.attention.backends import load_attention_backend
from nanopaged.attention.metadata import AttentionMetadata
from nanopaged.core.request import Request
from nanopaged.core.scheduler import SchedulerOutput
from nanopaged.cpu.choose import choose
from nanopaged.cpu.fused import FusedLlamaModel, fuse_layers
from nanopaged.models.config import ModelConfig
from nanopaged.models.loader import load_weights
from nanopaged.models.qwen2_5_vl import Qwen2_5_VLForConditionalGeneration
from nanopaged.worker.vision_runner import VisionLanguageModelRunner

sys.path.insert(0, str(Path(__file__).parent))
from vlm_fixtures import tiny_qwen2_5_vl  # noqa: E402

IMAGE = "<|vision_start|><|image_pad|><|vision_end|>"
BLOCK_SIZE, NUM_BLOCKS = 16, 8
# (width, height): 2 x 2 merged tokens, one window; 5 x 4, six windows, the last column of them cut short
SMALL, LARGE = (56, 56), (140, 112)


def image(size, seed):
    return Image.fromarray(np.random.RandomState(seed).randint(0, 256, (size[1], size[0], 3), dtype=np.uint8))


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """(folder, processor, our model, transformers' model)."""
    from transformers import Qwen2_5_VLForConditionalGeneration as HFModel
    folder = tmp_path_factory.mktemp("qwen2_5_vl")
    processor = tiny_qwen2_5_vl(folder)
    cfg = ModelConfig.from_folder(folder)
    ours = Qwen2_5_VLForConditionalGeneration.build(cfg, load_attention_backend("torch"), 512, "cpu", torch.float32)
    load_weights(ours, folder)
    hf = HFModel.from_pretrained(folder, dtype=torch.float32).eval()
    return folder, processor, ours.eval(), hf


def hf_inputs(processor, prompt, images):
    return processor(text=[prompt], images=images or None, return_tensors="pt")


@pytest.mark.parametrize("size", [SMALL, LARGE], ids=["one_window", "six_windows"])
def test_the_encoder_gives_transformers_image_features(tiny, size):
    _, processor, ours, hf = tiny
    prompt = ours.process(processor, f"look {IMAGE}", [image(size, 1)])
    data = prompt.images[0].data
    if size == LARGE:
        assert ours.visual.window_order(1, 4, 5)[1] == [4, 4, 2, 4, 4, 2]
    with torch.no_grad():
        expected = hf.model.get_image_features(data["pixel_values"], data["image_grid_thw"]).pooler_output[0]
        got = ours.encode_image(data)
    assert got.shape == (prompt.images[0].num_embeds, 64)
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("sizes", [[LARGE], [SMALL, LARGE]], ids=["one_image", "two_images"])
def test_mrope_positions_are_get_rope_index(tiny, sizes):
    _, processor, ours, hf = tiny
    images = [image(size, i) for i, size in enumerate(sizes)]
    text = "a cat " + " and ".join(IMAGE for _ in images) + " on a mat"
    prompt = ours.process(processor, text, images)
    expected = hf_inputs(processor, text, images)
    assert prompt.token_ids == expected["input_ids"][0].tolist()
    positions, delta = hf.model.get_rope_index(expected["input_ids"], expected["mm_token_type_ids"],
                                               image_grid_thw=expected["image_grid_thw"])
    assert torch.equal(prompt.mrope_positions, positions[:, 0])
    assert prompt.mrope_delta == int(delta) < 0


def test_each_image_is_its_run_of_placeholders_and_its_rows(tiny):
    _, processor, ours, _ = tiny
    prompt = ours.process(processor, f"{IMAGE} then {IMAGE}", [image(SMALL, 0), image(LARGE, 1)])
    pad = processor.image_token_id
    for one, grid, rows in zip(prompt.images, [(1, 4, 4), (1, 8, 10)], [16, 80]):
        span = prompt.token_ids[one.offset:one.offset + one.length]
        assert span == [pad] * (grid[1] * grid[2] // 4) and prompt.token_ids[one.offset - 1] != pad
        assert one.embed_positions == list(range(one.length))
        assert one.data["image_grid_thw"].tolist() == [list(grid)] and one.data["pixel_values"].shape[0] == rows


def test_a_prompt_without_images_counts_positions_as_text(tiny):
    _, processor, ours, _ = tiny
    prompt = ours.process(processor, "no picture here", [])
    n = len(prompt.token_ids)
    assert prompt.images == [] and prompt.mrope_delta == 0
    assert torch.equal(prompt.mrope_positions, torch.arange(n).expand(3, n))


@pytest.mark.parametrize("placeholders, images", [(1, 2), (2, 1), (0, 1)])
def test_a_mismatched_image_count_names_both_numbers(tiny, placeholders, images):
    _, processor, ours, _ = tiny
    with pytest.raises(ValueError, match=f"{placeholders} image placeholders.*{images} images"):
        ours.process(processor, "see " + IMAGE * placeholders, [image(SMALL, i) for i in range(images)])


def one_request(start: int, n: int) -> AttentionMetadata:
    """A step of one request computing positions start .. start + n - 1, its blocks 0, 1, 2, ... (slot = position)."""
    as_tensor = lambda x: torch.tensor(x, dtype=torch.long)   # noqa: E731
    return AttentionMetadata(slot_mapping=as_tensor(list(range(start, start + n))), query_start_loc=as_tensor([0, n]),
                             seq_lens=as_tensor([start + n]), block_tables=as_tensor([list(range(NUM_BLOCKS))]),
                             query_lens_list=[n], seq_lens_list=[start + n], block_size=BLOCK_SIZE)


@pytest.mark.parametrize("sizes", [[LARGE], [SMALL, LARGE]], ids=["one_image", "two_images"])
def test_the_model_gives_transformers_logits_for_a_prompt_with_images_and_past_it(tiny, sizes):
    """Prefill with the encoder's rows in place of the placeholders, then one decode step at index + mrope_delta
    on all three rows, against transformers' forward over the whole sequence."""
    _, processor, ours, hf = tiny
    images = [image(size, i + 3) for i, size in enumerate(sizes)]
    text = "describe " + " beside ".join(IMAGE for _ in images) + " now"
    prompt = ours.process(processor, text, images)
    ids, n = torch.tensor(prompt.token_ids), len(prompt.token_ids)
    cfg = ours.config
    kv = torch.zeros(cfg.num_hidden_layers, 2, NUM_BLOCKS, BLOCK_SIZE, cfg.num_key_value_heads, cfg.head_dim)
    with torch.no_grad():
        embeds = ours.embed_input_ids(ids)
        for one in prompt.images:
            embeds[[one.offset + p for p in one.embed_positions]] = ours.encode_image(one.data)
        prefill = ours.compute_logits(ours(ids, prompt.mrope_positions, kv, one_request(0, n), inputs_embeds=embeds))
        next_token = int(prefill[-1].argmax())
        decode_position = torch.full((3, 1), n + prompt.mrope_delta)
        decode = ours.compute_logits(ours(torch.tensor([next_token]), decode_position, kv, one_request(n, 1)))
        inputs = hf_inputs(processor, text, images)
        extended = {**inputs, "input_ids": torch.cat([inputs["input_ids"], torch.tensor([[next_token]])], dim=1),
                    "mm_token_type_ids": torch.nn.functional.pad(inputs["mm_token_type_ids"], (0, 1)),
                    "attention_mask": torch.ones(1, n + 1, dtype=torch.long)}
        expected = hf(**extended).logits[0]
    torch.testing.assert_close(prefill, expected[:n], rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(decode, expected[n:], rtol=1e-4, atol=1e-4)


def test_newer_checkpoint_names_load_as_the_hubs(tiny, tmp_path):
    """transformers may nest the language model and the vision tower under `model.`: the same weights."""
    from safetensors.torch import load_file, save_file
    folder, _, ours, _ = tiny
    weights = load_file(str(Path(folder) / "model.safetensors"))
    renamed = {("model.language_model." + k[len("model."):] if k.startswith("model.") else
                "model." + k if k.startswith("visual.") else k): v for k, v in weights.items()}
    assert any(k.startswith("model.visual.") for k in renamed)
    for name in ("config.json", "tokenizer.json", "tokenizer_config.json"):
        (tmp_path / name).write_bytes((Path(folder) / name).read_bytes())
    save_file(renamed, str(tmp_path / "model.safetensors"))
    other = Qwen2_5_VLForConditionalGeneration.build(ours.config, load_attention_backend("torch"), 512, "cpu",
                                                     torch.float32)
    load_weights(other, tmp_path)
    for (name, a), (_, b) in zip(ours.state_dict().items(), other.state_dict().items()):
        assert torch.equal(a, b), name


def test_config_json_of_the_hubs_older_layout_reads_the_same(tiny):
    """The hub's files keep the text fields at the top and call M-RoPE's rope dict type "mrope"."""
    import json
    folder, _, ours, _ = tiny
    saved = json.loads((Path(folder) / "config.json").read_text())
    text = saved.pop("text_config")
    rope = text.pop("rope_parameters")
    older = {**saved, **text, "rope_theta": rope["rope_theta"],
             "rope_scaling": {"type": "mrope", "mrope_section": rope["mrope_section"]}}
    assert ModelConfig.from_dict(older, ours.config.eos_token_ids) == ours.config
    assert ours.config.mrope_section == (2, 3, 3) and ours.config.vision["window_size"] == 56


@pytest.mark.parametrize("change, refusal", [
    (lambda cfg: cfg["text_config"]["rope_parameters"].pop("mrope_section"), "mrope_section None"),
    (lambda cfg: cfg.pop("vision_config"), "vision_config NoneType"),
    (lambda cfg: cfg["text_config"]["rope_parameters"].update(rope_type="yarn"), "unsupported rope scaling type 'yarn'"),
    (lambda cfg: cfg["text_config"]["rope_parameters"].update(mrope_section=[2, 3, 4]),
     r"mrope_section \[2, 3, 4\] must add up to head_dim / 2 = 8")])
def test_a_config_this_model_cannot_follow_is_refused_by_name(tiny, change, refusal):
    import json
    cfg = json.loads((Path(tiny[0]) / "config.json").read_text())
    change(cfg)
    with pytest.raises(ValueError, match=refusal):
        Qwen2_5_VLForConditionalGeneration.build(ModelConfig.from_dict(cfg), load_attention_backend("torch"), 64, "cpu",
                                                 torch.float32)


def test_the_runner_builds_the_model_and_its_cache_fits_it(tiny):
    """VisionLanguageModelRunner on a one-request SchedulerOutput: the model the runner built and loaded gives
    the logits of the model loaded by hand (float32 on CPU: the reference path)."""
    folder, processor, ours, _ = tiny
    runner = VisionLanguageModelRunner(EngineConfig(str(folder), dtype="float32", device="cpu"))
    assert isinstance(runner.model, Qwen2_5_VLForConditionalGeneration)
    assert (runner.fast_path.linear, runner.fast_path.layers) == ("reference", "reference")
    prompt = ours.process(processor, f"what is {IMAGE}", [image(LARGE, 7)])
    request = Request("r", prompt.token_ids, SamplingParams(), max_tokens=1, block_ids=list(range(NUM_BLOCKS)))
    out = SchedulerOutput()
    out.scheduled.append((request, len(prompt.token_ids)))
    inputs = runner.prepare_inputs(out)
    kv = torch.zeros(runner.kv_cache_shape(NUM_BLOCKS))
    logits = []
    with torch.no_grad():
        for model, cache in ((runner.model, runner.kv_cache), (ours, kv)):
            embeds = model.embed_input_ids(inputs.input_ids)
            one = prompt.images[0]
            embeds[one.offset:one.offset + one.length] = model.encode_image(one.data)
            hidden = model(inputs.input_ids, prompt.mrope_positions, cache, inputs.meta, inputs_embeds=embeds)
            logits.append(model.compute_logits(hidden[inputs.sample_rows]))
    torch.testing.assert_close(logits[0], logits[1], rtol=0, atol=0)


@pytest.mark.skipif(cpu_build.available() is not None, reason=f"{cpu_build.available()}")
def test_the_fused_loop_takes_mrope_cos_and_sin_from_outside(tiny):
    """Swapped in by fuse_layers (the default path on a CPU with bfloat16 matrix units), the fused loop reads the
    model's own rotary, M-RoPE's cos and sin, and gives the reference's hidden states at an image prompt's
    positions, prefill and decode."""
    _, processor, ours, _ = tiny
    prompt = ours.process(processor, f"count {IMAGE} items", [image(LARGE, 2)])
    ids, n = torch.tensor(prompt.token_ids), len(prompt.token_ids)
    steps = [(ids, prompt.mrope_positions, one_request(0, n)),
             (ids[:1], torch.full((3, 1), n + prompt.mrope_delta), one_request(n, 1))]
    cfg, hidden = ours.config, []
    for fuse in (False, True):
        model = Qwen2_5_VLForConditionalGeneration.build(cfg, load_attention_backend("cpu"), 512, "cpu", torch.float32)
        model.load_state_dict(ours.state_dict())
        if fuse:
            fuse_layers(model)
            assert isinstance(model.model, FusedLlamaModel)
        kv = torch.zeros(cfg.num_hidden_layers, 2, NUM_BLOCKS, BLOCK_SIZE, cfg.num_key_value_heads, cfg.head_dim)
        with torch.no_grad():
            hidden.append([model(*step[:2], kv, step[2]) for step in steps])
    for reference, fused in zip(*hidden):
        torch.testing.assert_close(fused, reference, rtol=1e-5, atol=1e-5)


def test_the_encoder_runs_on_packed_bfloat16_linears(tiny):
    """Where bfloat16 packs the linears (a CPU with bfloat16 matrix units), the vision encoder's are packed too
    and its rows stay within bfloat16's rounding of the float32 reference's."""
    folder, processor, ours, _ = tiny
    config = EngineConfig(str(folder), dtype="bfloat16", device="cpu")
    if choose(config).linear == "reference":
        pytest.skip("this CPU packs no bfloat16 linears")
    runner = VisionLanguageModelRunner(config)
    assert type(runner.model.visual.blocks[0].attn.qkv) is not torch.nn.Linear
    data = ours.process(processor, IMAGE, [image(LARGE, 4)]).images[0].data
    with torch.no_grad():
        got, expected = runner.model.encode_image(data), ours.encode_image(data)
    assert got.dtype == torch.bfloat16
    assert (got.float() - expected).norm() / expected.norm() < 2e-2
