"""The `cpu` attention backend: decode rows attend straight from the paged cache, in C++.

The torch reference gathers each decode row's blocks into a padded copy before it can call
`scaled_dot_product_attention`: per layer it writes the K/V it reads, reads the copy again, and
pads every row to the longest. At long contexts that copying is most of a decode step (a step
of 84 rows over contexts up to 1,024 tokens spent ~250 ms there, the weights ~20 ms). This
backend reads K/V once, through the block table, as the paper's kernel does (section 4.1):
one small C++ function (`paged_decode_attention` in nanopaged/kernels/cpu_ops.cpp), runs
every (request, KV head) pair in parallel over torch's threads: scores of the head's query
group against each key, a softmax, then the values. Prefill chunks, store and everything else
are the torch reference's (torch_backend.py), and tests/attention/test_cpu_backend.py holds the
kernel to it. Without a C++ compiler, `resolve_attention_backend` says so; `auto` then runs the
torch backend. docs/05_model_runner_and_kernels.md, "Backends".
"""
from __future__ import annotations

import torch

from nanopaged.attention.metadata import AttentionMetadata
from nanopaged.attention.torch_backend import TorchAttentionBackend, _attend, gather_kv, store_kvcache
from nanopaged.kernels.cpu_ops import cpu_ops


class CpuAttentionBackend(TorchAttentionBackend):
    """The torch reference, with its decode rows attended by the C++ kernel (no gather, no padding)."""
    name = "cpu"

    def __init__(self) -> None:
        self.op = cpu_ops().paged_decode_attention

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                k_cache: torch.Tensor, v_cache: torch.Tensor,
                meta: AttentionMetadata, scale: float) -> torch.Tensor:
        store_kvcache(k, v, k_cache, v_cache, meta.slot_mapping)
        return self.attend(q, k, v, k_cache, v_cache, meta, scale)

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
               k_cache: torch.Tensor, v_cache: torch.Tensor,
               meta: AttentionMetadata, scale: float) -> torch.Tensor:
        """Attention alone, the step's K/V already stored (the torch backend's `attend`)."""
        if max(meta.query_lens_list) == 1:               # a decode-only step: every row at once
            return self.op(q, k_cache, v_cache, meta.block_tables, meta.seq_lens, scale)
        out, start = torch.empty_like(q), 0
        decode_rows, decode_reqs = [], []
        for i, (q_len, seq_len) in enumerate(zip(meta.query_lens_list, meta.seq_lens_list)):
            rows = slice(start, start + q_len)
            if q_len == 1:
                decode_rows.append(start)
                decode_reqs.append(i)
            elif seq_len == q_len:
                out[rows] = _attend(q[rows], k[rows], v[rows], 0, scale)
            else:
                kk, vv = gather_kv(k_cache, meta.block_tables[i], seq_len), gather_kv(v_cache, meta.block_tables[i], seq_len)
                out[rows] = _attend(q[rows], kk, vv, seq_len - q_len, scale)
            start += q_len
        if decode_rows:
            idx = torch.tensor(decode_reqs, device=q.device)
            rows = torch.tensor(decode_rows, device=q.device)
            out[rows] = self.op(q[rows], k_cache, v_cache, meta.block_tables[idx], meta.seq_lens[idx], scale)
        return out
