"""Prefix caching: name every full block by a hash of its whole prefix (paper section 4.4).

A block's K/V depend on its own tokens *and on every token before it*. So a full block is
named by a chained hash, H(parent_hash, block_token_ids, extra_keys), where parent_hash
names the block before it and the first block chains to a fixed ROOT_HASH. Two requests
whose prompts start with the same tokens get the same hashes for those blocks, and the
second one can reuse the first one's K/V instead of computing it (vLLM: v1/core/kv_cache_utils.py,
`hash_block_tokens`). A hash never comes from Python's `hash()`, which changes between
processes: the bytes hashed are a fixed little-endian encoding of the token ids.

`extra_keys` carries the request's `cache_salt`, mixed into its first block only (the
chain carries it to every later block), so tenants with different salts never share.

Only full blocks are hashed; a partly filled last block is never shared. No torch here.
"""
from __future__ import annotations

import hashlib
import struct
from typing import Callable, Sequence

import xxhash

HashFn = Callable[[bytes], bytes]

HASH_FUNCTIONS: dict[str, HashFn] = {
    "sha256": lambda data: hashlib.sha256(data).digest(),          # the default: no collisions in practice
    "xxhash": lambda data: xxhash.xxh3_128_digest(data),           # 128-bit, several times faster
    "xxhash64": lambda data: xxhash.xxh64_digest(data),            # 64-bit: hits are confirmed by tokens
}
# With a 64-bit hash two different prefixes may collide, so a hit must be confirmed by
# comparing the block's token ids (BlockPool.find_cached_blocks does).
CONFIRM_TOKENS = {"sha256": False, "xxhash": False, "xxhash64": True}

ROOT_HASH = b"nanopaged-prefix-cache-root"


def hash_block(hash_fn: HashFn, parent_hash: bytes, token_ids: Sequence[int],
               extra_keys: str | None = None) -> bytes:
    """H(parent_hash, block_token_ids, extra_keys), over a stable byte encoding."""
    data = [parent_hash, struct.pack(f"<I{len(token_ids)}q", len(token_ids), *token_ids)]
    if extra_keys is not None:
        salt = extra_keys.encode()
        data.append(struct.pack("<I", len(salt)) + salt)
    return hash_fn(b"".join(data))


def extend_block_hashes(block_hashes: list[bytes], token_ids: Callable[[int, int], list[int]],
                        num_tokens: int, block_size: int, hash_fn: HashFn,
                        cache_salt: str | None) -> None:
    """Append the hashes of the blocks that became full since the last call.

    `token_ids(start, end)` returns the request's tokens [start, end) (Request.token_ids).
    """
    for i in range(len(block_hashes), num_tokens // block_size):
        parent = block_hashes[-1] if block_hashes else ROOT_HASH
        tokens = token_ids(i * block_size, (i + 1) * block_size)
        block_hashes.append(hash_block(hash_fn, parent, tokens, cache_salt if i == 0 else None))
