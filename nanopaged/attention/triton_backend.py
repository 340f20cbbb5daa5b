"""The `triton` attention backend: Triton store + one Triton paged-attention kernel.

The same two jobs as the torch reference (torch_backend.py), but attention reads K/V
straight out of the pool through the block tables instead of gathering them first, and one
launch covers the whole mixed batch of decode rows and (chunked) prefill rows. The kernels
are in triton_kernels.py. Runs on CUDA, and on CPU tensors under TRITON_INTERPRET=1 (tests).
"""
from __future__ import annotations

import torch

from nanopaged.attention.metadata import AttentionMetadata
from nanopaged.attention.triton_kernels import paged_attention, store_kvcache


class TritonAttentionBackend:
    name = "triton"

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                k_cache: torch.Tensor, v_cache: torch.Tensor,
                meta: AttentionMetadata, scale: float) -> torch.Tensor:
        """q: (num_tokens, heads, head_dim); k, v: (num_tokens, kv_heads, head_dim)."""
        store_kvcache(k, v, k_cache, v_cache, meta.slot_mapping)
        return paged_attention(q, k_cache, v_cache, meta, scale)
