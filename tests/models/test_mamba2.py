"""The Mamba-2 mixer (nanopaged/models/mamba2.py): equal to transformers' GraniteMoeHybridMambaLayer on one
sequence from zero state; the same output and state whether a sequence runs whole, cut into pieces or token by
token through its page; a step of mixed prefills and decodes equal to each request alone, other pages untouched;
the chunked scan held to the plain per-token recurrence."""
import math

import pytest
import torch
from transformers.models.granitemoehybrid.configuration_granitemoehybrid import GraniteMoeHybridConfig
from transformers.models.granitemoehybrid.modeling_granitemoehybrid import GraniteMoeHybridMambaLayer

from nanopaged.models.mamba2 import Mamba2Mixer, Mamba2Shape, causal_conv1d, ssd_chunked, ssd_step

CHUNK = 8     # small, so that a few dozen tokens run several chunks

# one group shared by 4 heads, no projection bias (Granite 4.0-H's layout); 8 heads in 2 groups with biases
CONFIGS = {
    "granite_like": dict(mamba_n_heads=4, mamba_n_groups=1, mamba_proj_bias=False),
    "two_groups": dict(mamba_n_heads=8, mamba_n_groups=2, mamba_proj_bias=True),
}


def hf_config(**over) -> GraniteMoeHybridConfig:
    fields = dict(hidden_size=64, num_hidden_layers=1, num_attention_heads=4, num_key_value_heads=2,
                  intermediate_size=96, vocab_size=128, layer_types=["mamba"], mamba_d_state=16, mamba_d_conv=4,
                  mamba_expand=2, mamba_chunk_size=CHUNK, mamba_conv_bias=True, hidden_act="silu")
    return GraniteMoeHybridConfig(**(fields | over))


def randomize(module: torch.nn.Module) -> None:
    """Every parameter away from its init (norm weights 1, D 1, dt_bias 1), so a forgotten one shows."""
    with torch.no_grad():
        for name, p in module.named_parameters():
            if name == "A_log":
                p.copy_(torch.log(torch.empty_like(p).uniform_(0.5, 8.0)))   # decays from slow to fast
            elif name == "dt_bias":
                p.normal_(-1.0, 1.0)                                          # dt = softplus(..) spread around 0.3
            elif name in ("D", "norm.weight"):
                p.copy_(1.0 + 0.5 * torch.randn_like(p))
            else:
                p.normal_(0.0, 0.15)


def make_mixer(name: str, seed: int = 0) -> Mamba2Mixer:
    torch.manual_seed(seed)
    mixer = Mamba2Mixer(Mamba2Shape.from_hf(hf_config(**CONFIGS[name]).to_dict()))
    randomize(mixer)
    return mixer.eval()


