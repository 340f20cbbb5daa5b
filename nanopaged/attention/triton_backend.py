"""The `triton` attention backend: Triton store + one Triton paged-attention kernel.

The same two jobs as the torch reference (core/attention.py), but attention reads K/V
straight out of the pool through the block tables instead of gathering them first, and one
launch covers the whole mixed batch of decode rows and (chunked) prefill rows. The kernels
are in triton_kernels.py. Runs on CUDA, and on CPU tensors under TRITON_INTERPRET=1 (tests).
On CUDA its kernels take every size from device tensors, so decode steps can be replayed
from CUDA graphs: `wrap_model` installs them (cuda_graphs.py) unless enforce_eager.
docs/05_model_runner_and_kernels.md explains the kernel.
"""
from __future__ import annotations

import torch

from nanopaged.attention.metadata import AttentionMetadata
from nanopaged.core.block_pool import cdiv
from nanopaged.attention.triton_kernels import paged_attention, store_kvcache


class TritonAttentionBackend:
    name = "triton"

    def wrap_model(self, model, runner):
        """CUDA graphs for decode steps on CUDA, unless enforce_eager; else the model as it is."""
        cfg = runner.config
        if runner.device.type != "cuda" or cfg.enforce_eager:
            return model
        from nanopaged.attention.cuda_graphs import CUDAGraphModel
        return CUDAGraphModel(model, runner.kv_cache, runner.block_size, cfg.max_num_seqs,
                              cdiv(cfg.max_model_len, runner.block_size))

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                k_cache: torch.Tensor, v_cache: torch.Tensor,
                meta: AttentionMetadata, scale: float) -> torch.Tensor:
        """q: (num_tokens, heads, head_dim); k, v: (num_tokens, kv_heads, head_dim)."""
        store_kvcache(k, v, k_cache, v_cache, meta.slot_mapping)
        return paged_attention(q, k_cache, v_cache, meta, scale)
