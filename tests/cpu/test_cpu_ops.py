"""nanopaged's C++ CPU kernels (nanopaged/cpu/csrc/) against the torch ops they replace.

Each kernel rounds where its torch reference rounds, so in bfloat16 and float16 it gives the
reference's values except where a float32 sum taken in another order, or the last bit of an exp,
lands on the other side of a rounding boundary: those differ by a unit or two of the dtype, and rarely.
Every check runs twice: on the build for this CPU, and on a build without AVX-512 (the loops an
AVX2-only host runs), so both paths are held to the reference on any x86 host.
"""
import pytest
import torch
import torch.nn.functional as F
from conftest import torch_threads

from nanopaged.attention.torch_backend import store_kvcache
from nanopaged.cpu.build import available, cpu_ops, from_kernel_layout, to_kernel_layout
from nanopaged.models.llama import RMSNorm, apply_rotary

pytestmark = pytest.mark.skipif(available() is not None, reason=f"{available()}")

DTYPES = [torch.float32, torch.bfloat16, torch.float16]


def assert_close_to_reference(got: torch.Tensor, want: torch.Tensor, min_exact: float = 0.98) -> None:
    """float32: within float32 rounding; otherwise identical but for a few values a unit or two of
    the dtype apart (a sum in another order, rounded twice on its way out), never more."""
    assert got.dtype == want.dtype and got.shape == want.shape
    if got.dtype == torch.float32:
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
        return
    exact = (got == want).float().mean().item()
    assert exact >= min_exact, f"only {exact:.1%} of the values equal the reference's"
    ulp = torch.finfo(got.dtype).eps * want.float().abs().clamp(min=1e-3)
    assert ((got.float() - want.float()).abs() <= 2 * ulp).all()


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows, dim", [(1, 576), (24, 576), (7, 40), (300, 1024)])
def test_rms_norm_equals_the_models_rmsnorm(ops, dtype, rows, dim):
    torch.manual_seed(rows + dim)
    norm = RMSNorm(dim, 1e-5).to(dtype)
    with torch.no_grad():
        norm.weight.copy_(torch.randn(dim))
    x = (3 * torch.randn(rows, dim + 8)).to(dtype)[:, :dim]        # a strided view, as the model may pass
    with torch.no_grad():
        assert_close_to_reference(ops.rms_norm(x, norm.weight.detach(), 1e-5), norm(x))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows, dim", [(1, 576), (24, 576), (7, 40)])
def test_add_rms_norm_adds_the_residual_in_place_then_norms(ops, dtype, rows, dim):
    """x = x + y rounded as the reference's add rounds it (the residual stream), then RMSNorm(x)."""
    torch.manual_seed(rows * dim)
    norm = RMSNorm(dim, 1e-6).to(dtype)
    with torch.no_grad():
        norm.weight.copy_(torch.randn(dim))
    x = (3 * torch.randn(rows, dim)).to(dtype)
    y = torch.randn(rows, dim + 3).to(dtype)[:, :dim]
    want_x = x + y
    with torch.no_grad():
        want_h = norm(want_x)
        got_h = ops.add_rms_norm(x, y, norm.weight.detach(), 1e-6)
    assert torch.equal(x, want_x)                                   # one rounding, as torch's add
    assert_close_to_reference(got_h, want_h)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows, inter", [(1, 1536), (24, 1536), (5, 40)])
def test_silu_and_mul_equals_silu_times_up(ops, dtype, rows, inter):
    torch.manual_seed(rows + inter)
    gate_up = (4 * torch.randn(rows, 2 * inter)).to(dtype)
    gate, up = gate_up.chunk(2, dim=-1)
    assert_close_to_reference(ops.silu_and_mul(gate_up), F.silu(gate) * up)


