"""The block pool: the KV cache cut into fixed-size blocks (PagedAttention paper, section 4.1).

At start-up the runner preallocates one KV tensor for all layers and cuts it into
`num_blocks` physical blocks of `block_size` token slots each. This file owns only the
bookkeeping of those blocks, never their contents, and imports no torch:

- `Block`: an id and a `ref_count` (how many block tables point at it).
- `free_block_queue`: a deque of the ids of free blocks. Allocation takes from the head,
  freeing appends to the tail, so the queue's order is also the eviction order once the
  prefix cache keeps freed blocks' contents around (vLLM: v1/core/block_pool.py).

A request asks for a new block only when its last block is full (`blocks_needed`), so it
never holds more than one partly filled block: the waste is below one block per request
by construction, instead of the reservation for `max_model_len` that earlier systems made.
"""
from __future__ import annotations

from collections import deque
from dataclasses import dataclass


def cdiv(a: int, b: int) -> int:
    """Ceiling division: how many blocks of size b hold a tokens."""
    return -(-a // b)


@dataclass(slots=True)
class Block:
    block_id: int
    ref_count: int = 0   # block tables that hold this block; 0 = free


class BlockPool:
    def __init__(self, num_blocks: int, block_size: int) -> None:
        if num_blocks < 1:
            raise ValueError(f"num_blocks must be >= 1, got {num_blocks}")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.blocks = [Block(i) for i in range(num_blocks)]
        self.free_block_queue: deque[int] = deque(range(num_blocks))

    @property
    def num_free_blocks(self) -> int:
        return len(self.free_block_queue)

    def usage(self) -> float:
        """Fraction of blocks in use (vLLM's kv_cache_usage = 1 - free / total)."""
        return 1.0 - self.num_free_blocks / self.num_blocks

    def blocks_needed(self, num_held: int, num_tokens: int) -> int:
        """New blocks a block table of `num_held` blocks needs to hold `num_tokens` tokens."""
        return max(0, cdiv(num_tokens, self.block_size) - num_held)

    def allocate(self, n: int) -> list[int]:
        """Take n blocks from the head of the free queue, each with ref_count 1."""
        if n > len(self.free_block_queue):
            raise RuntimeError(f"asked for {n} blocks, only {len(self.free_block_queue)} free")
        ids = [self.free_block_queue.popleft() for _ in range(n)]
        for i in ids:
            block = self.blocks[i]
            assert block.ref_count == 0, f"block {i} in the free queue has ref_count {block.ref_count}"
            block.ref_count = 1
        return ids

    def free(self, block_ids: list[int]) -> None:
        """Drop one reference to each block; a block that reaches 0 joins the free queue.

        NOTE: blocks are freed in reverse order, so a request's tail blocks enter the
        queue (and will be evicted) before its head blocks: the head of a prompt is the
        part most likely to be shared by the next request (vLLM: free_blocks).
        """
        for i in reversed(block_ids):
            block = self.blocks[i]
            assert block.ref_count > 0, f"freeing block {i} that is already free"
            block.ref_count -= 1
            if block.ref_count == 0:
                self.free_block_queue.append(i)

    def check_invariants(self) -> None:
        """Every block is either free (ref 0, in the queue once) or held (ref > 0, not queued)."""
        queued = set(self.free_block_queue)
        assert len(queued) == len(self.free_block_queue), "a block is in the free queue twice"
        for block in self.blocks:
            if block.block_id in queued:
                assert block.ref_count == 0, f"free block {block.block_id} has ref_count {block.ref_count}"
            else:
                assert block.ref_count > 0, f"block {block.block_id} is neither free nor held"
