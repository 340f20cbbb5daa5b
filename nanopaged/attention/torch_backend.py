"""The torch reference attention backend: store K/V by slot mapping, attend through block tables.

Every attention layer does two jobs, exactly as in the paper (section 4.1):
1. store: write the new tokens' K and V into their slots of the pool (`slot_mapping`);
2. attend: each new query attends over its request's K/V, found block by block through
   its block table. Request i's new tokens are the *last* query_len of its seq_len tokens,
   so its new row j sits at position seq_len - query_len + j and sees keys 0 .. that
   position: earlier prompt chunks, generated tokens and prefix-cache hits included.

This backend, plain PyTorch on any device, is the reference every other backend is tested
against; the Triton and flash-attn backends beside it are chosen through
`nanopaged/attention/backends.py: ATTENTION_BACKENDS`. docs/05_model_runner_and_kernels.md.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from nanopaged.attention.metadata import AttentionMetadata
from nanopaged.core.block_pool import cdiv


# A decode group of rows costs a fixed time per layer (two gathers and one SDPA call) plus a time
# per (row, block) of padded K/V: padding a group's rows to a longer one's blocks pays only while it
# adds fewer (row, block) pairs than another group would cost, this many (docs/05, "torch").
GROUP_COST_IN_BLOCKS = 30


@dataclass
class DecodeGroup:
    """One-token requests attended in one padded call: their rows, block tables and mask."""
    rows: torch.Tensor          # (B,) the flat-batch row of each
    blocks: torch.Tensor | None  # (B * max_blocks,) their block tables, padded, flattened
    mask: torch.Tensor          # (B, 1, 1, L) 0 inside the request, -inf past it
    slots: tuple[torch.Tensor, torch.Tensor] | None = None   # or (block, offset) of each of the L keys, (B, L)


@dataclass
class StepPlan:
    """How the torch backend splits a step, worked out once and shared by every layer: the
    index tensors and the masks depend on the step, not on the layer."""
    prefills: list[tuple[int, int, int, int]]  # (request, first row, query_len, seq_len), query_len > 1
    decodes: list[DecodeGroup]                 # the one-token requests, grouped by length
    all_rows_in_order: bool = False            # one decode group holding every row of the step, in order


def plan_step(meta: AttentionMetadata, dtype: torch.dtype) -> StepPlan:
    """Sort the step's requests into prefill chunks and one-token rows; group the latter by
    length (so a short request is not padded to the longest) and index each group once."""
    prefills, decodes, start = [], [], 0
    for i, (q_len, seq_len) in enumerate(zip(meta.query_lens_list, meta.seq_lens_list)):
        if q_len == 1:
            decodes.append(i)
        else:
            prefills.append((i, start, q_len, seq_len))
        start += q_len
    groups = [_decode_group(meta, g, dtype) for g in _by_length(meta, decodes)]
    return StepPlan(prefills, groups, not prefills and len(groups) == 1)


def _by_length(meta: AttentionMetadata, decodes: list[int]) -> list[list[int]]:
    """The decode requests in groups of similar length: shortest first, a group grows while
    padding its rows to the next one's blocks is cheaper than starting another group. A single
    group keeps the step's order."""
    blocks = {i: cdiv(meta.seq_lens_list[i], meta.block_size) for i in decodes}
    groups, longest = [], 0
    for i in sorted(decodes, key=blocks.get):
        if groups and len(groups[-1]) * (blocks[i] - longest) <= GROUP_COST_IN_BLOCKS:
            groups[-1].append(i)
        else:
            groups.append([i])
        longest = blocks[i]
    return [decodes] if len(groups) == 1 else groups


