"""A packed token bitmask applied to a step's logits: -inf wherever the grammar forbids the token.

The bitmask packs 32 tokens to an int32 (bit j of word w: token 32 * w + j may come next). Read as
bytes, each byte holds 8 tokens, and a byte has only 256 values: a table of 256 rows of 8 additive
masks (0.0 allowed, -inf forbidden) unpacks every byte of every constrained row in one lookup
(`F.embedding`), and one add applies it: faster than xgrammar's own `apply_token_bitmask_inplace` (a
loop over the bits; docs/10 has the figure), which the tests hold it equal to.
docs/10_structured_outputs.md, "One mask for the whole step".
"""
from __future__ import annotations

import sys

import torch
import torch.nn.functional as F

_TABLES: dict[torch.device, torch.Tensor] = {}


def byte_table(device: torch.device) -> torch.Tensor:
    """(256, 8) float32: row b, column j is 0.0 if bit j of byte b is set, else -inf."""
    table = _TABLES.get(device)
    if table is None:
        bits = (torch.arange(256)[:, None] >> torch.arange(8)[None, :]) & 1
        table = _TABLES[device] = torch.where(bits == 1, 0.0, float("-inf")).to(device)
    return table


def apply_token_bitmask(logits: torch.Tensor, bitmask: torch.Tensor, rows: list[int]) -> torch.Tensor:
    """New logits: row rows[i] of `logits` masked by row i of `bitmask`; the other rows as they were.

    logits: (num_rows, vocab) float32; bitmask: (len(rows), ceil(vocab / 32)) int32, on the CPU.
    """
    words = bitmask.to(logits.device)
    as_bytes = words.view(torch.uint8)                        # (k, 4 * words): 8 tokens a byte
    if sys.byteorder == "big":                                # bits 0-7 of a word are its last byte there
        as_bytes = as_bytes.view(-1, 4).flip(1).reshape(as_bytes.shape)
    bias = F.embedding(as_bytes.long(), byte_table(logits.device))     # (k, 4 * words, 8)
    bias = bias.view(len(rows), -1)[:, :logits.shape[1]]               # (k, vocab): 0.0 or -inf
    if rows == list(range(logits.shape[0])):
        return logits + bias
    return logits.index_add(0, torch.tensor(rows, device=logits.device), bias)
