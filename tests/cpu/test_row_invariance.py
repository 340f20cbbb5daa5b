"""Every kernel on the batch-invariant path computes a row alone: the same bits at every row count.

A step holds as many rows as the scheduler packs into it: one request alone, sixteen beside each
other, a prompt chunk, a few draft rows. If a kernel's order of summation depended on how many
rows it was given (a blocking chosen by the row count, a split of the work that changes where a
sum is cut), a request's logits would change with its neighbours and a greedy answer could flip
at a near tie. So each kernel here is run on the first m rows of one input, for every m from 1 to
64 and then far beyond, and on each row alone, at every position: each row's output must be the
same bits every time. (Paged attention's rows: tests/cpu/test_cpu_ops.py,
test_paged_attention_of_many_rows_equals_one_row_at_a_time; a whole engine:
tests/engine/test_batch_invariance.py.)
"""
import pytest
import torch

import nanopaged.cpu.quantized_linear as ql
from nanopaged.cpu.build import available, cpu_ops
from nanopaged.cpu.quantized_linear import Int4Linear, Int8Linear, int4_codes, int8_codes

pytestmark = pytest.mark.skipif(available() is not None, reason=f"{available()}")

ROW_COUNTS = list(range(1, 65)) + [100, 257]
ROWS = max(ROW_COUNTS)


def assert_each_row_computed_alone(kernel, x: torch.Tensor) -> None:
    """kernel(x[:m]) for every m in ROW_COUNTS, and kernel(x[r:r+1]) for every r, agree bit for bit
    with kernel(x) on every row they share; so does the step with its rows reversed."""
    full = kernel(x)
    for m in ROW_COUNTS:
        part = kernel(x[:m])
        same = (part == full[:m]).reshape(m, -1).all(dim=1)
        assert same.all(), f"rows {(~same).nonzero().flatten().tolist()[:5]} change when the step has {m} rows"
    for r in range(x.shape[0]):
        assert torch.equal(kernel(x[r:r + 1])[0], full[r]), f"row {r} alone differs from row {r} of {x.shape[0]}"
    assert torch.equal(kernel(x.flip(0)).flip(0), full), "a row's answer moves with its place in the step"


# The demo model's shapes (hidden 576, intermediate 1536, 9 + 2 * 3 heads of 64, vocabulary 49,152)
# and odd ones: widths that are not whole tiles.
SHAPES = [(576, 960), (576, 576), (576, 3072), (1536, 576), (576, 49152), (64, 100), (130, 40)]


def needs_dpbf16():
    if not cpu_ops().has_avx512_bf16:
        pytest.skip("nanopaged's kernels were built without AVX512-BF16 here")


@pytest.mark.parametrize("in_features, out_features", SHAPES)
def test_the_bfloat16_linear_computes_each_row_alone(in_features, out_features):
    needs_dpbf16()
    torch.manual_seed(out_features)
    ops = cpu_ops()
    packed = ops.pack_bf16_weight(torch.randn(out_features, in_features).bfloat16())
    bias = torch.randn(out_features).bfloat16()
    x = torch.randn(ROWS, in_features).bfloat16()
    assert_each_row_computed_alone(lambda t: ops.linear_bf16(t, packed, bias, out_features), x)


@pytest.mark.parametrize("in_features, out_features", [s for s in SHAPES if s[0] % 32 == 0])
def test_the_amx_linear_computes_each_row_alone(in_features, out_features):
    """nanopaged's AMX kernel: whole 16-row tiles, a tail tile, two tiles of rows; 1 to 257 rows."""
    if not cpu_ops().has_amx_bf16:
        pytest.skip("nanopaged's kernels were built without AMX-BF16 here (a CPU without the flags amx_bf16, amx_tile)")
    torch.manual_seed(out_features)
    ops = cpu_ops()
    packed = ops.pack_amx_weight(torch.randn(out_features, in_features).bfloat16())
    bias = torch.randn(out_features).bfloat16()
    x = torch.randn(ROWS, in_features).bfloat16()
    assert_each_row_computed_alone(lambda t: ops.linear_amx(t, packed, bias, out_features), x)


@pytest.mark.parametrize("in_features, out_features", [s for s in SHAPES if s[0] % 64 == 0])
def test_the_amx_int8_linear_computes_each_row_alone(in_features, out_features):
    """W8A8 on AMX's int8 tiles: each row quantized per token, one integer sum; 1 to 257 rows."""
    if not cpu_ops().has_amx_int8:
        pytest.skip("nanopaged's kernels were built without AMX-INT8 here (a CPU without amx_int8, amx_tile)")
    torch.manual_seed(out_features)
    ops = cpu_ops()
    packed = ops.pack_amx_int8(torch.randint(-127, 128, (out_features, in_features)), torch.rand(out_features) / 50)
    x = torch.randn(ROWS, in_features).bfloat16()
    assert_each_row_computed_alone(lambda t: ops.linear_amx_int8(t, packed, out_features), x)


