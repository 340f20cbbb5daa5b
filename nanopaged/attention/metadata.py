"""AttentionMetadata: one step's slot mapping, block tables and lengths, read by every backend.

Built by the model runner (`prepare_inputs`); docs/05_model_runner_and_kernels.md.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class AttentionMetadata:
    """Where every token's K/V lives, built once per step by the runner and passed down explicitly to every
    layer (no global context). The batch is "varlen": request i owns rows query_start_loc[i] : query_start_loc[i + 1]."""
    slot_mapping: torch.Tensor     # (num_tokens,) where token t's K/V goes: block_id * block_size + offset
    query_start_loc: torch.Tensor  # (num_reqs + 1,) cu_seqlens_q: prefix sums of the new-token counts
    seq_lens: torch.Tensor         # (num_reqs,) context length after this step: computed + new tokens
    block_tables: torch.Tensor     # (num_reqs, max_blocks) physical block ids, padded with 0
    query_lens_list: list[int]     # the same lengths as Python ints: slicing needs no device sync
    seq_lens_list: list[int]
    block_size: int
    share_prefixes: bool = True    # cpu backend: rows whose tables begin alike read those blocks once (same result)
    plan: object | None = None     # the torch backend's StepPlan, made at the step's first layer
    state_pages: list[list[int]] | None = None   # a hybrid model: each request's state page per linear group
    has_state: list[bool] | None = None          # ... whether that state holds earlier tokens (else it starts at 0)
    snapshots: list[list[tuple[int, list[int]]]] | None = None   # ... (rows, pages): keep the state after that
                                                  # many of its rows in those pages (prefix caching)

    @property
    def num_reqs(self) -> int:
        return len(self.query_lens_list)
