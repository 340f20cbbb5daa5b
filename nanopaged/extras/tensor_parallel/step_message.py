"""The step message: everything a rank needs to run one step, as one small int64 tensor.

The scheduler and the block pool live once, on the driver, so the workers know nothing of
requests: each step the driver sends them the runner's inputs (worker/model_runner.py:
`ModelRunner.prepare_inputs`), flattened, in two broadcasts (a fixed header with the
lengths, then the body):

    header   8 values: kind (STEP, STOP, or a pipeline's HEAD), T tokens, R requests,
             B blocks per table row, L logit rows, C block copies, 0, 0
    body     input_ids (T), positions (T), slot_mapping (T), query_lens (R), seq_lens (R),
             block_tables (R x B), logit_rows (L), copy-on-write pairs (2C)

so a step costs 8 x (8 + 3T + 2R + R B + L + 2C) bytes: a decode step of 32 requests with
128-token contexts (8 blocks of 16) sends 8 x (8 + 96 + 64 + 256 + 32) = 3,648 bytes.
Block ids are the same on every rank (one block table; docs/09_tensor_parallel.md), so the
tables go out as they are. vLLM V1 sends less: its workers keep each request's state and
receive only what changed (vllm/v1/core/sched/output.py, new vs cached requests).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from nanopaged.attention.metadata import AttentionMetadata

HEADER_LEN = 8
STOP, STEP = 0, 1
HEAD = 2     # a pipeline's: the rows whose logits the first stage's ranks compute (extras/pipeline_parallel/)


@dataclass
class StepInputs:
    """One step as every rank runs it."""
    input_ids: torch.Tensor          # (T,)
    positions: torch.Tensor          # (T,)
    meta: AttentionMetadata
    logit_rows: list[int]            # rows whose logits rank 0 wants: sampling rows, then prompt rows
    blocks_to_copy: list[tuple[int, int]]


def pack(input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata,
         logit_rows: list[int], blocks_to_copy: list[tuple[int, int]]) -> tuple[torch.Tensor, torch.Tensor]:
    """(header, body) on the CPU, ready to broadcast."""
    long = lambda x: torch.as_tensor(x, dtype=torch.long).flatten().cpu()   # noqa: E731
    tables = meta.block_tables
    body = torch.cat([long(input_ids), long(positions), long(meta.slot_mapping),
                      long(meta.query_lens_list), long(meta.seq_lens_list), long(tables),
                      long(logit_rows), long(blocks_to_copy)])
    header = long([STEP, input_ids.numel(), meta.num_reqs, tables.shape[1], len(logit_rows),
                   len(blocks_to_copy), 0, 0])
    return header, body


def stop_header() -> torch.Tensor:
    return torch.tensor([STOP] + [0] * (HEADER_LEN - 1), dtype=torch.long)


def body_len(header: torch.Tensor) -> int:
    _, t, r, b, logit_rows, copies, _, _ = header.tolist()
    return 3 * t + 2 * r + r * b + logit_rows + 2 * copies


def unpack(header: torch.Tensor, body: torch.Tensor, block_size: int, device: torch.device) -> StepInputs:
    """The StepInputs a (header, body) pair describes, with the tensors on `device`."""
    _, t, r, b, num_logit_rows, copies, _, _ = header.tolist()
    ids, pos, slots, query_lens, seq_lens, tables, logit_rows, pairs = body.split(
        [t, t, t, r, r, r * b, num_logit_rows, 2 * copies])
    query_lens_list, seq_lens_list = query_lens.tolist(), seq_lens.tolist()
    cu = torch.zeros(r + 1, dtype=torch.long)
    torch.cumsum(query_lens, 0, out=cu[1:])
    to = lambda x: x.to(device)   # noqa: E731
    meta = AttentionMetadata(slot_mapping=to(slots), query_start_loc=to(cu), seq_lens=to(seq_lens),
                             block_tables=to(tables.view(r, b)), query_lens_list=query_lens_list,
                             seq_lens_list=seq_lens_list, block_size=block_size)
    copy_pairs = [tuple(p) for p in pairs.view(copies, 2).tolist()]
    return StepInputs(to(ids), to(pos), meta, logit_rows.tolist(), copy_pairs)


def message_bytes(header: torch.Tensor, body: torch.Tensor) -> int:
    """What one step sends each worker."""
    return (header.numel() + body.numel()) * 8
