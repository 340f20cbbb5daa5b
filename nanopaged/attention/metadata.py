"""AttentionMetadata: everything a layer's attention needs to find its K/V in the pool.

Built once per step by the model runner and passed down explicitly through the model to
every attention layer (no global "context" object, unlike nano-vllm). The batch is
"varlen": the new tokens of all scheduled requests are concatenated into one flat batch of
`num_tokens` rows; request i owns rows query_start_loc[i] : query_start_loc[i + 1].
"""
from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class AttentionMetadata:
    # per token (num_tokens,)
    slot_mapping: torch.Tensor     # where token t's K/V goes: block_id * block_size + offset
    # per request (num_reqs,) / (num_reqs + 1,)
    query_start_loc: torch.Tensor  # cu_seqlens_q: prefix sums of the new-token counts
    seq_lens: torch.Tensor         # context length after this step: computed + new tokens
    block_tables: torch.Tensor     # (num_reqs, max_blocks) physical block ids, padded with 0
    # the same numbers as Python ints, so the torch backend can slice without a device sync
    query_lens_list: list[int]
    seq_lens_list: list[int]
    block_size: int

    @property
    def num_reqs(self) -> int:
        return len(self.query_lens_list)
