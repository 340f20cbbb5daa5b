"""The Triton kernels (store, gather, paged attention) agree with the torch reference.

Without a GPU they run in Triton's interpreter on CPU tensors (conftest.py sets
TRITON_INTERPRET=1), which is slow: sizes are small and the parameters are a chosen spread
rather than a full cartesian product. Every batch uses a shuffled block table over a pool with
spare blocks full of noise, so reading a wrong block, or past a request's end, shows up.
"""
import os

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("triton")

from nanopaged.attention import torch_backend as ref   # noqa: E402
from nanopaged.attention.metadata import AttentionMetadata   # noqa: E402
from nanopaged.attention import triton_kernels as tk   # noqa: E402

DEVICE = "cpu" if os.environ.get("TRITON_INTERPRET") == "1" else "cuda"
NUM_LAYERS = 2   # the tests use layer 1, so per-layer caches are offset views of one tensor

# (block_size, queries per kv head, kv_heads, head_dim): each block size, GQA ratio and
# head_dim appears at least once; GQA 3 pads the 16-row tile (5 tokens x 3 heads = 15 rows).
CONFIGS = [(16, 1, 2, 64), (32, 3, 2, 128), (16, 8, 1, 128), (32, 8, 2, 64)]
CONFIG_IDS = ["bs16-mha-d64", "bs32-gqa3-d128", "bs16-gqa8-d128", "bs32-gqa8-d64"]

# (query_lens, seq_lens) per request: context before the new tokens = seq_len - query_len.
BATCHES = {
    "decode_only": ([1, 1, 1], [1, 17, 70]),
    "prefill_only": ([7, 40], [7, 40]),
    # a decode row, a first chunk, a chunk continuing after 25 tokens of context, a short decode
    "mixed_with_prefix_context": ([1, 9, 20, 1], [50, 9, 45, 3]),
}


