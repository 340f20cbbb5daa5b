"""The block pool: the KV cache cut into fixed-size blocks (PagedAttention paper, section 4.1).

At start-up the runner preallocates one KV tensor for all layers and cuts it into
`num_blocks` physical blocks of `block_size` token slots each. This file owns only the
bookkeeping of those blocks, never their contents, and imports no torch:

- `Block`: an id and a `ref_count` (how many block tables point at it).
- `free_block_queue`: a deque of the ids of free blocks. Allocation takes from the head,
  freeing appends to the tail (vLLM: v1/core/block_pool.py).
- the prefix cache (prefix_cache.py names full blocks by chained hashes): a freed block
  keeps its hash and its K/V, and stays findable through `cached_block_hash_to_block`
  until allocation takes it from the head of the queue and reuses it. So the free
  queue's order *is* the LRU eviction order: there is no second structure to keep in sync.

A request asks for a new block only when its last block is full (`blocks_needed`), so it
never holds more than one partly filled block: the waste is below one block per request
by construction, instead of the reservation for `max_model_len` that earlier systems made.
"""
from __future__ import annotations

from collections import deque
from dataclasses import dataclass
from typing import Callable

from nanopaged.prefix_cache import CONFIRM_TOKENS, HASH_FUNCTIONS


def cdiv(a: int, b: int) -> int:
    """Ceiling division: how many blocks of size b hold a tokens."""
    return -(-a // b)


@dataclass(slots=True)
class Block:
    block_id: int
    ref_count: int = 0                    # block tables that hold this block; 0 = free
    block_hash: bytes | None = None       # set once the block is full and cached
    token_ids: tuple[int, ...] | None = None  # kept only to confirm hits of a 64-bit hash


class BlockPool:
    def __init__(self, num_blocks: int, block_size: int, enable_caching: bool = False,
                 prefix_hash: str = "sha256") -> None:
        if num_blocks < 1:
            raise ValueError(f"num_blocks must be >= 1, got {num_blocks}")
        if prefix_hash not in HASH_FUNCTIONS:
            raise ValueError(f"prefix_hash must be one of {sorted(HASH_FUNCTIONS)}, got {prefix_hash!r}")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.blocks = [Block(i) for i in range(num_blocks)]
        self.free_block_queue: deque[int] = deque(range(num_blocks))
        self.enable_caching = enable_caching
        self.hash_fn = HASH_FUNCTIONS[prefix_hash]
        self.confirm_tokens = CONFIRM_TOKENS[prefix_hash]
        self.cached_block_hash_to_block: dict[bytes, int] = {}
        self.num_evicted_blocks = 0       # cached blocks whose K/V were overwritten

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
            self._evict(block)
            block.ref_count = 1
        return ids

    def _evict(self, block: Block) -> None:
        """The block is about to be overwritten: it no longer holds its cached prefix."""
        if block.block_hash is None:
            return
        if self.cached_block_hash_to_block.get(block.block_hash) == block.block_id:
            del self.cached_block_hash_to_block[block.block_hash]
        block.block_hash = None
        block.token_ids = None
        self.num_evicted_blocks += 1

    # ---- prefix cache -----------------------------------------------------------------
    def find_cached_blocks(self, block_hashes: list[bytes], max_blocks: int,
                           token_ids: Callable[[int, int], list[int]]) -> list[int]:
        """The longest run of cached blocks from the start of a request; stops at the first miss."""
        hits = []
        bs = self.block_size
        for i, h in enumerate(block_hashes[:max_blocks]):
            block_id = self.cached_block_hash_to_block.get(h)
            if block_id is None:
                break
            if self.confirm_tokens and self.blocks[block_id].token_ids != tuple(token_ids(i * bs, (i + 1) * bs)):
                break                       # a 64-bit collision: not the same prefix after all
            hits.append(block_id)
        return hits

    def touch(self, block_ids: list[int]) -> None:
        """A request reuses these cached blocks: one more reference each; a free one leaves the queue.

        NOTE: deque.remove is O(free blocks). vLLM keeps the free queue as a doubly linked
        list to make this O(1); a plain deque keeps the idea visible at this engine's scale.
        """
        for i in block_ids:
            block = self.blocks[i]
            if block.ref_count == 0:
                self.free_block_queue.remove(i)
            block.ref_count += 1

    def cache_block(self, block_id: int, block_hash: bytes, token_ids: list[int]) -> None:
        """Name a block that just became full, so later requests can find it."""
        block = self.blocks[block_id]
        if block.block_hash is not None or block_hash in self.cached_block_hash_to_block:
            return     # already named, or another block holds the same prefix: keep that one
        block.block_hash = block_hash
        block.token_ids = tuple(token_ids) if self.confirm_tokens else None
        self.cached_block_hash_to_block[block_hash] = block_id

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
        for h, i in self.cached_block_hash_to_block.items():
            assert self.blocks[i].block_hash == h, f"hash map points at block {i}, which holds another prefix"
