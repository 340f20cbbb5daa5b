"""The `flash` attention backend: Triton store, then flash-attn's CUDA kernels.

The calls follow flash-attn 2's documented signatures (flash_attn/flash_attn_interface.py,
v2.6-2.8); tests/test_gpu.py compares it with the torch backend on a GPU (the README's
status section says where that has run).

Upstream flash-attn reads a paged cache (its `block_table=` argument) only when the block
size is a multiple of 256 ("Paged KV cache block size must be divisible by 256" in
flash_api.cpp; vLLM's own fork relaxes this to 16). So:
  block_size % 256 == 0: batches with prefill -> flash_attn_varlen_func(block_table=...),
                         decode-only batches -> flash_attn_with_kvcache(block_table=...);
  smaller blocks:        gather each request's K/V into a contiguous varlen tensor with the
                         Triton gather kernel, then flash_attn_varlen_func on it.
flash-attn's causal mask is aligned bottom-right (query j of a request sees keys up to
seq_len - query_len + j), which is exactly the rule for chunked prefill with prefix context.
"""
from __future__ import annotations

import torch

from nanopaged.attention.metadata import AttentionMetadata
from nanopaged.attention.triton_kernels import gather_kvcache, store_kvcache

FLASH_PAGE_MULTIPLE = 256   # upstream flash-attn's paged-KV requirement


class FlashAttentionBackend:
    name = "flash"

    def __init__(self) -> None:
        # Imported here, not at module top: nanopaged must import without flash-attn.
        from flash_attn import flash_attn_varlen_func, flash_attn_with_kvcache
        self._varlen = flash_attn_varlen_func
        self._with_kvcache = flash_attn_with_kvcache

    def wrap_model(self, model, runner):
        return model      # no CUDA graphs: the gather path sizes its output on the host

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                k_cache: torch.Tensor, v_cache: torch.Tensor,
                meta: AttentionMetadata, scale: float) -> torch.Tensor:
        """q: (num_tokens, heads, head_dim); k, v: (num_tokens, kv_heads, head_dim)."""
        store_kvcache(k, v, k_cache, v_cache, meta.slot_mapping)
        # flash-attn wants int32 index tensors.
        seq_lens = meta.seq_lens.to(torch.int32)
        block_tables = meta.block_tables.to(torch.int32)
        paged = meta.block_size % FLASH_PAGE_MULTIPLE == 0
        if paged and max(meta.query_lens_list) == 1:
            out = self._with_kvcache(q.unsqueeze(1), k_cache, v_cache, cache_seqlens=seq_lens,
                                     block_table=block_tables, softmax_scale=scale, causal=True)
            return out.squeeze(1)
        cu_seqlens_q = meta.query_start_loc.to(torch.int32)
        cu_seqlens_k = torch.nn.functional.pad(seq_lens.cumsum(0, dtype=torch.int32), (1, 0))
        max_q, max_k = max(meta.query_lens_list), max(meta.seq_lens_list)
        if paged:
            kk, vv, table = k_cache, v_cache, block_tables
        else:
            kk, vv = gather_kvcache(k_cache, v_cache, block_tables, seq_lens, cu_seqlens_k,
                                    max_seq_len=max_k, total_tokens=sum(meta.seq_lens_list))
            table = None
        return self._varlen(q, kk, vv, cu_seqlens_q, cu_seqlens_k, max_q, max_k,
                            softmax_scale=scale, causal=True, block_table=table)
