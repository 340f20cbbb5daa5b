"""The block pool: the KV cache cut into fixed-size blocks, and the prefix cache over them.

At start-up the model runner preallocates one KV tensor and cuts it into `num_blocks`
physical blocks of `block_size` token slots. This file keeps the books of those blocks,
never their contents, and imports no torch (paper section 4.1; vLLM: v1/core/block_pool.py):

- `Block`: an id, a `ref_count` (how many block tables hold it) and, once it is full, the
  hash that names its prefix;
- `free_block_queue`: a deque of free block ids. Allocation takes from the head, freeing
  appends to the tail, so the queue's order is also the prefix cache's LRU eviction order;
- the prefix cache (paper section 4.4; vLLM: v1/core/kv_cache_utils.py): a full block is
  named by a chained hash of its whole prefix, and `cached_block_hash_to_block` finds it
  (every block that holds that prefix, so losing one to eviction does not lose the prefix).
  A freed block keeps its name and its K/V until allocation hands it out again.

Chapters: docs/02_block_pool.md and docs/03_prefix_caching.md.
"""
from __future__ import annotations

import hashlib
import struct
from collections import deque
from dataclasses import dataclass
from typing import TYPE_CHECKING

import xxhash

if TYPE_CHECKING:
    from nanopaged.core.request import Request

# The block hash (the `prefix_hash` setting). Never Python's hash(), which differs between runs.
HASH_FUNCTIONS = {
    "sha256": lambda data: hashlib.sha256(data).digest(),      # the default: collisions are no concern
    "xxhash": lambda data: xxhash.xxh3_128_digest(data),       # 128 bits, several times faster
}
ROOT_HASH = b"nanopaged-prefix-cache-root"      # the parent of every request's first block