def test_silu_and_mul_is_finite_far_out(ops):
    gate_up = torch.tensor([[-1e4, -100.0, 0.0, 100.0, 1e4, 3.0] + [0.0] * 10 + [1.0] * 16])
    out = ops.silu_and_mul(gate_up)
    assert torch.isfinite(out).all()
    torch.testing.assert_close(out, F.silu(gate_up[:, :16]) * gate_up[:, 16:])


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("heads, kv_heads, dim, qk_norm", [(9, 3, 64, False), (4, 2, 128, True), (2, 2, 16, False),
                                                           (6, 1, 96, True)])
def test_rotary_and_store_equals_rotating_then_storing(ops, dtype, heads, kv_heads, dim, qk_norm):
    """q and k rotated in place (after each head's norm for Qwen3), k and v at their slots of a
    shuffled pool, as the reference model rotates them and store_kvcache stores them."""
    torch.manual_seed(heads * dim)
    n, block, num_blocks = 11, 4, 40
    width = (heads + 2 * kv_heads) * dim
    qkv = torch.randn(n, width + 5).to(dtype)[:, :width]       # a row stride wider than the row
    cos = torch.randn(n, 1, dim).to(dtype)
    sin = torch.randn(n, 1, dim).to(dtype)
    slots = torch.randperm(num_blocks * block)[:n]
    q_norm, k_norm = RMSNorm(dim, 1e-6).to(dtype), RMSNorm(dim, 1e-6).to(dtype)
    with torch.no_grad():
        q_norm.weight.copy_(torch.randn(dim))
        k_norm.weight.copy_(torch.randn(dim))

    # the reference: the model's ops, then store_kvcache
    q, k, v = qkv.clone().split([heads * dim, kv_heads * dim, kv_heads * dim], dim=-1)
    qk = torch.cat([q, k], dim=-1).view(n, heads + kv_heads, dim)
    if qk_norm:
        with torch.no_grad():
            qk = torch.cat((q_norm(qk[:, :heads]), k_norm(qk[:, heads:])), dim=1)
    qk = apply_rotary(qk, (cos, sin))
    k_want, v_want = torch.zeros(2, num_blocks, block, kv_heads, dim, dtype=dtype)
    store_kvcache(qk[:, heads:], v.reshape(n, kv_heads, dim), k_want, v_want, slots)

    k_cache, v_cache = torch.zeros(2, num_blocks, block, kv_heads, dim, dtype=dtype)
    weights = (q_norm.weight.detach(), k_norm.weight.detach(), 1e-6) if qk_norm else (torch.empty(0), torch.empty(0), 0.0)
    ops.rotary_and_store(qkv, cos, sin, *weights, heads, kv_heads, k_cache, v_cache, slots)
    q_got = qkv[:, :heads * dim].reshape(n, heads, dim)
    assert_close_to_reference(q_got, qk[:, :heads].contiguous())
    k_got, v_got = from_kernel_layout(k_cache, v_cache)              # the kernels' order within a block
    assert_close_to_reference(k_got, k_want)
    assert torch.equal(v_got, v_want)                                 # v is copied, not computed
    assert torch.equal(qkv[:, (heads + kv_heads) * dim:], v)


