"""An 8-bit KV cache (kv_cache_dtype "fp8" = fp8_e4m3, "fp8_e5m2") in the C++ kernels and the torch reference.

The store (store_kv, and rotary_and_store in the fused layers) writes the bytes the torch reference
writes (attention/torch_backend.py: to_cache_dtype): every bfloat16 and float16 value, saturated past
the format's largest finite value, rounded to nearest even. Paged attention over an 8-bit cache gives
the bits the same kernel gives over a bfloat16 cache holding the values those bytes stand for (both
formats are exact in bfloat16, so the kernel's widening in registers may change nothing), on the
VDPBF16PS path (head_dim 64, 128) and on the plain loops (16, 96); each row's bits do not depend on
the rows beside it; and it matches the torch reference reading the same cache, over GQA, shuffled
block tables, whole prompts, later chunks, prefix-cache hits and decode rows in one step.
Engines end to end: tests/engine/test_kv_cache_dtype.py.
"""
import pytest
import torch

from nanopaged.attention.metadata import AttentionMetadata
from nanopaged.attention.torch_backend import TorchAttentionBackend, from_cache_dtype, store_kvcache, to_cache_dtype
from nanopaged.cpu.build import available, from_kernel_layout, to_kernel_layout

pytestmark = pytest.mark.skipif(available() is not None, reason=f"{available()}")

FP8 = [torch.float8_e4m3fn, torch.float8_e5m2]
EIGHT_BIT = FP8 + [torch.int8]


def every_value(dtype: torch.dtype) -> torch.Tensor:
    """Every 16-bit pattern of a bfloat16 or float16 (NaNs included), as (4096, 1, 16) tokens."""
    bits = torch.arange(-2 ** 15, 2 ** 15, dtype=torch.int32).to(torch.int16)
    return bits.view(dtype).view(4096, 1, 16)


def read_back(cache: torch.Tensor, slots: torch.Tensor, kernel_order_of: int | None = None) -> torch.Tensor:
    """The bytes stored at `slots` (tokens, kv_heads, head_dim); kernel_order_of 0 (K) or 1 (V): a cache in
    the kernels' order, read in the paper's."""
    raw = cache.view(torch.uint8)
    if kernel_order_of is not None:
        raw = from_kernel_layout(raw, raw)[kernel_order_of]
    return raw.view(-1, *raw.shape[2:])[slots]


@pytest.mark.parametrize("cache_dtype", FP8)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_store_kv_writes_the_bytes_the_reference_writes_for_every_value(ops, cache_dtype, dtype):
    k = every_value(dtype)
    v = k.flip(0)
    slots = torch.randperm(4096)
    want = torch.zeros(2, 256, 16, 1, 16, dtype=cache_dtype)
    store_kvcache(k, v, want[0], want[1], slots)
    got = torch.zeros(2, 256, 16, 1, 16, dtype=cache_dtype)
    ops.store_kv(k, v, got[0], got[1], slots)
    for x, i in ((k, 0), (v, 1)):
        ours, theirs = read_back(got[i], slots, kernel_order_of=i), read_back(want[i], slots)
        nan = x.isnan()                 # a NaN stays a NaN; its sign is the clamp's to choose
        assert torch.equal(ours[~nan], theirs[~nan])
        assert ours[nan].view(cache_dtype).float().isnan().all() and theirs[nan].view(cache_dtype).float().isnan().all()
    values = read_back(want[0], slots).view(cache_dtype).float()
    most = torch.finfo(cache_dtype).max
    assert (values[~k.isnan()].abs() <= most).all()          # saturated: no infinity, not even from one
    assert (values[k.float().abs() >= 2 * most].abs() == most).all()
    assert (values[k.float().abs() <= most] == k.float()[k.float().abs() <= most].to(cache_dtype).float()).all()


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_store_kv_writes_int8_codes_and_scales_as_the_reference(ops, dtype):
    """Each token's head: round(x / s) and the 4 bytes of s = absmax / 127, after the head's codes; a row of
    zeros keeps scale 0 and codes 0."""
    torch.manual_seed(2)
    n, kv_heads, dim = 200, 3, 64
    k = (torch.randn(n, kv_heads, dim) * torch.logspace(-4, 3, n)[:, None, None]).to(dtype)
    k[7] = 0
    v = k.roll(1, 0)
    slots = torch.randperm(20 * 16)[:n]
    want = torch.zeros(2, 20, 16, kv_heads, dim + 4, dtype=torch.int8)
    store_kvcache(k, v, want[0], want[1], slots)
    got = torch.zeros(2, 20, 16, kv_heads, dim + 4, dtype=torch.int8)
    ops.store_kv(k, v, got[0], got[1], slots)
    assert all(torch.equal(a, b) for a, b in zip(got, to_kernel_layout(*want)))
    rows = want[0].view(-1, kv_heads, dim + 4)[slots]
    assert rows[..., :dim].abs().amax(-1).tolist() == [[0] * kv_heads if i == 7 else [127] * kv_heads for i in range(n)]
    torch.testing.assert_close(from_cache_dtype(rows, torch.float32), k.float(), rtol=0, atol=k.float().abs().amax() / 254)