@pytest.mark.parametrize("intermediate", [1536, 128])
def test_the_gate_up_projection_with_silu_computes_each_row_alone(intermediate):
    needs_dpbf16()
    torch.manual_seed(intermediate)
    ops = cpu_ops()
    packed = ops.pack_bf16_weight(torch.randn(2 * intermediate, 576).bfloat16())
    x = torch.randn(ROWS, 576).bfloat16()
    assert_each_row_computed_alone(lambda t: ops.linear_bf16_silu_mul(t, packed, torch.empty(0), intermediate), x)


@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("in_features, out_features", [(576, 960), (1536, 576), (64, 100)])
def test_the_quantized_linears_compute_each_row_alone(bits, dtype, in_features, out_features):
    """nanopaged's 4- and 8-bit kernels (what a quantized layer runs at every row count), and the
    plain loops of a build without VNNI, which run the same sums."""
    torch.manual_seed(bits + out_features)
    ops = cpu_ops()
    lo, hi = (0, 16) if bits == 4 else (-128, 128)
    codes = torch.randint(lo, hi, (out_features, in_features))
    d = (torch.rand(out_features, in_features // 32) / 20).half().float()
    m = (torch.randn(out_features, in_features // 32) / 10).half().float() if bits == 4 else torch.empty(0)
    packed = ops.pack_quantized(codes, d, m, 32, bits)
    x = torch.randn(ROWS, in_features).to(dtype)
    assert_each_row_computed_alone(lambda t: ops.linear_quantized(t, packed, out_features, 32, bits), x)


@pytest.mark.parametrize("method", ["int4", "int8"])
def test_torchs_quantized_kernels_compute_each_row_alone(method, monkeypatch):
    """torch's weight-only int4 and int8 kernels (where nanopaged's did not build with VNNI): measured
    here, since a quantized layer runs them at every row count."""
    monkeypatch.setattr(ql, "nanopaged_kernels", lambda: None)
    torch.manual_seed(7)
    dense = torch.nn.Linear(576, 960, bias=False, dtype=torch.bfloat16)
    weight = dense.weight.detach()
    layer = (Int4Linear(dense, *int4_codes(weight, 32), 32) if method == "int4"
             else Int8Linear(dense, *int8_codes(weight, 576)))
    assert_each_row_computed_alone(layer, torch.randn(ROWS, 576).bfloat16())


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_the_norms_compute_each_row_alone(dtype):
    torch.manual_seed(1)
    ops = cpu_ops()
    weight = torch.randn(576).to(dtype)
    x, residual = torch.randn(ROWS, 576).to(dtype), torch.randn(ROWS, 576).to(dtype)
    assert_each_row_computed_alone(lambda t: ops.rms_norm(t, weight, 1e-5), x)
    # add_rms_norm writes x + residual into x: each call gets fresh copies of the rows it is given
    assert_each_row_computed_alone(
        lambda t: ops.add_rms_norm(t.clone(), residual[_rows_of(t, x)].clone(), weight, 1e-5), x)


def _rows_of(part: torch.Tensor, whole: torch.Tensor) -> torch.Tensor:
    """Which rows of `whole` `part` holds (a prefix, one row, or all of them reversed)."""
    matches = (part[:, None, :] == whole[None, :, :]).all(dim=-1)
    return matches.float().argmax(dim=1)


def test_the_argmax_computes_each_row_alone():
    torch.manual_seed(2)
    x = torch.randn(ROWS, 49152)
    x[5, 100] = x[5, 200] = x[5].max() + 1           # a tie: the first index, whatever else is in the step
    assert_each_row_computed_alone(cpu_ops().argmax_rows, x)
    assert cpu_ops().argmax_rows(x[5:6]).item() == 100


@pytest.mark.parametrize("qk_norm", [False, True])
def test_the_rotation_and_the_store_compute_each_row_alone(qk_norm):
    """q rotated in place (Qwen3: each head normed first) and k, v written to the row's own slot."""
    from nanopaged.cpu.build import from_kernel_layout
    torch.manual_seed(3)
    ops = cpu_ops()
    heads, kv_heads, dim, block = 9, 3, 64, 16
    width = (heads + 2 * kv_heads) * dim
    qkv = torch.randn(ROWS, width).bfloat16()
    cos, sin = torch.randn(ROWS, 1, dim).bfloat16(), torch.randn(ROWS, 1, dim).bfloat16()
    slots = torch.randperm(32 * block)[:ROWS]
    norms = (torch.randn(dim).bfloat16(), torch.randn(dim).bfloat16(), 1e-6) if qk_norm else (
        torch.empty(0), torch.empty(0), 0.0)

    def rotated_and_stored(t: torch.Tensor) -> torch.Tensor:
        rows = _rows_of(t, qkv)
        q = t.clone()
        k_cache, v_cache = torch.zeros(2, 32, block, kv_heads, dim, dtype=torch.bfloat16)
        ops.rotary_and_store(q, cos[rows], sin[rows], *norms, heads, kv_heads, k_cache, v_cache, slots[rows])
        k, v = from_kernel_layout(k_cache, v_cache)
        s = slots[rows]
        stored = torch.cat([k.flatten(0, 1)[s].flatten(1), v.flatten(0, 1)[s].flatten(1)], dim=1)
        return torch.cat([q[:, :heads * dim], stored], dim=1)

    assert_each_row_computed_alone(rotated_and_stored, qkv)
