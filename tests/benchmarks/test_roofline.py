"""The trace floor's arithmetic on a stand-in host: the copy rate and the kernel's peak are set by
hand, so every step's floor, what bounds it and its kind's bucket can be counted here."""
import pathlib
import sys

import pytest
import torch

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[2]))

import benchmarks.roofline as roofline  # noqa: E402
from benchmarks.trace import Run, StepTiming  # noqa: E402
from nanopaged.models.config import ModelConfig  # noqa: E402

READ_RATE = 1e10          # bytes a second, the stand-in host's

# the demo model's shape (SmolLM2-135M)
DEMO = ModelConfig("LlamaForCausalLM", vocab_size=49152, hidden_size=576, intermediate_size=1536, num_hidden_layers=30,
                   num_attention_heads=9, num_key_value_heads=3, head_dim=64, rms_norm_eps=1e-5, rope_theta=1e5,
                   rope_scaling=None, max_position_embeddings=8192, tie_word_embeddings=True, qkv_bias=False,
                   qk_norm=False, eos_token_ids=(2,))


@pytest.fixture
def host(monkeypatch):
    monkeypatch.setattr(roofline, "read_bytes_per_s", lambda num_bytes: READ_RATE)


def floor_of(steps: list[StepTiming], peak: float) -> dict:
    return roofline.floor_figures(DEMO, Run("nanopaged", 10.0, 0, 0, 1, {}, steps=steps), peak, torch.bfloat16, {})


def chunk(tokens: int) -> StepTiming:
    """One request's prompt chunk of `tokens` tokens, nothing before it (no K/V to read)."""
    return StepTiming(num_rows=1, num_tokens=tokens, context_tokens=0, model_s=1.0, num_sampled=1)


def test_a_step_is_bound_by_bytes_below_a_token_count_and_by_arithmetic_above(host):
    weight_s = roofline.stored_weight_bytes(DEMO, torch.bfloat16, None) / READ_RATE
    peak = sum(roofline.step_flops(DEMO, chunk(64)).values()) / weight_s        # 64 tokens: bytes and arithmetic take as long
    below, above = floor_of([chunk(16)], peak), floor_of([chunk(256)], peak)
    assert below["weight_bound_steps"] == 1 and below["seconds"] == pytest.approx(weight_s)
    assert above["weight_bound_steps"] == 0
    assert above["seconds"] == pytest.approx(sum(roofline.step_flops(DEMO, chunk(256)).values()) / peak) and above["seconds"] > weight_s
    assert below["by_step_kind"]["prompt chunk"]["bound_by"] == "bytes"
    assert above["by_step_kind"]["prompt chunk"]["bound_by"] == "arithmetic"


def test_each_step_falls_in_its_kind_prompt_chunks_apart_and_decode_steps_by_rows(host):
    rows = [1, 1, 2, 8, 9, 32, 33, 64]
    decode = [StepTiming(r, r, 0, 0.1 * (i + 1), r) for i, r in enumerate(rows)]
    mixed = StepTiming(num_rows=2, num_tokens=3, context_tokens=0, model_s=0.5, num_sampled=1)   # a decode + a 2-token chunk
    kinds = floor_of([mixed, *decode], peak=1e30)["by_step_kind"]     # every step bound by its weights
    assert list(kinds) == ["prompt chunk", "1 row", "2-8 rows", "9-32 rows", ">32 rows"]
    assert [k["num_steps"] for k in kinds.values()] == [1, 2, 2, 2, 2]
    assert [k["model_s"] for k in kinds.values()] == pytest.approx([0.5, 0.3, 0.7, 1.1, 1.5])
    weight_s = roofline.stored_weight_bytes(DEMO, torch.bfloat16, None) / READ_RATE
    for k in kinds.values():
        assert k["floor_s"] == pytest.approx(k["num_steps"] * weight_s)
        assert k["share"] == pytest.approx(k["floor_s"] / k["model_s"])
        assert k["bound_by"] == "bytes"