def pages_for(mixer: Mamba2Mixer, num_pages: int, random: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """A conv and an SSM state tensor of num_pages pages, float32; random content stands for earlier steps."""
    s, fill = mixer.shape, (torch.randn if random else torch.zeros)
    return fill(num_pages, *s.conv_state_shape()), 0.5 * fill(num_pages, *s.ssm_state_shape())


# ---------------------------------------------------------------- against transformers


@pytest.mark.parametrize("name", CONFIGS)
@pytest.mark.parametrize("length", [5, CHUNK, 3 * CHUNK + 5])
@torch.no_grad()
def test_zero_page_equals_transformers_mamba_layer_without_cache(name, length):
    torch.manual_seed(1)
    hf = GraniteMoeHybridMambaLayer(hf_config(**CONFIGS[name]), layer_idx=0)
    randomize(hf)
    hf.eval()
    mixer = Mamba2Mixer(Mamba2Shape.from_hf(hf_config(**CONFIGS[name]).to_dict()))
    mixer.load_state_dict(hf.state_dict())
    x = torch.randn(length, 64)
    conv_state, ssm_state = pages_for(mixer, 3)
    out = mixer(x, conv_state, ssm_state, [length], [1])
    torch.testing.assert_close(out, hf(x[None])[0], atol=1e-5, rtol=1e-5)


def test_shape_reads_granite_config_and_refuses_what_it_does_not_compute():
    shape = Mamba2Shape.from_hf(hf_config(mamba_n_heads=8, mamba_n_groups=2, time_step_limit=(0.001, 0.1)).to_dict())
    assert (shape.num_heads, shape.head_dim, shape.state_size, shape.n_groups) == (8, 16, 16, 2)
    assert shape.conv_state_shape() == (128 + 2 * 2 * 16, 3) and shape.ssm_state_shape() == (8, 16, 16)
    assert shape.time_step_limit == (0.001, 0.1)
    cfg = hf_config().to_dict()
    with pytest.raises(ValueError, match="mamba_d_head=24"):
        Mamba2Shape.from_hf(cfg | {"mamba_d_head": 24})
    with pytest.raises(ValueError, match="mamba_n_groups=3"):
        Mamba2Shape.from_hf(cfg | {"mamba_n_groups": 3})
    with pytest.raises(ValueError, match="'gelu'"):
        Mamba2Shape.from_hf(cfg | {"hidden_act": "gelu"})


def test_time_step_limit_clamps_dt_in_prefill_and_decode_alike():
    torch.manual_seed(2)
    cfg = hf_config(**CONFIGS["granite_like"], time_step_limit=(0.05, 0.2)).to_dict()
    mixer = Mamba2Mixer(Mamba2Shape.from_hf(cfg))
    randomize(mixer)
    x = torch.randn(6, 64)
    whole = mixer(x, *pages_for(mixer, 1), [6], [0])
    conv_state, ssm_state = pages_for(mixer, 1)
    steps = torch.cat([mixer(x[t:t + 1], conv_state, ssm_state, [1], [0]) for t in range(6)])
    torch.testing.assert_close(steps, whole, atol=1e-5, rtol=1e-5)
    unclamped = Mamba2Mixer(Mamba2Shape.from_hf(cfg | {"time_step_limit": None}))
    unclamped.load_state_dict(mixer.state_dict())
    assert not torch.allclose(unclamped(x, *pages_for(mixer, 1), [6], [0]), whole, atol=1e-3)


# ---------------------------------------------------------------- state carried in the pages


@pytest.mark.parametrize("cuts", [[3, 8, 2, 11], [8, 8, 8], [1, 23], [17, 1, 1, 5]])
@torch.no_grad()
def test_sequence_cut_into_pieces_equals_one_call(cuts):
    mixer = make_mixer("two_groups")
    x = torch.randn(sum(cuts), 64)
    conv_whole, ssm_whole = pages_for(mixer, 2)
    whole = mixer(x, conv_whole, ssm_whole, [len(x)], [1])
    conv_state, ssm_state = pages_for(mixer, 2)
    outs, start = [], 0
    for n in cuts:
        outs.append(mixer(x[start:start + n], conv_state, ssm_state, [n], [1]))
        start += n
    torch.testing.assert_close(torch.cat(outs), whole, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(conv_state, conv_whole, atol=1e-6, rtol=1e-6)
    torch.testing.assert_close(ssm_state, ssm_whole, atol=1e-5, rtol=1e-5)


@torch.no_grad()
def test_token_by_token_decode_equals_one_call():
    mixer = make_mixer("granite_like")
    x = torch.randn(2 * CHUNK + 3, 64)
    conv_whole, ssm_whole = pages_for(mixer, 1)
    whole = mixer(x, conv_whole, ssm_whole, [len(x)], [0])
    conv_state, ssm_state = pages_for(mixer, 1)
    steps = torch.cat([mixer(x[t:t + 1], conv_state, ssm_state, [1], [0]) for t in range(len(x))])
    torch.testing.assert_close(steps, whole, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(conv_state, conv_whole, atol=1e-6, rtol=1e-6)
    torch.testing.assert_close(ssm_state, ssm_whole, atol=1e-5, rtol=1e-5)


@torch.no_grad()
def test_mixed_step_equals_each_request_alone_and_leaves_other_pages_untouched():
    mixer = make_mixer("two_groups")
    query_lens, pages = [7, 1, 13, 1], [5, 0, 3, 1]          # prefills and decodes interleaved, pages unordered
    x = torch.randn(sum(query_lens), 64)
    torch.manual_seed(3)
    conv_start, ssm_start = pages_for(mixer, 7, random=True)  # every request continues from earlier steps
    # the engine's pages are strided views into larger tensors (e.g. one slab for every layer)
    conv_slab = torch.zeros(7, 2, *mixer.shape.conv_state_shape())
    ssm_slab = torch.zeros(2, 7, *mixer.shape.ssm_state_shape())
    conv_state, ssm_state = conv_slab[:, 1], ssm_slab[1]
    conv_state.copy_(conv_start)
    ssm_state.copy_(ssm_start)

    out = mixer(x, conv_state, ssm_state, query_lens, pages)

    start = 0
    for n, page in zip(query_lens, pages):
        conv_alone, ssm_alone = conv_start[page:page + 1].clone(), ssm_start[page:page + 1].clone()
        alone = mixer(x[start:start + n], conv_alone, ssm_alone, [n], [0])
        torch.testing.assert_close(out[start:start + n], alone, atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(conv_slab[page, 1], conv_alone[0], atol=1e-6, rtol=1e-6)
        torch.testing.assert_close(ssm_slab[1, page], ssm_alone[0], atol=1e-5, rtol=1e-5)
        assert not torch.equal(ssm_slab[1, page], ssm_start[page])    # the page was written back
        start += n
    for page in (2, 4, 6):
        assert torch.equal(conv_slab[page, 1], conv_start[page]) and torch.equal(ssm_slab[1, page], ssm_start[page])
    assert not conv_slab[:, 0].any() and not ssm_slab[0].any()      # the slab's other halves untouched


@torch.no_grad()
def test_bfloat16_model_returns_bfloat16_and_keeps_float32_state():
    mixer = make_mixer("granite_like")
    x = torch.randn(2 * CHUNK + 1, 64)
    reference = mixer(x, *pages_for(mixer, 1), [len(x)], [0])
    conv_state, ssm_state = pages_for(mixer, 1)
    out = mixer.to(torch.bfloat16)(x.bfloat16(), conv_state, ssm_state, [len(x)], [0])
    assert out.dtype == torch.bfloat16 and ssm_state.dtype == torch.float32
    torch.testing.assert_close(out.float(), reference, atol=0.1, rtol=0.05)


def test_step_layout_is_checked_before_any_work():
    mixer = make_mixer("granite_like")
    conv_state, ssm_state = pages_for(mixer, 4)
    x = torch.randn(5, 64)
    for query_lens, pages, match in (([2, 3], [0], "one page per request"), ([2, 2], [0, 1], "x has 5"),
                                     ([5, 0], [0, 1], "at least 1"), ([2, 3], [1, 1], "distinct"),
                                     ([2, 3], [0, 4], r"\[0, 4\)")):
        with pytest.raises(ValueError, match=match):
            mixer(x, conv_state, ssm_state, query_lens, pages)
    assert not conv_state.any() and not ssm_state.any()


# ---------------------------------------------------------------- the reference functions against the plain math


def recurrence(x, dt, A, B, C, D, state):
    """h = exp(dt A) h + dt B x; y = C h + D x, one token at a time: the definition ssd_* must equal."""
    ys = []
    for t in range(x.shape[0]):
        state = torch.exp(dt[t] * A)[:, None, None] * state + dt[t][:, None, None] * x[t][:, :, None] * B[t][:, None, :]
        ys.append((state * C[t][:, None, :]).sum(-1) + D[:, None] * x[t])
    return torch.stack(ys), state


def scan_inputs(T, H=3, P=4, N=5, seed=0):
    torch.manual_seed(seed)
    dt = torch.nn.functional.softplus(torch.randn(T, H) - 1.0)
    A = -torch.empty(H).uniform_(0.5, 4.0)
    return torch.randn(T, H, P), dt, A, torch.randn(T, H, N), torch.randn(T, H, N), torch.randn(H), torch.randn(H, P, N)


@pytest.mark.parametrize("length", [1, 5, CHUNK, 4 * CHUNK + 3])
def test_chunked_scan_equals_per_token_recurrence(length):
    x, dt, A, B, C, D, h0 = scan_inputs(length)
    y, final, _ = ssd_chunked(x, dt, A, B, C, D, CHUNK, h0)
    y_ref, final_ref = recurrence(x, dt, A, B, C, D, h0)
    torch.testing.assert_close(y, y_ref, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(final, final_ref, atol=1e-5, rtol=1e-5)


def test_one_token_step_equals_recurrence_for_each_request():
    _, _, A, _, _, D, _ = scan_inputs(1)      # A and D are the layer's: shared by the batch
    torch.manual_seed(5)
    x, dt, B, C = torch.randn(4, 3, 4), torch.rand(4, 3), torch.randn(4, 3, 5), torch.randn(4, 3, 5)
    h = torch.randn(4, 3, 4, 5)                 # 4 requests, each with its own state
    y, new = ssd_step(x, dt, A, B, C, D, h)
    for r in range(4):
        y_ref, h_ref = recurrence(x[r:r + 1], dt[r:r + 1], A, B[r:r + 1], C[r:r + 1], D, h[r])
        torch.testing.assert_close(y[r], y_ref[0], atol=1e-6, rtol=1e-6)
        torch.testing.assert_close(new[r], h_ref, atol=1e-6, rtol=1e-6)


def test_causal_conv1d_continues_from_its_state():
    torch.manual_seed(4)
    x, weight, bias = torch.randn(9, 6), torch.randn(6, 4), torch.randn(6)
    # the definition: zero left padding of kernel-1 inputs, then y[t, c] = bias[c] + sum_j w[c, j] x[t-3+j, c]
    padded = torch.cat([torch.zeros(3, 6), x])
    expected = torch.stack([bias + (weight * padded[t:t + 4].T).sum(-1) for t in range(9)])
    y1, state = causal_conv1d(x[:4], weight, bias, torch.zeros(6, 3))
    y2, state = causal_conv1d(x[4:], weight, bias, state)
    torch.testing.assert_close(torch.cat([y1, y2]), expected, atol=1e-6, rtol=1e-6)
    torch.testing.assert_close(state, x[-3:].T)
    assert math.isclose(float(y1[0, 0]), float(bias[0] + weight[0, 3] * x[0, 0]), rel_tol=1e-5)