@pytest.mark.parametrize("cache_dtype", EIGHT_BIT)
def test_rotary_and_store_stores_what_store_kv_stores(ops, cache_dtype):
    """The fused layers' store: the same bytes as store_kv writes for the rotated k and the v it holds."""
    torch.manual_seed(3)
    n, heads, kv_heads, dim = 21, 9, 3, 64
    row = dim + 4 * (cache_dtype == torch.int8)
    width = (heads + 2 * kv_heads) * dim
    qkv = (8 * torch.randn(n, width)).bfloat16()
    cos, sin = torch.randn(2, n, dim).bfloat16()
    slots = torch.randperm(40 * 16)[:n]
    got = torch.zeros(2, 40, 16, kv_heads, row, dtype=cache_dtype)
    ops.rotary_and_store(qkv, cos, sin, torch.empty(0), torch.empty(0), 0.0, heads, kv_heads, got[0], got[1], slots)
    k, v = qkv[:, heads * dim:].view(n, 2, kv_heads, dim).unbind(1)     # rotated in place
    want = torch.zeros(2, 40, 16, kv_heads, row, dtype=cache_dtype)
    ops.store_kv(k, v, want[0], want[1], slots)
    assert torch.equal(got.view(torch.uint8), want.view(torch.uint8))
    assert got.view(torch.uint8).count_nonzero() > 0