def test_each_decode_kind_holds_its_steps_own_matmuls_and_the_target_their_share_of_the_decode_seconds(host):
    steps = [chunk(40), StepTiming(1, 1, 50, 0.4, 1), StepTiming(1, 1, 51, 0.6, 1), StepTiming(4, 4, 200, 1.0, 4)]
    floor = roofline.floor_figures(DEMO, Run("nanopaged", 10.0, 0, 0, 1, {}, steps=steps), 1e30, torch.bfloat16, {},
                                   own={1: 0.1, 4: 0.3})
    kinds = floor["by_step_kind"]
    assert kinds["prompt chunk"]["own_matmuls_s"] is None
    assert kinds["1 row"]["own_matmuls_s"] == pytest.approx(0.2) and kinds["2-8 rows"]["own_matmuls_s"] == pytest.approx(0.3)
    assert floor["decode_vs_own_matmuls"] == pytest.approx(0.5 / 2.0)        # the chunk's second not counted


def test_a_kind_is_bound_by_what_bounds_most_of_its_steps():
    def kind(*bound_by_bytes):
        return roofline.by_kind([("1 row", 1.0, 0.1 * (i + 2), b, 0.0) for i, b in enumerate(bound_by_bytes)])["1 row"]

    one_in_three, two_in_three, half = kind(True, False, False), kind(True, True, False), kind(True, False)
    assert one_in_three["bound_by"] == "arithmetic" and two_in_three["bound_by"] == "bytes"
    assert half["bound_by"] == "arithmetic"          # bytes only where they bound more than half
    assert one_in_three["share"] == pytest.approx(0.9 / 3.0)


class StandIn(torch.nn.Module):
    """A kernel that records what it was built around and the rows it was called with."""
    built, called = [], []

    def __init__(self, linear: torch.nn.Linear) -> None:
        super().__init__()
        StandIn.built.append((linear.in_features, linear.out_features, linear.weight.dtype))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        StandIn.called.append(tuple(x.shape))
        return x


def test_the_peak_is_the_run_kernels_own_layer_of_the_mlps_shape(monkeypatch):
    """Any name in KERNELS: a layer of that kernel around an intermediate x hidden bfloat16 linear, at 256 rows."""
    def once(run, tries):
        run()
        return 0.5

    monkeypatch.setitem(roofline.KERNELS, "stand-in", StandIn)
    monkeypatch.setattr(StandIn, "built", [])
    monkeypatch.setattr(StandIn, "called", [])
    monkeypatch.setattr(roofline, "best_seconds", once)
    flops, kernel = roofline.kernel_peak_flops(DEMO, "cpu", torch.bfloat16, "stand-in", None, repeat=5)
    assert kernel == "stand-in" and StandIn.built == [(576, 1536, torch.bfloat16)]
    assert StandIn.called == [(256, 576)] * 5
    assert flops == pytest.approx(5 * 2 * 256 * 576 * 1536 / 0.5)


@pytest.mark.parametrize("bytes_per_weight, method", [(5 / 8, "int4"), (8.5 / 8, "int8")])
def test_a_quantized_run_is_timed_on_the_quantized_layer_of_its_bits(monkeypatch, bytes_per_weight, method):
    built = []

    def quantized_linear(how, dense, group_size, shipped):
        built.append((how, dense.in_features, dense.out_features, group_size))
        return torch.nn.Identity()

    monkeypatch.setattr(roofline, "quantized_linear", quantized_linear)
    stats = {"quantization": "gguf", "kernel": "the 8-bit one", "weights_replaced": 8000,
             "quantized_bytes": int(8000 * bytes_per_weight)}
    _, kernel = roofline.kernel_peak_flops(DEMO, "cpu", torch.bfloat16, "packed", stats, group_size=32, tries=1)
    assert built == [(method, 576, 1536, 32)] and kernel == "gguf (the 8-bit one)"


def test_the_reference_path_is_timed_on_torchs_matmul(monkeypatch):
    monkeypatch.setattr(roofline, "measure_matmul_flops", lambda device, dtype: 7.0)
    assert roofline.kernel_peak_flops(DEMO, "cpu", torch.float32, "reference") == (7.0, "torch matmul float32")
    assert roofline.kernel_peak_flops(DEMO, "cuda", torch.bfloat16, "packed") == (7.0, "torch matmul bfloat16")