def reference_attention(q, k_cache, v_cache, tables, seq_lens, query_lens, scale):
    """Each request's rows over its keys, gathered through its block table, in float32; row j of
    a request's q_len rows sees the first seq_len - q_len + j + 1 keys."""
    heads, dim = q.shape[1:]
    kv_heads, block = k_cache.shape[2], k_cache.shape[1]
    out, start = torch.empty(q.shape), 0
    for i, (n, q_len) in enumerate(zip(seq_lens, query_lens)):
        blocks = tables[i, :-(-n // block)]
        kk, vv = k_cache[blocks].flatten(0, 1)[:n].float(), v_cache[blocks].flatten(0, 1)[:n].float()
        qq = q[start:start + q_len].float().view(q_len, kv_heads, heads // kv_heads, dim)
        scores = torch.einsum("jhgd,thd->jhgt", qq, kk) * scale
        visible = torch.arange(n)[None, :] <= (n - q_len + torch.arange(q_len))[:, None]      # (q_len, n)
        scores = scores.masked_fill(~visible[:, None, None, :], float("-inf"))
        out[start:start + q_len] = torch.einsum("jhgt,thd->jhgd", scores.softmax(-1), vv).reshape(q_len, heads, dim)
        start += q_len
    return out


def paged_attention_case(dtype, heads, kv_heads, dim, block, seq_lens, query_lens, seed=0):
    """A shuffled pool with noise in every spare slot, and strided queries, as the model hands them over;
    the caches in the paper's order (the reference reads them so; kernel_case reorders them)."""
    torch.manual_seed(seed)
    num_blocks = 300
    k_cache = torch.randn(num_blocks, block, kv_heads, dim).to(dtype)
    v_cache = torch.randn(num_blocks, block, kv_heads, dim).to(dtype)
    max_blocks = -(-max(seq_lens) // block)
    tables = torch.randperm(num_blocks)[:len(seq_lens) * max_blocks].view(len(seq_lens), max_blocks)
    q = (2 * torch.randn(sum(query_lens), heads + kv_heads, dim)).to(dtype)[:, :heads]
    starts = torch.tensor([0] + query_lens).cumsum(0)
    return q, k_cache, v_cache, tables, torch.tensor(seq_lens), starts


def kernel_case(case):
    """The same case with the caches in the kernels' order."""
    q, k_cache, v_cache, *rest = case
    return (q, *to_kernel_layout(k_cache, v_cache), *rest)


@pytest.mark.parametrize("dtype, tolerance", [(torch.float32, 2e-5), (torch.bfloat16, 1e-2), (torch.float16, 2e-3)])
@pytest.mark.parametrize("heads, kv_heads, dim, block", [(9, 3, 64, 16), (8, 8, 128, 8), (16, 2, 64, 32),
                                                         (4, 2, 16, 8), (6, 2, 96, 16), (32, 1, 64, 16),
                                                         (4, 4, 256, 16)])
def test_paged_attention_of_decode_rows_equals_gathering_the_blocks(ops, dtype, tolerance, heads, kv_heads, dim,
                                                                    block):
    """One-token rows, lengths from 1 to past a few blocks; head_dim 64/128/256 take the vector
    kernel, 16 and 96 the plain loops, and 32 query heads per KV head more than it holds."""
    seq_lens = [1, 2, block, block + 1, 17, 100, 203]
    case = paged_attention_case(dtype, heads, kv_heads, dim, block, seq_lens, [1] * 7, seed=heads + dim + block)
    got = ops.paged_attention(*kernel_case(case), dim ** -0.5)
    assert got.dtype == dtype
    want = reference_attention(*case[:5], [1] * 7, dim ** -0.5)
    torch.testing.assert_close(got.float(), want, atol=tolerance, rtol=tolerance)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("heads, kv_heads, dim, block", [(9, 3, 64, 16), (16, 2, 64, 32), (32, 1, 64, 16),
                                                         (8, 8, 128, 16), (12, 3, 64, 16), (10, 2, 128, 16),
                                                         (4, 4, 256, 16)])
def test_paged_attention_of_many_rows_equals_one_row_at_a_time(ops, dtype, heads, kv_heads, dim, block):
    """A step of many rows gives each thread whole rows (every KV head of a row in one job, 1, 2,
    3 or 4 query heads per KV head at a time); a step of one row splits its KV heads over the
    threads. Each row's answer is the same bits either way, and the reference's within bfloat16."""
    seq_lens = [1, 2, block, block + 1, 17, 100, 203] * 3
    case = paged_attention_case(dtype, heads, kv_heads, dim, block, seq_lens, [1] * 21, seed=heads + dim)
    q, k_cache, v_cache, tables, lens, starts = kernel_case(case)
    with torch_threads(2):               # 21 rows: whole rows for each of two threads
        together = ops.paged_attention(q, k_cache, v_cache, tables, lens, starts, dim ** -0.5)
    for r in range(21):
        alone = ops.paged_attention(q[r:r + 1], k_cache, v_cache, tables[r:r + 1], lens[r:r + 1],
                                    torch.tensor([0, 1]), dim ** -0.5)
        assert torch.equal(alone[0], together[r]), r
    want = reference_attention(*case[:5], [1] * 21, dim ** -0.5)
    torch.testing.assert_close(together.float(), want, atol=1e-2, rtol=1e-2)


@pytest.mark.parametrize("dtype, tolerance", [(torch.float32, 2e-5), (torch.bfloat16, 1e-2)])
@pytest.mark.parametrize("heads, kv_heads, dim", [(9, 3, 64), (4, 2, 96)])
def test_paged_attention_of_a_mixed_step_is_causal(ops, dtype, tolerance, heads, kv_heads, dim):
    """A whole prompt, a later chunk of one (its earlier tokens in the pool), a prefix-cache hit
    recomputing one token, and decode rows, in one call: each new row sees the keys up to its own."""
    seq_lens, query_lens = [37, 90, 16, 5, 130], [37, 24, 1, 1, 3]
    case = paged_attention_case(dtype, heads, kv_heads, dim, 16, seq_lens, query_lens, seed=dim)
    got = ops.paged_attention(*kernel_case(case), dim ** -0.5)
    want = reference_attention(*case[:5], query_lens, dim ** -0.5)
    torch.testing.assert_close(got.float(), want, atol=tolerance, rtol=tolerance)


def test_paged_attention_splits_a_long_prompt_evenly_over_threads(ops):
    """One 700-token prompt: its rows are cut by keys, not by count, and the answer is the same
    whatever the number of threads."""
    case = paged_attention_case(torch.float32, 4, 2, 64, 16, [700], [700], seed=7)
    outs = []
    for threads in (1, 2, 3):
        with torch_threads(threads):
            outs.append(ops.paged_attention(*kernel_case(case), 0.125))
    assert torch.equal(outs[0], outs[1]) and torch.equal(outs[0], outs[2])
    torch.testing.assert_close(outs[0], reference_attention(*case[:5], [700], 0.125), atol=2e-5, rtol=2e-5)


def test_a_slot_past_the_request_is_never_read(ops):
    """Odd lengths end in the middle of a pair of V's tokens: whatever the slot past the end holds
    (here NaN) weighs nothing, and no score past the end enters the softmax."""
    case = paged_attention_case(torch.bfloat16, 9, 3, 64, 16, [5, 17, 33], [1, 1, 1], seed=3)
    q, k_cache, v_cache, tables, lens, starts = case
    for r, n in enumerate(lens.tolist()):               # poison every slot of the last block past n
        last = tables[r, (n - 1) // 16]
        k_cache[last, (n - 1) % 16 + 1:] = float("nan")
        v_cache[last, (n - 1) % 16 + 1:] = float("nan")
    got = ops.paged_attention(*kernel_case(case), 0.125)
    assert torch.isfinite(got).all()
    want = reference_attention(q, k_cache, v_cache, tables, lens, [1, 1, 1], 0.125)
    torch.testing.assert_close(got.float(), want, atol=1e-2, rtol=1e-2)


@pytest.mark.parametrize("dtype", DTYPES)
def test_store_kv_puts_each_token_in_its_slot(ops, dtype):
    """The cpu backend's store: read back in the paper's order, the same pool store_kvcache writes."""
    torch.manual_seed(1)
    n, kv_heads, dim, block, num_blocks = 13, 3, 64, 16, 20
    k = torch.randn(n, kv_heads + 1, dim).to(dtype)[:, :kv_heads]       # strided, as views of qkv are
    v = torch.randn(n, kv_heads, dim).to(dtype)
    slots = torch.randperm(num_blocks * block)[:n]
    k_want, v_want = torch.zeros(2, num_blocks, block, kv_heads, dim, dtype=dtype)
    store_kvcache(k, v, k_want, v_want, slots)
    k_cache, v_cache = torch.zeros(2, num_blocks, block, kv_heads, dim, dtype=dtype)
    ops.store_kv(k, v, k_cache, v_cache, slots)
    k_got, v_got = from_kernel_layout(k_cache, v_cache)
    assert torch.equal(k_got, k_want) and torch.equal(v_got, v_want)
    assert [t.tolist() for t in from_kernel_layout(*to_kernel_layout(k_want, v_want))] == [k_want.tolist(), v_want.tolist()]


@pytest.mark.parametrize("rows, n", [(1, 1), (1, 5), (3, 16), (2, 17), (24, 49152), (7, 1000)])
def test_argmax_rows_equals_torch_argmax(ops, rows, n):
    torch.manual_seed(rows * n)
    x = torch.randn(rows, n)
    assert torch.equal(ops.argmax_rows(x), x.argmax(dim=-1))
    assert torch.equal(ops.argmax_rows(x[:, ::2]), x[:, ::2].argmax(dim=-1))       # a strided view


def test_argmax_rows_breaks_ties_and_meets_nan_and_infinity_as_torch_does(ops):
    """The first of equal largest values; a NaN beats every number and the first NaN wins; a row
    of -inf (every token masked) answers 0; +inf is an ordinary largest value."""
    x = torch.randn(10, 1000)
    x[0, 700] = x[0, 5] = x[0, 900] = 50.0          # a tie, the first not in the first 16 lanes' order
    x[1, 300] = x[1, 17] = float("nan")
    x[2, 999] = float("nan")
    x[3] = float("-inf")
    x[4] = 0.0
    x[5, 123] = float("inf")
    x[6, 40], x[6, 8] = float("nan"), 1e30
    x[7, 16], x[7, 32] = 9.0, 9.0                    # equal values in one lane
    x[8, 31], x[8, 16] = 9.0, 9.0                    # equal values in two lanes, the later lane first
    want = x.argmax(dim=-1)
    assert torch.equal(ops.argmax_rows(x), want)
    assert want[:6].tolist() == [5, 17, 999, 0, 0, 123]


def test_the_kernels_refuse_a_misshapen_input(ops):
    with pytest.raises(RuntimeError, match="rms_norm: weight must be"):
        ops.rms_norm(torch.randn(2, 8), torch.randn(7), 1e-6)
    with pytest.raises(RuntimeError, match="silu_and_mul: gate_up must be"):
        ops.silu_and_mul(torch.randn(2, 7))
    with pytest.raises(RuntimeError, match="heads must be a multiple of kv_heads"):
        ops.paged_attention(torch.randn(1, 5, 16), torch.randn(2, 4, 2, 16), torch.randn(2, 4, 2, 16),
                            torch.zeros(1, 1, dtype=torch.long), torch.ones(1, dtype=torch.long),
                            torch.tensor([0, 1]), 0.25)
    with pytest.raises(RuntimeError, match="request 0 has more rows than keys, or more keys than its block table"):
        ops.paged_attention(torch.randn(1, 4, 16), torch.randn(2, 4, 2, 16), torch.randn(2, 4, 2, 16),
                            torch.zeros(1, 1, dtype=torch.long), torch.tensor([5]), torch.tensor([0, 1]), 0.25)


def dequantized(codes, d, m, group):
    """The float32 weight that 4-bit codes (w = q d + m) or 8-bit codes (m None: w = q d) stand for."""
    out_f, in_f = codes.shape
    w = codes.float().reshape(out_f, in_f // group, group) * d[..., None]
    if m is not None:
        w = w + m[..., None]
    return w.reshape(out_f, in_f)


@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows", [1, 2, 5, 12, 13, 30])
@pytest.mark.parametrize("out_features, in_features, group", [(96, 256, 32), (100, 64, 32), (40, 256, 64),
                                                              (7, 128, 128)])
def test_linear_quantized_multiplies_by_what_the_codes_stand_for(ops, bits, dtype, rows, out_features, in_features,
                                                                group):
    """Both layouts, every dtype, row counts around the 12-row tile, widths that are not whole
    tiles, the group sizes a setting allows; d and m are float16, as GGUF ships them. The product
    is the float32 matmul of the rows as quantize_activations quantizes them (8 bits per block) and
    the dequantized weight, rounded once to the dtype: on VPDPBUSD and on the plain loops alike."""
    torch.manual_seed(rows * out_features + bits)
    lo, hi = (0, 16) if bits == 4 else (-128, 128)
    codes = torch.randint(lo, hi, (out_features, in_features))
    d = (torch.rand(out_features, in_features // group) / 20).half().float()
    m = (torch.randn(out_features, in_features // group) / 10).half().float() if bits == 4 else None
    packed = ops.pack_quantized(codes, d, torch.empty(0) if m is None else m, group, bits)
    x = torch.randn(rows, in_features + 2).to(dtype)[:, :in_features]               # strided rows
    got = ops.linear_quantized(x, packed, out_features, group, bits)
    from nanopaged.cpu.quantized_linear import quantize_activations
    xq, dx = quantize_activations(x, group)
    x_hat = (xq.reshape(rows, -1, group) * dx[..., None]).reshape(rows, in_features)
    want = x_hat @ dequantized(codes, d, m, group).t()
    assert got.dtype == dtype and got.shape == (rows, out_features)
    tolerance = 1e-5 if dtype == torch.float32 else 2 * torch.finfo(dtype).eps
    torch.testing.assert_close(got.float(), want, rtol=tolerance, atol=tolerance * want.abs().max().item())


def test_linear_quantized_refuses_a_weight_of_another_width(ops):
    packed = ops.pack_quantized(torch.randint(0, 16, (32, 64)), torch.ones(32, 2), torch.zeros(32, 2), 32, 4)
    with pytest.raises(RuntimeError, match="x's in_features do not match the packed weight"):
        ops.linear_quantized(torch.randn(1, 128), packed, 32, 32, 4)


def test_the_build_folder_is_named_by_the_source_not_its_path(tmp_path, monkeypatch):
    """Two checkouts of the same sources share one library; a changed source or header, other flags
    or another torch install get their own folder, so no process rebuilds a library another has loaded."""
    import shutil
    import torch.utils.cpp_extension
    import nanopaged.cpu.build as module
    monkeypatch.setattr(torch.utils.cpp_extension, "get_default_build_root", lambda: str(tmp_path / "builds"))
    here = module.build_folder("nanopaged_cpu_ops", ["-O3"])
    assert here.parent == tmp_path / "builds" / "nanopaged" and here.is_dir()
    assert module.build_folder("nanopaged_cpu_ops", ["-O3", "-mavx2"]) != here
    clone = tmp_path / "checkout" / "csrc"
    shutil.copytree(module.CSRC, clone)
    monkeypatch.setattr(module, "SOURCES", sorted(clone.glob("*.cpp")))
    monkeypatch.setattr(module, "HEADERS", sorted(clone.glob("*.h")))
    assert module.build_folder("nanopaged_cpu_ops", ["-O3"]) == here            # another checkout, same source
    monkeypatch.setattr(torch, "__file__", "/another/environment/torch/__init__.py")
    assert module.build_folder("nanopaged_cpu_ops", ["-O3"]) != here            # another torch install
    monkeypatch.undo()
    monkeypatch.setattr(torch.utils.cpp_extension, "get_default_build_root", lambda: str(tmp_path / "builds"))
    monkeypatch.setattr(module, "SOURCES", sorted(clone.glob("*.cpp")))
    monkeypatch.setattr(module, "HEADERS", sorted(clone.glob("*.h")))
    header = clone / "vec16.h"
    header.write_bytes(header.read_bytes() + b"\n// changed\n")
    assert module.build_folder("nanopaged_cpu_ops", ["-O3"]) != here            # a changed header


def test_the_library_is_compiled_from_a_copy_in_its_folder():
    from pathlib import Path
    from torch.utils.cpp_extension import get_default_build_root
    import nanopaged.cpu.build as module
    cpu_ops()
    folders = [f for f in (Path(get_default_build_root()) / "nanopaged").iterdir()
               if f.name.startswith("nanopaged_cpu_ops-") and list(f.glob("*.so"))]
    assert any(all((f / p.name).exists() and (f / p.name).read_bytes() == p.read_bytes()
                   for p in module.SOURCES + module.HEADERS) for f in folders)