def eight_bit_case(cache_dtype, heads, kv_heads, dim, seq_lens, query_lens, every_code=False, seed=0):
    """A shuffled pool of 8-bit K/V in the paper's order, noise in every spare slot, and strided bfloat16
    queries. every_code: the caches' bytes drawn from every finite code, for int8 each row's scale a power of
    two (code x scale is exact in bfloat16), and small queries: no weight so small that scaling it would
    leave float32's normal numbers."""
    torch.manual_seed(seed)
    block, num_blocks = 16, 400
    shape = (2, num_blocks, block, kv_heads, dim)
    if every_code and cache_dtype == torch.int8:
        scales = torch.exp2(torch.randint(-12, 0, shape[:-1] + (1,)).float())
        caches = torch.cat([torch.randint(-128, 128, shape, dtype=torch.int8), scales.view(torch.int8)], dim=-1)
    elif every_code:
        caches = torch.randint(0, 256, shape, dtype=torch.uint8).view(cache_dtype)
        caches = torch.where(caches.float().isfinite(), caches.float(), 0.0).to(cache_dtype)
    else:
        caches = to_cache_dtype(2 * torch.randn(shape).bfloat16(), cache_dtype)
    q_scale = {torch.int8: 1e-2}.get(cache_dtype, 1e-3) if every_code else 1.0   # no weight far below the others
    max_blocks = -(-max(seq_lens) // block)
    tables = torch.randperm(num_blocks)[:len(seq_lens) * max_blocks].view(len(seq_lens), max_blocks)
    q = (q_scale * torch.randn(sum(query_lens), heads + kv_heads, dim)).bfloat16()[:, :heads]
    starts = torch.tensor([0] + query_lens).cumsum(0)
    return q, caches[0], caches[1], tables, torch.tensor(seq_lens), starts


def kernel(ops, case, scale):
    q, k_cache, v_cache, *rest = case
    return ops.paged_attention(q, *to_kernel_layout(k_cache, v_cache), *rest, scale)


def widened(case):
    """The same case with the caches holding the same numbers in bfloat16."""
    q, k_cache, v_cache, *rest = case
    return (q, from_cache_dtype(k_cache, torch.bfloat16), from_cache_dtype(v_cache, torch.bfloat16), *rest)


# a whole prompt, a later chunk of one, a prefix-cache hit recomputing its last token, decode rows
MIXED = ([37, 90, 16, 5, 130, 203, 2], [37, 24, 1, 1, 3, 1, 1])


@pytest.mark.parametrize("cache_dtype", FP8)
@pytest.mark.parametrize("heads, kv_heads, dim", [(9, 3, 64), (8, 2, 128), (4, 2, 16), (6, 2, 96)])
@pytest.mark.parametrize("every_code", [False, True])
def test_an_fp8_cache_attends_as_bfloat16_holding_the_same_numbers(ops, cache_dtype, heads, kv_heads, dim,
                                                                    every_code):
    case = eight_bit_case(cache_dtype, heads, kv_heads, dim, *MIXED, every_code=every_code, seed=dim)
    got = kernel(ops, case, dim ** -0.5)
    assert got.dtype == torch.bfloat16 and torch.isfinite(got).all()
    assert torch.equal(got, kernel(ops, widened(case), dim ** -0.5))


@pytest.mark.parametrize("heads, kv_heads, dim", [(9, 3, 64), (8, 2, 128), (4, 2, 16), (6, 2, 96)])
def test_int8_codes_with_power_of_two_scales_attend_as_bfloat16_holding_code_times_scale(ops, heads, kv_heads, dim):
    """The kernel multiplies codes, then each token's score by its K row's scale and its weight by its V
    row's scale: with scales that are powers of two, every product is the same number as with code x scale
    in bfloat16, so the bits must be the same."""
    case = eight_bit_case(torch.int8, heads, kv_heads, dim, *MIXED, every_code=True, seed=dim)
    got = kernel(ops, case, dim ** -0.5)
    assert torch.isfinite(got).all() and got.abs().max() > 0
    assert torch.equal(got, kernel(ops, widened(case), dim ** -0.5))


@pytest.mark.parametrize("cache_dtype", EIGHT_BIT)
def test_each_row_over_an_8_bit_cache_is_computed_alone(ops, cache_dtype):
    """Many rows at once (whole rows per thread) and each row alone (its KV heads split over threads):
    the same bits."""
    seq_lens = [1, 2, 16, 17, 100, 203] * 4
    q, k_cache, v_cache, tables, lens, starts = eight_bit_case(cache_dtype, 9, 3, 64, seq_lens, [1] * 24, seed=5)
    k_cache, v_cache = to_kernel_layout(k_cache, v_cache)
    together = ops.paged_attention(q, k_cache, v_cache, tables, lens, starts, 0.125)
    for r in range(24):
        alone = ops.paged_attention(q[r:r + 1], k_cache, v_cache, tables[r:r + 1], lens[r:r + 1],
                                    torch.tensor([0, 1]), 0.125)
        assert torch.equal(alone[0], together[r]), r


@pytest.mark.parametrize("cache_dtype", EIGHT_BIT)
@pytest.mark.parametrize("heads, kv_heads, dim", [(9, 3, 64), (4, 2, 16)])
def test_an_8_bit_cache_attends_as_the_torch_reference_reads_it(ops, cache_dtype, heads, kv_heads, dim):
    seq_lens, query_lens = MIXED
    q, k_cache, v_cache, tables, lens, starts = case = eight_bit_case(cache_dtype, heads, kv_heads, dim, *MIXED,
                                                                      seed=1)
    meta = AttentionMetadata(slot_mapping=torch.empty(0, dtype=torch.long), query_start_loc=starts, seq_lens=lens,
                             block_tables=tables, query_lens_list=query_lens, seq_lens_list=seq_lens, block_size=16)
    unused = torch.zeros(q.shape[0], kv_heads, dim)             # the new K/V: read from the cache instead
    want = TorchAttentionBackend().attend(q, unused.bfloat16(), unused.bfloat16(), k_cache, v_cache, meta, dim ** -0.5)
    meta.plan = None
    exact = TorchAttentionBackend().attend(q.float(), unused, unused, k_cache, v_cache, meta, dim ** -0.5)
    got = kernel(ops, case, dim ** -0.5).float()
    # int8: the kernel scales scores and weights in float32 where the reference rounds code x scale to
    # bfloat16 first; it must be as close to float32 attention over the same cache as the reference is
    assert (got - exact).abs().max() <= 1.25 * (want.float() - exact).abs().max()
    if cache_dtype != torch.int8:
        torch.testing.assert_close(got, want.float(), atol=1e-2, rtol=1e-2)


def test_the_kernels_refuse_a_cache_of_another_dtype(ops):
    q = torch.randn(1, 4, 16).bfloat16()
    cache = torch.zeros(2, 4, 2, 16, dtype=torch.float16)
    with pytest.raises(RuntimeError, match="the KV cache must hold the model's dtype"):
        ops.paged_attention(q, cache, cache, torch.zeros(1, 1, dtype=torch.long), torch.ones(1, dtype=torch.long),
                            torch.tensor([0, 1]), 0.25)
    with pytest.raises(RuntimeError, match="the KV cache must hold the model's dtype"):
        ops.store_kv(q[:, :2], q[:, :2], cache, cache, torch.zeros(1, dtype=torch.long))