def cdiv(a: int, b: int) -> int:
    """Ceiling division: how many blocks of size b hold a tokens."""
    return -(-a // b)


def hash_block(hash_fn, parent_hash: bytes, token_ids, keys: tuple = ()) -> bytes:
    """H(parent_hash, block_token_ids, extra_keys), over a fixed little-endian encoding.

    A block's K/V depend on every token before it, so its name includes its parent's name.
    `keys`: what else they depend on, mixed into a request's first block (vLLM's extra keys).
    """
    data = [parent_hash, struct.pack(f"<I{len(token_ids)}q", len(token_ids), *token_ids)]
    for key in keys:                     # each length-prefixed: no two tuples encode alike
        encoded = repr(key).encode()
        data.append(struct.pack("<I", len(encoded)) + encoded)
    return hash_fn(b"".join(data))


@dataclass(slots=True)
class Block:
    block_id: int
    ref_count: int = 0                    # block tables that hold this block; 0 = free
    block_hash: bytes | None = None       # set once the block is full and cached
    state_snapshot: tuple[int, ...] = ()  # a hybrid's state at this block's end: pages it keeps (core/state_pages.py)


class BlockPool:
    def __init__(self, num_blocks: int, block_size: int, enable_caching: bool = False,
                 prefix_hash: str = "sha256", state_pages_per_request: int = 0) -> None:
        if num_blocks < 1:
            raise ValueError(f"num_blocks must be >= 1, got {num_blocks}")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.blocks = [Block(i) for i in range(num_blocks)]
        self.free_block_queue: deque[int] = deque(range(num_blocks))
        self.enable_caching = enable_caching
        self.hash_fn = HASH_FUNCTIONS[prefix_hash]
        self.cached_block_hash_to_block: dict[bytes, list[int]] = {}   # hash -> the blocks holding it
        self.num_evicted_blocks = 0       # cached blocks handed out again, their prefix lost
        self.state_pages_per_request = state_pages_per_request   # a hybrid's state: pages beside the block table
        self.num_kept_free = 0            # pages of snapshots kept by free blocks: taken back when needed

    @property
    def num_free_blocks(self) -> int:
        """The free queue, and the pages of a hybrid's snapshots that free blocks keep (core/state_pages.py):
        a cache like the blocks' K/V, given up when the pages are needed."""
        return len(self.free_block_queue) + self.num_kept_free

    def usage(self) -> float:
        """Fraction of blocks in use (vLLM's kv_cache_usage = 1 - free / total)."""
        return 1.0 - self.num_free_blocks / self.num_blocks

    def blocks_needed(self, num_held: int, num_tokens: int) -> int:
        """New blocks a block table of `num_held` blocks needs to hold `num_tokens` tokens.

        A block is allocated only when the last one is full, so a request never holds more
        than one partly filled block: its waste is below one block (paper section 4.2).
        """
        return max(0, cdiv(num_tokens, self.block_size) - num_held)

    def allocate(self, n: int) -> list[int]:
        """Take n blocks from the head of the free queue, each with ref_count 1."""
        if n > self.num_free_blocks:
            raise RuntimeError(f"asked for {n} blocks, only {self.num_free_blocks} free")
        self._give_up_snapshots(n)
        ids = [self.free_block_queue.popleft() for _ in range(n)]
        for i in ids:
            block = self.blocks[i]
            assert block.ref_count == 0, f"block {i} in the free queue has ref_count {block.ref_count}"
            self._evict(block)
            block.ref_count = 1
        return ids

    def touch(self, block_ids: list[int]) -> None:
        """One more block table holds these blocks; a free one leaves the free queue.

        NOTE: deque.remove is O(free blocks). vLLM keeps the free queue as a doubly linked
        list to make this O(1); a plain deque keeps the idea visible at this engine's scale.
        """
        for i in block_ids:
            block = self.blocks[i]
            if block.ref_count == 0:
                self.free_block_queue.remove(i)
                self.num_kept_free -= len(block.state_snapshot)
            block.ref_count += 1

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
                self.num_kept_free += len(block.state_snapshot)

    # ---- the prefix cache -----------------------------------------------------------------
    def block_hashes(self, request: Request) -> list[bytes]:
        """The chained hashes of the request's full blocks of tokens, each computed once."""
        hashes, bs = request.block_hashes, self.block_size
        for i in range(len(hashes), request.num_tokens // bs):
            parent = hashes[-1] if hashes else ROOT_HASH
            # the same tokens under another cache salt, or another extension's keys (an adapter), are another prefix
            keys = (request.cache_salt, *request.extra_keys) if i == 0 else ()
            # an image's content joins the keys of every block its placeholders occupy (vLLM's mm hashes)
            keys += tuple(image.hash for image in request.encoder_inputs if image.overlaps(i * bs, (i + 1) * bs))
            hashes.append(hash_block(self.hash_fn, parent, request.token_ids(i * bs, (i + 1) * bs), keys))
        return hashes

    def max_cache_hit_blocks(self, request: Request) -> int:
        """At most num_tokens - 1 tokens can hit: the last one is computed for its logits
        (vLLM: kv_cache_manager.py, `max_cache_hit_length`). A request that wants prompt
        logprobs needs the logits of every prompt token: it reads nothing from the cache."""
        if not self.enable_caching or request.sampling_params.prompt_logprobs is not None:
            return 0
        return (request.num_tokens - 1) // self.block_size

    def find_cached_blocks(self, block_hashes: list[bytes]) -> list[int]:
        """The cached blocks of the longest run of these hashes from the start; stops at a miss."""
        hits = []
        for h in block_hashes:
            block_ids = self.cached_block_hash_to_block.get(h)
            if not block_ids:
                break
            hits.append(block_ids[0])
        return hits

    def find_cached_prefix(self, request: Request) -> list[int]:
        """The blocks a request admitted now can reuse from the cache, from its first block on."""
        n = self.max_cache_hit_blocks(request)
        return self.find_cached_blocks(self.block_hashes(request)[:n]) if n else []

    def cache_block(self, block_id: int, block_hash: bytes) -> None:
        """Name a full block, so later requests can find it (beside any other block that
        holds the same prefix: when one of them is evicted, the prefix stays cached)."""
        block = self.blocks[block_id]
        if block.block_hash is None:
            block.block_hash = block_hash
            self.cached_block_hash_to_block.setdefault(block_hash, []).append(block_id)

    def cache_full_blocks(self, request: Request) -> None:
        """Name the request's blocks whose every slot now holds computed K/V."""
        if not self.enable_caching:
            return
        num_full = request.num_computed_tokens // self.block_size
        hashes = self.block_hashes(request)
        for i in range(request.num_cached_blocks, num_full):
            self.cache_block(request.block_ids[i], hashes[i])
        request.num_cached_blocks = max(request.num_cached_blocks, num_full)

    def _evict(self, block: Block) -> None:
        """The block is about to be overwritten: it no longer holds its cached prefix."""
        if block.block_hash is None:
            return
        holders = self.cached_block_hash_to_block[block.block_hash]
        holders.remove(block.block_id)
        if not holders:
            del self.cached_block_hash_to_block[block.block_hash]
        block.block_hash = None
        self.num_evicted_blocks += 1
        self._drop_snapshot(block)        # a snapshot lives no longer than its block's prefix

    # ---- a hybrid's state snapshots (core/state_pages.py) --------------------------------------
    def keep_snapshot(self, block_id: int, pages: list[int]) -> None:
        """The block keeps the state at its end in these pages, as long as it stays cached."""
        block = self.blocks[block_id]
        block.state_snapshot = tuple(pages)
        self.num_kept_free += len(pages) if block.ref_count == 0 else 0

    def _drop_snapshot(self, block: Block) -> None:
        if block.state_snapshot:
            self.num_kept_free -= len(block.state_snapshot) if block.ref_count == 0 else 0
            pages, block.state_snapshot = list(block.state_snapshot), ()
            self.free(pages)

    def _give_up_snapshots(self, n: int) -> None:
        """Until the free queue holds n pages, free blocks give up their snapshots, least recently used first."""
        for i in list(self.free_block_queue) if len(self.free_block_queue) < n else ():
            if len(self.free_block_queue) >= n:
                break
            self._drop_snapshot(self.blocks[i])

    def check_invariants(self) -> None:
        """Every block is either free (ref 0, in the queue once) or held (ref > 0, not queued)."""
        queued = set(self.free_block_queue)
        assert len(queued) == len(self.free_block_queue), "a block is in the free queue twice"
        assert self.num_kept_free == sum(len(self.blocks[i].state_snapshot) for i in queued), "kept pages miscounted"
        for block in self.blocks:
            if block.block_id in queued:
                assert block.ref_count == 0, f"free block {block.block_id} has ref_count {block.ref_count}"
            else:
                assert block.ref_count > 0, f"block {block.block_id} is neither free nor held"
        for h, ids in self.cached_block_hash_to_block.items():
            assert ids, "a hash with no block left is still in the map"
            for i in ids:
                assert self.blocks[i].block_hash == h, f"hash map points at block {i}, which holds another prefix"
