"""Three Triton kernels for the paged KV cache: store, gather, and paged attention.

The paper's section 4.1 in code: K/V live in fixed-size blocks of one pool, and attention
fetches them block by block through each request's block table, so a request's K/V never
has to be contiguous in memory. docs/05_model_runner_and_kernels.md walks the kernel.

* `store_kvcache`:   write the new tokens' K/V into their slots (vLLM: `reshape_and_cache`).
* `gather_kvcache`:  copy each request's K/V out of its blocks into one contiguous varlen
                     tensor, for attention kernels that cannot read a block table
                     (flash-attn with blocks smaller than 256 tokens).
* `paged_attention`: attention of a mixed batch (decode rows and chunked-prefill rows) straight
                     from the pool, one kernel, online softmax as in FlashAttention
                     (vLLM: vllm/attention/ops/triton_unified_attention.py, simplified).

Shapes, as everywhere in nanopaged: q (num_tokens, heads, head_dim), k/v (num_tokens, kv_heads,
head_dim), each layer's k_cache/v_cache (num_blocks, block_size, kv_heads, head_dim). Every
kernel takes strides, because k/v arrive as views of the fused qkv projection and a layer's
cache is a view into the runner's one big tensor.

Index vectors are cast to int64 (as vLLM's kernels do): offsets into a large pool overflow
int32. Importing this module imports triton; nanopaged imports it only when a Triton backend
is chosen. Under TRITON_INTERPRET=1 (set before this import) the kernels run on CPU tensors.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from nanopaged.attention.metadata import AttentionMetadata


def _pow2(n: int, at_least: int = 1) -> int:
    """tl.arange needs power-of-two lengths: pad a size up, masking the extra lanes."""
    return max(at_least, triton.next_power_of_2(n))


def _check_grid(grid: tuple[int, int, int]) -> None:
    """CUDA launches at most 2^31 - 1 programs along grid axis 0 and 65,535 along axes 1 and 2."""
    if grid[0] > 2**31 - 1 or grid[1] > 65535 or grid[2] > 65535:
        raise ValueError(f"launch grid {grid} exceeds CUDA's limits (2^31 - 1, 65535, 65535); "
                         "lower max_num_seqs or the number of kv heads per kernel")


# ---- store: new K/V -> their slots in the pool --------------------------------------------
@triton.jit
def _store_kvcache_kernel(
    k_ptr, v_ptr, k_cache_ptr, v_cache_ptr, slot_mapping_ptr,
    k_stride_t, k_stride_h, v_stride_t, v_stride_h,        # new K/V: (tokens, kv_heads, D)
    c_stride_b, c_stride_o, c_stride_h,                    # cache: (blocks, block_size, kv_heads, D)
    block_size, kv_heads, head_dim,
    BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr,
):
    # One program per new token: it copies that token's (kv_heads, head_dim) tile of K and V.
    t = tl.program_id(0).to(tl.int64)
    slot = tl.load(slot_mapping_ptr + t).to(tl.int64)
    if slot < 0:   # a padding token (e.g. a CUDA-graph batch padded to a captured size)
        return
    block, offset = slot // block_size, slot % block_size
    h = tl.arange(0, BLOCK_H).to(tl.int64)[:, None]
    d = tl.arange(0, BLOCK_D).to(tl.int64)[None, :]
    mask = (h < kv_heads) & (d < head_dim)
    dst = block * c_stride_b + offset * c_stride_o + h * c_stride_h + d
    k = tl.load(k_ptr + t * k_stride_t + h * k_stride_h + d, mask=mask)
    v = tl.load(v_ptr + t * v_stride_t + h * v_stride_h + d, mask=mask)
    tl.store(k_cache_ptr + dst, k, mask=mask)
    tl.store(v_cache_ptr + dst, v, mask=mask)


def store_kvcache(k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                  slot_mapping: torch.Tensor) -> None:
    """Write k[i], v[i] (num_tokens, kv_heads, head_dim) to slot slot_mapping[i]; -1 is skipped."""
    num_tokens, kv_heads, head_dim = k.shape
    if num_tokens == 0:
        return
    # The kernel indexes head_dim with stride 1 (true for every view nanopaged makes).
    assert k.stride(2) == v.stride(2) == k_cache.stride(3) == 1
    assert k_cache.stride() == v_cache.stride()
    _store_kvcache_kernel[(num_tokens,)](
        k, v, k_cache, v_cache, slot_mapping,
        k.stride(0), k.stride(1), v.stride(0), v.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        k_cache.shape[1], kv_heads, head_dim,
        BLOCK_H=_pow2(kv_heads), BLOCK_D=_pow2(head_dim))


# ---- gather: blocks -> contiguous varlen K/V ------------------------------------------------
@triton.jit
def _gather_kvcache_kernel(
    k_cache_ptr, v_cache_ptr, k_out_ptr, v_out_ptr,
    block_tables_ptr, seq_lens_ptr, cu_seqlens_k_ptr,
    c_stride_b, c_stride_o, c_stride_h, o_stride_t, o_stride_h, bt_stride,
    head_dim,
    BLOCK_SIZE: tl.constexpr, BLOCK_D: tl.constexpr,
):
    # One program per (logical block, request, kv head): copy that block's tokens for one head.
    # The block index comes first: grid axis 0 may be 2^31 - 1 long, axes 1 and 2 only 65,535.
    i, r, h = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    seq_len = tl.load(seq_lens_ptr + r)
    if i * BLOCK_SIZE >= seq_len:   # this request has fewer blocks than the longest one
        return
    # int64: a block id (int32 in flash-attn's tables) times a block's stride passes 2^31 in a large pool
    physical = tl.load(block_tables_ptr + r * bt_stride + i).to(tl.int64)
    pos = i * BLOCK_SIZE + tl.arange(0, BLOCK_SIZE).to(tl.int64)[:, None]   # positions in the request
    d = tl.arange(0, BLOCK_D).to(tl.int64)[None, :]
    mask = (pos < seq_len) & (d < head_dim)                      # the last block may be partial
    src = physical * c_stride_b + (pos % BLOCK_SIZE) * c_stride_o + h * c_stride_h + d
    dst = (tl.load(cu_seqlens_k_ptr + r) + pos) * o_stride_t + h * o_stride_h + d
    tl.store(k_out_ptr + dst, tl.load(k_cache_ptr + src, mask=mask), mask=mask)
    tl.store(v_out_ptr + dst, tl.load(v_cache_ptr + src, mask=mask), mask=mask)


def gather_kvcache(k_cache: torch.Tensor, v_cache: torch.Tensor, block_tables: torch.Tensor,
                   seq_lens: torch.Tensor, cu_seqlens_k: torch.Tensor,
                   max_seq_len: int | None = None, total_tokens: int | None = None,
                   ) -> tuple[torch.Tensor, torch.Tensor]:
    """Each request's first seq_len tokens, through its block table, as (total_tokens, kv_heads, D).

    Request r's keys land at rows cu_seqlens_k[r] : cu_seqlens_k[r + 1]. Pass max_seq_len and
    total_tokens when known (as Python ints) to save two device-to-host syncs.
    """
    _, block_size, kv_heads, head_dim = k_cache.shape
    assert k_cache.stride(3) == 1 and k_cache.stride() == v_cache.stride()
    if max_seq_len is None:
        max_seq_len = int(seq_lens.max())
    if total_tokens is None:
        total_tokens = int(cu_seqlens_k[-1])
    k = k_cache.new_empty(total_tokens, kv_heads, head_dim)
    v = v_cache.new_empty(total_tokens, kv_heads, head_dim)
    grid = (triton.cdiv(max_seq_len, block_size), seq_lens.shape[0], kv_heads)
    _check_grid(grid)
    _gather_kvcache_kernel[grid](
        k_cache, v_cache, k, v, block_tables, seq_lens, cu_seqlens_k,
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2), k.stride(0), k.stride(1),
        block_tables.stride(0), head_dim,
        BLOCK_SIZE=block_size, BLOCK_D=_pow2(head_dim))
    return k, v


# ---- paged attention: the kernel of the paper ----------------------------------------------
# Kwon et al. 2023, section 4.1: the PagedAttention kernel fetches a request's KV blocks one by
# one, wherever they sit in the pool. Here each iteration of the inner loop fetches one tile of
# keys through the block table and folds it into a running softmax, so a request's K/V is never
# copied out of the pool. vLLM's Triton version: vllm/attention/ops/triton_unified_attention.py.
@triton.jit
def _paged_attention_kernel(
    q_ptr, k_cache_ptr, v_cache_ptr, out_ptr,
    query_start_loc_ptr, seq_lens_ptr, block_tables_ptr,
    q_stride_t, q_stride_h, o_stride_t, o_stride_h,
    c_stride_b, c_stride_o, c_stride_h, bt_stride,
    scale, block_size, head_dim,
    QUERIES_PER_KV: tl.constexpr,   # heads // kv_heads: the GQA group size
    BLOCK_Q: tl.constexpr,          # query tokens per program
    BLOCK_M: tl.constexpr,          # rows per program: BLOCK_Q tokens x QUERIES_PER_KV heads, padded
    BLOCK_N: tl.constexpr,          # keys per iteration of the inner loop
    BLOCK_D: tl.constexpr,          # head_dim, padded to a power of two
    DOT_PRECISION: tl.constexpr,
):
    # Grid: (block of the request's new query tokens, request, kv head). The query blocks come
    # first: grid axis 0 may be 2^31 - 1 long, axes 1 and 2 only 65,535.
    qb, r, kv_h = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    q_start = tl.load(query_start_loc_ptr + r)
    query_len = tl.load(query_start_loc_ptr + r + 1) - q_start
    seq_len = tl.load(seq_lens_ptr + r)
    if qb * BLOCK_Q >= query_len:   # grid sized for the longest request; a decode row needs one
        return
    # The new tokens are the *last* query_len of the request's seq_len tokens: everything before
    # them (earlier prompt chunks, generated tokens, prefix-cache hits) is already in the pool.
    context_len = seq_len - query_len

    # GQA by grouping: the QUERIES_PER_KV query heads that share kv head kv_h are stacked as
    # rows of one tile, so each K/V block is loaded once for the whole group. Row m is query
    # token qb * BLOCK_Q + m // QUERIES_PER_KV, query head kv_h * QUERIES_PER_KV + m % ...,
    # the same head -> kv-head map as Hugging Face's repeat_kv.
    m = tl.arange(0, BLOCK_M).to(tl.int64)
    q_idx = qb * BLOCK_Q + m // QUERIES_PER_KV
    head = kv_h * QUERIES_PER_KV + m % QUERIES_PER_KV
    row_ok = (m < BLOCK_Q * QUERIES_PER_KV) & (q_idx < query_len)
    q_pos = context_len + q_idx                      # each row's position in its sequence
    d = tl.arange(0, BLOCK_D).to(tl.int64)
    d_ok = d < head_dim
    q_off = (q_start + q_idx)[:, None] * q_stride_t + head[:, None] * q_stride_h + d[None, :]
    q = tl.load(q_ptr + q_off, mask=row_ok[:, None] & d_ok[None, :], other=0.0)

    # Online softmax (FlashAttention; Milakov & Gimelshein 2018): keep per row the running
    # max m_i, the running sum l_i of exp(score - m_i) and the unnormalised output acc, and
    # rescale them whenever a later block raises the max. One pass over K/V, no score matrix.
    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)

    # Causal: the last row of this tile sees keys up to its own position; later keys are
    # never loaded. For a decode row that is the whole context.
    kv_end = tl.minimum(seq_len, context_len + (qb + 1) * BLOCK_Q)
    for start in range(0, kv_end, BLOCK_N):
        # The paper's block table lookup: logical position -> (physical block, offset).
        k_pos = start + tl.arange(0, BLOCK_N).to(tl.int64)
        k_ok = k_pos < kv_end
        physical = tl.load(block_tables_ptr + r * bt_stride + k_pos // block_size, mask=k_ok, other=0).to(tl.int64)
        kv_off = (physical * c_stride_b + (k_pos % block_size) * c_stride_o
                  + kv_h * c_stride_h)[:, None] + d[None, :]
        kv_mask = k_ok[:, None] & d_ok[None, :]
        k = tl.load(k_cache_ptr + kv_off, mask=kv_mask, other=0.0)
        v = tl.load(v_cache_ptr + kv_off, mask=kv_mask, other=0.0)

        s = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION) * scale   # (BLOCK_M, BLOCK_N)
        # Row at position p sees keys 0..p: its prefix context plus the new tokens up to itself.
        visible = row_ok[:, None] & k_ok[None, :] & (k_pos[None, :] <= q_pos[:, None])
        s = tl.where(visible, s, float("-inf"))

        m_new = tl.maximum(m_i, tl.max(s, axis=1))
        # A row with nothing visible yet (a padding row) keeps m = -inf; subtracting 0 instead
        # keeps exp() at 0 rather than NaN from -inf - -inf.
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        p = tl.exp(s - m_safe[:, None])
        alpha = tl.exp(m_i - m_safe)                 # how much the old max overstated the scale
        l_i = l_i * alpha + tl.sum(p, axis=1)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=DOT_PRECISION)
        m_i = m_new

    acc = acc / tl.where(l_i == 0.0, 1.0, l_i)[:, None]
    o_off = (q_start + q_idx)[:, None] * o_stride_t + head[:, None] * o_stride_h + d[None, :]
    tl.store(out_ptr + o_off, acc.to(out_ptr.dtype.element_ty), mask=row_ok[:, None] & d_ok[None, :])


def paged_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                    meta: AttentionMetadata, scale: float) -> torch.Tensor:
    """Causal attention of q (num_tokens, heads, head_dim) over each request's pooled K/V.

    Works for any mix of decode rows (query_len 1) and prefill chunks (query_len > 1, possibly
    after earlier chunks or prefix-cache hits) in one launch; returns a tensor shaped like q.
    """
    num_tokens, heads, head_dim = q.shape
    _, block_size, kv_heads, _ = k_cache.shape
    assert q.stride(2) == 1 and k_cache.stride(3) == 1 and k_cache.stride() == v_cache.stride()
    out = torch.empty_like(q)
    if num_tokens == 0:
        return out
    queries_per_kv = heads // kv_heads
    # At least 16 rows (tl.dot's minimum tile on GPUs): several query tokens of one GQA group.
    block_m = _pow2(queries_per_kv, at_least=16)
    block_q = block_m // queries_per_kv
    # One physical block per iteration where that fits: >= 16 keys for tl.dot, <= 64 for registers.
    block_n = min(64, _pow2(block_size, at_least=16))
    grid = (triton.cdiv(max(meta.query_lens_list), block_q), meta.num_reqs, kv_heads)
    _check_grid(grid)
    _paged_attention_kernel[grid](
        q, k_cache, v_cache, out, meta.query_start_loc, meta.seq_lens, meta.block_tables,
        q.stride(0), q.stride(1), out.stride(0), out.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2), meta.block_tables.stride(0),
        scale, block_size, head_dim,
        QUERIES_PER_KV=queries_per_kv, BLOCK_Q=block_q, BLOCK_M=block_m, BLOCK_N=block_n,
        BLOCK_D=_pow2(head_dim, at_least=16),
        # fp32 in, fp32 math: no TF32 on Ampere+, so float32 output matches the torch backend.
        DOT_PRECISION="ieee")
    return out
