"""The `cpu` attention backend: every row of a step attends straight from the paged cache, in C++.

The torch reference gathers each decode row's blocks into a padded copy before it can call
`scaled_dot_product_attention`, and calls it once per prompt: per layer it writes the K/V it
reads, reads the copy again, pads every row to the longest, and pays SDPA's fixed cost per
request. This backend reads K/V once, through the block table, as the paper's kernel does
(section 4.1), in one call per layer for the whole step (`paged_attention` in
nanopaged/cpu/csrc/attention.cpp, vLLM's unified attention): row j of a request's q_len new rows
sees the first seq_len - q_len + j + 1 keys, so prompt chunks, prefix-cache hits and decode rows
are one loop. Each row (in a step of a few rows, each (row, KV head) pair; rows sharing their first
blocks together, read once: csrc/attention_jobs.h) is a job for torch's threads: scores of each
query head against each key, a softmax, then the values, block by block through the block table. Inside each block the kernels keep K and V in an order of
their own (csrc/kv_layout.h: KvLayout; vLLM's CPU and CUDA kernels do too), so the store is
theirs as well (`store_kv`, csrc/rotary_kv.cpp; the fused layers store in their rotary pass
instead), and the torch backend cannot read a cache this one wrote: one engine, one backend.
tests/cpu/test_cpu_ops.py holds the kernel to the reference; without a compiler,
`nanopaged/cpu/choose.py` says so and `auto` runs the torch backend.
docs/05_model_runner_and_kernels.md, "Backends".
"""
from __future__ import annotations

import torch

from nanopaged.attention.metadata import AttentionMetadata
from nanopaged.cpu.build import cpu_ops


class CpuAttentionBackend:
    """The AttentionBackend interface (attention/backends.py): a C++ store in the kernels' order,
    then one C++ call per layer for every row of the step."""
    name = "cpu"

    def __init__(self) -> None:
        self.ops = cpu_ops()

    def wrap_model(self, model, runner):
        return model                        # launched eagerly, layer by layer

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                k_cache: torch.Tensor, v_cache: torch.Tensor,
                meta: AttentionMetadata, scale: float) -> torch.Tensor:
        self.ops.store_kv(k, v, k_cache, v_cache, meta.slot_mapping)      # the kernels' order within a block
        return self.attend(q, k, v, k_cache, v_cache, meta, scale)

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
               k_cache: torch.Tensor, v_cache: torch.Tensor,
               meta: AttentionMetadata, scale: float) -> torch.Tensor:
        """Attention alone, the step's K/V already stored (as the torch backend's `attend`); k and v
        are not read: every row reads its keys, its own included, from the pool."""
        return self.ops.paged_attention(q, k_cache, v_cache, meta.block_tables, meta.seq_lens, meta.query_start_loc,
                                        scale, meta.share_prefixes)