def make_batch(query_lens, seq_lens, block_size, queries_per_kv, kv_heads, head_dim, seed=0):
    """q/k/v for the new tokens, a noisy pool (layers, 2, blocks, ...) and its metadata.

    Each request gets its blocks from a shuffled permutation of a pool with spare blocks.
    k and v are views into one fused tensor (as they come out of the qkv projection), so
    the kernels must honour their strides.
    """
    g = torch.Generator().manual_seed(seed)
    heads = kv_heads * queries_per_kv
    blocks_per_req = [-(-s // block_size) for s in seq_lens]
    num_blocks = sum(blocks_per_req) + 3
    perm = torch.randperm(num_blocks, generator=g).tolist()
    tables, slots, start = [], [], 0
    for n, q_len, s in zip(blocks_per_req, query_lens, seq_lens):
        table = perm[start:start + n]
        start += n
        tables.append(table + [0] * (max(blocks_per_req) - n))   # padded with 0, as the runner does
        slots += [table[p // block_size] * block_size + p % block_size for p in range(s - q_len, s)]
    num_tokens = sum(query_lens)
    pool = torch.randn(NUM_LAYERS, 2, num_blocks, block_size, kv_heads, head_dim, generator=g)
    q = torch.randn(num_tokens, heads, head_dim, generator=g)
    kv = torch.randn(num_tokens, 2, kv_heads, head_dim, generator=g)
    cu = [0]
    for q_len in query_lens:
        cu.append(cu[-1] + q_len)
    meta = AttentionMetadata(
        slot_mapping=torch.tensor(slots), query_start_loc=torch.tensor(cu),
        seq_lens=torch.tensor(seq_lens), block_tables=torch.tensor(tables),
        query_lens_list=list(query_lens), seq_lens_list=list(seq_lens), block_size=block_size)
    to = lambda t: t.to(DEVICE)   # noqa: E731
    meta.slot_mapping, meta.query_start_loc, meta.seq_lens, meta.block_tables = map(
        to, (meta.slot_mapping, meta.query_start_loc, meta.seq_lens, meta.block_tables))
    return to(q), to(kv)[:, 0], to(kv)[:, 1], to(pool), meta


# ---- store ------------------------------------------------------------------------------
@pytest.mark.parametrize("block_size", [16, 32])
def test_store_writes_each_token_to_its_slot_and_skips_padding(block_size):
    q, k, v, pool, meta = make_batch([5, 1, 12], [5, 30, 40], block_size, 1, 3, 64)
    assert not k.is_contiguous()   # a view of the fused kv tensor: strides matter
    # Mark every other token as padding (-1): its slot must stay untouched.
    slots = meta.slot_mapping.clone()
    slots[::2] = -1
    expected = pool.clone()
    keep = slots >= 0
    ref.store_kvcache(k[keep], v[keep], expected[1, 0], expected[1, 1], slots[keep])
    tk.store_kvcache(k, v, pool[1, 0], pool[1, 1], slots)
    assert torch.equal(pool, expected)


# ---- gather -----------------------------------------------------------------------------
@pytest.mark.parametrize("block_size,head_dim", [(16, 64), (32, 128)])
def test_gather_copies_each_request_through_its_block_table(block_size, head_dim):
    _, _, _, pool, meta = make_batch([1, 9, 20], [50, 9, 33], block_size, 1, 2, head_dim)
    cu_k = torch.nn.functional.pad(meta.seq_lens.cumsum(0), (1, 0))
    k, v = tk.gather_kvcache(pool[1, 0], pool[1, 1], meta.block_tables, meta.seq_lens, cu_k)
    for cache, got in ((pool[1, 0], k), (pool[1, 1], v)):
        want = torch.cat([ref.gather_kv(cache, meta.block_tables[i], s)
                          for i, s in enumerate(meta.seq_lens_list)])
        assert torch.equal(got, want)


# ---- paged attention ----------------------------------------------------------------------
@pytest.mark.parametrize("config", CONFIGS, ids=CONFIG_IDS)
@pytest.mark.parametrize("batch", list(BATCHES))
def test_paged_attention_matches_torch_reference(batch, config):
    """Decode rows, whole prompts and chunks after prefix context, GQA 1/3/8, in one launch."""
    query_lens, seq_lens = BATCHES[batch]
    q, k, v, pool, meta = make_batch(query_lens, seq_lens, *config)
    scale = config[3] ** -0.5
    pool_ref = pool.clone()
    want = ref.TorchAttentionBackend().forward(q, k, v, pool_ref[1, 0], pool_ref[1, 1], meta, scale)
    # The Triton backend's two steps: store the new tokens, then attend from the pool.
    tk.store_kvcache(k, v, pool[1, 0], pool[1, 1], meta.slot_mapping)
    got = tk.paged_attention(q, pool[1, 0], pool[1, 1], meta, scale)
    assert torch.equal(pool, pool_ref)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


def test_paged_attention_of_a_chunk_equals_the_same_rows_of_the_whole_prompt():
    """Chunked prefill is exact: the last 10 rows of a 40-token prompt, computed as a chunk
    after 30 tokens of context, equal those rows computed with the prompt in one piece."""
    q, k, v, pool, meta = make_batch([40], [40], 16, 2, 2, 64)
    tk.store_kvcache(k, v, pool[1, 0], pool[1, 1], meta.slot_mapping)
    whole = tk.paged_attention(q, pool[1, 0], pool[1, 1], meta, 0.125)
    meta.query_start_loc = torch.tensor([0, 10], device=DEVICE)
    meta.query_lens_list = [10]
    chunk = tk.paged_attention(q[30:], pool[1, 0], pool[1, 1], meta, 0.125)
    torch.testing.assert_close(chunk, whole[30:], atol=1e-5, rtol=1e-5)


def test_paged_attention_in_half_precision_accumulates_in_float32():
    """float16 pool and queries (the GPU case): the kernel casts p to the cache dtype for the
    second matmul and accumulates in float32, so it stays within float16 rounding of an
    exact float32 reference. (bfloat16 cannot be checked here: Triton 3.9's interpreter
    multiplies bfloat16 tl.dot operands as raw bits; it is exercised on GPUs only.)"""
    q, k, v, pool, meta = make_batch(*BATCHES["mixed_with_prefix_context"], 16, 3, 2, 64)
    pool_ref = pool.clone()
    want = ref.TorchAttentionBackend().forward(q, k, v, pool_ref[1, 0], pool_ref[1, 1], meta, 0.125)
    half = lambda t: t.half()   # noqa: E731
    pool_h = half(pool)
    tk.store_kvcache(half(k), half(v), pool_h[1, 0], pool_h[1, 1], meta.slot_mapping)
    got = tk.paged_attention(half(q), pool_h[1, 0], pool_h[1, 1], meta, 0.125)
    assert got.dtype == torch.float16
    torch.testing.assert_close(got.float(), want, atol=1e-2, rtol=1e-2)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("batch", ["decode_only", "mixed_with_prefix_context"])
def test_paged_attention_in_half_precision_on_cuda(dtype, batch):
    """The compiled kernel in bf16/fp16 against the float32 torch reference (the CPU tests
    cannot check bf16: Triton's interpreter multiplies bf16 tl.dot operands as raw bits)."""
    from nanopaged.attention.torch_backend import TorchAttentionBackend

    q, k, v, pool, meta = make_batch(*BATCHES[batch], 16, 4, 2, 128)   # GQA 4, head_dim 128
    pool_ref = pool.clone()
    want = TorchAttentionBackend().forward(q, k, v, pool_ref[1, 0], pool_ref[1, 1], meta, 128 ** -0.5)
    half = pool.to(dtype)
    tk.store_kvcache(k.to(dtype), v.to(dtype), half[1, 0], half[1, 1], meta.slot_mapping)
    got = tk.paged_attention(q.to(dtype), half[1, 0], half[1, 1], meta, 128 ** -0.5)
    assert got.dtype == dtype
    torch.testing.assert_close(got.float(), want, atol=2e-2, rtol=2e-2)