def _decode_group(meta: AttentionMetadata, requests: list[int], dtype: torch.dtype) -> DecodeGroup:
    device, bs = meta.slot_mapping.device, meta.block_size
    idx = torch.tensor(requests, device=device)
    longest = max(meta.seq_lens_list[i] for i in requests)
    max_blocks = cdiv(longest, bs)
    # whole blocks where they are mostly full; where blocks are large (a hybrid's pages), only the slots in use
    by_slot = max_blocks * bs > 2 * longest
    key_pos = torch.arange(longest if by_slot else max_blocks * bs, device=device)
    outside = key_pos[None, :] >= meta.seq_lens[idx][:, None]
    # an additive mask (0 or -inf, in the queries' dtype): SDPA on CPU takes it faster than a
    # bool one, with the same result
    mask = torch.zeros(outside.shape, dtype=dtype, device=device).masked_fill_(outside, float("-inf"))
    tables = meta.block_tables[idx, :max_blocks]
    if by_slot:
        slots = (tables[:, key_pos // bs], (key_pos % bs).expand(len(requests), -1))
        return DecodeGroup(meta.query_start_loc[idx], None, mask[:, None, None, :], slots)
    return DecodeGroup(meta.query_start_loc[idx], tables.flatten(), mask[:, None, None, :])


def store_kvcache(k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                  slot_mapping: torch.Tensor) -> None:
    """k, v: (num_tokens, kv_heads, head_dim); caches: (num_blocks, block_size, kv_heads, head_dim), each
    block's slots contiguous (a hybrid's pages put K and V of a block side by side: not one run of slots)."""
    block, offset = slot_mapping // k_cache.shape[1], slot_mapping % k_cache.shape[1]
    k_cache[block, offset] = to_cache_dtype(k, k_cache.dtype)
    v_cache[block, offset] = to_cache_dtype(v, v_cache.dtype)


def to_cache_dtype(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """x as an 8-bit cache keeps it (docs/01, "An 8-bit KV cache"): fp8 saturated at its largest finite value
    (k_scale = 1, as vLLM), rounded to nearest even; int8 codes round(x / s), s = absmax / 127, then s's 4 bytes."""
    if x.dtype == dtype:
        return x
    if dtype != torch.int8:
        return x.clamp(-torch.finfo(dtype).max, torch.finfo(dtype).max).to(dtype)
    s = x.float().abs().amax(-1, keepdim=True) / 127
    codes = torch.where(s > 0, x.float() / s, 0).round().to(torch.int8)
    return torch.cat([codes, s.view(torch.int8)], dim=-1)


def from_cache_dtype(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """What to_cache_dtype stored, as `dtype`."""
    if x.dtype != torch.int8:
        return x.to(dtype)
    return (x[..., :-4] * x[..., -4:].contiguous().view(torch.float32)).to(dtype)


def gather_kv(cache: torch.Tensor, block_table: torch.Tensor, seq_len: int) -> torch.Tensor:
    """The first seq_len tokens of one request, (seq_len, kv_heads, head_dim), via its block table."""
    num_blocks = cdiv(seq_len, cache.shape[1])
    return cache.index_select(0, block_table[:num_blocks]).flatten(0, 1)[:seq_len]


class TorchAttentionBackend:
    """Decode rows (query_len 1) are attended together in one padded call; each request
    with several new tokens (a prompt, or a chunk of one) gets its own call."""
    name = "torch"

    def wrap_model(self, model, runner):
        return model                        # launched eagerly, layer by layer

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                k_cache: torch.Tensor, v_cache: torch.Tensor,
                meta: AttentionMetadata, scale: float) -> torch.Tensor:
        """q: (num_tokens, heads, head_dim); k, v: (num_tokens, kv_heads, head_dim)."""
        store_kvcache(k, v, k_cache, v_cache, meta.slot_mapping)
        return self.attend(q, k, v, k_cache, v_cache, meta, scale)

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
               k_cache: torch.Tensor, v_cache: torch.Tensor,
               meta: AttentionMetadata, scale: float) -> torch.Tensor:
        """The second job alone, the step's K/V already in the pool."""
        if meta.plan is None:
            meta.plan = plan_step(meta, q.dtype)
        plan = meta.plan
        if plan.all_rows_in_order:      # a decode-only step in one group: no rows to pick or place
            return self._decode(q, k_cache, v_cache, plan.decodes[0], scale)
        out = torch.empty_like(q)
        for i, start, q_len, seq_len in plan.prefills:
            rows = slice(start, start + q_len)
            if seq_len == q_len and k_cache.dtype == k.dtype:   # nothing earlier: its own new K/V is all of it
                kk, vv = k[rows], v[rows]
            else:                       # a later chunk, a prefix-cache hit, or 8-bit K/V: read the blocks
                kk = from_cache_dtype(gather_kv(k_cache, meta.block_tables[i], seq_len), q.dtype)
                vv = from_cache_dtype(gather_kv(v_cache, meta.block_tables[i], seq_len), q.dtype)
            out[rows] = _attend(q[rows], kk, vv, seq_len - q_len, scale)
        for group in plan.decodes:
            out[group.rows] = self._decode(q[group.rows], k_cache, v_cache, group, scale)
        return out

    def _decode(self, q, k_cache, v_cache, group: DecodeGroup, scale) -> torch.Tensor:
        """One group of one-token requests at once, q: (B, heads, head_dim): gather their blocks
        padded to the group's longest."""
        mask = group.mask
        if group.slots is not None:
            kk, vv = from_cache_dtype(k_cache[group.slots], q.dtype), from_cache_dtype(v_cache[group.slots], q.dtype)
        else:   # index_select on the block axis: several times faster on CPU than cache[tables]
            shape = (q.shape[0], mask.shape[-1]) + k_cache.shape[2:]
            kk = from_cache_dtype(k_cache.index_select(0, group.blocks).view(shape), q.dtype)  # (B, L, kv_heads, D)
            vv = from_cache_dtype(v_cache.index_select(0, group.blocks).view(shape), q.dtype)
        # GQA: the query heads that share a KV head become that head's queries, (B, kv_heads,
        # group, D), so K/V are read as they are, never repeated per query head.
        qq = q.view(q.shape[0], kk.shape[2], -1, q.shape[-1])
        o = F.scaled_dot_product_attention(qq, kk.transpose(1, 2), vv.transpose(1, 2), attn_mask=mask, scale=scale)
        return o.flatten(1, 2)


def _attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, num_context: int,
            scale: float) -> torch.Tensor:
    """Causal attention of q (q_len rows) over k/v (num_context + q_len rows), GQA aware."""
    q_len = q.shape[0]
    # (1, heads, len, head_dim): with a batch axis SDPA on CPU takes its fused (flash) kernel,
    # GQA included; without one it falls back to the unfused math path, twice as slow.
    qt, kt, vt = q.transpose(0, 1)[None], k.transpose(0, 1)[None], v.transpose(0, 1)[None]
    if num_context == 0:
        o = F.scaled_dot_product_attention(qt, kt, vt, is_causal=True, scale=scale, enable_gqa=True)
    else:
        # is_causal aligns the mask top-left; with a prefix context the queries are the last
        # q_len positions, so build the mask explicitly.
        q_pos = torch.arange(q_len, device=q.device) + num_context
        k_pos = torch.arange(k.shape[0], device=q.device)
        mask = k_pos[None, :] <= q_pos[:, None]
        o = F.scaled_dot_product_attention(qt, kt, vt, attn_mask=mask, scale=scale, enable_gqa=True)
    return o[0].transpose(0, 1)
