"""One block's file: a header, the tier key in full, the block hash, the K/V bytes, and a checksum over all of it.

    magic "NPKV" | format u16 | key length u32 | hash length u16 | K/V length u64 | key | hash | K/V | xxh3_128

Reading checks everything before a byte reaches the KV cache, and says what was wrong (`BadBlockFile.kind`):
`truncated` (shorter than its header says), `corrupt` (bad magic or checksum, extra bytes), `stale` (another
format, or this model folder under other weights or settings) or `foreign` (another model's block, or another
block's, under this name). A checksum is 16 bytes of xxh3_128: fast enough to check every read.
"""
from __future__ import annotations

import json
import struct

import xxhash

from nanopaged.kv_disk.key import FORMAT_VERSION, same_kv

MAGIC = b"NPKV"
HEADER = struct.Struct("<4sHIHQ")       # magic, format, key length, hash length, K/V length
CHECKSUM_BYTES = 16
KINDS = ("corrupt", "truncated", "foreign", "stale")


class BadBlockFile(ValueError):
    """A file that must not be used; `kind` is one of KINDS."""

    def __init__(self, kind: str, why: str) -> None:
        super().__init__(f"{kind}: {why}")
        self.kind = kind


def layout(key_data: bytes, hash_len: int, kv_len: int) -> tuple[int, int]:
    """Where a file's K/V start, and the file's length in bytes."""
    start = HEADER.size + len(key_data) + hash_len
    return start, start + kv_len + CHECKSUM_BYTES


def seal(image, key_data: bytes, block_hash: bytes, kv_len: int) -> int:
    """Complete a file's bytes in place around K/V already copied to their place (`layout`): the header, the
    key and the hash before them, the checksum over all of it after them. The file's length."""
    view = memoryview(image)
    start, size = layout(key_data, len(block_hash), kv_len)
    view[:start] = HEADER.pack(MAGIC, FORMAT_VERSION, len(key_data), len(block_hash), kv_len) + key_data + block_hash
    view[size - CHECKSUM_BYTES:size] = xxhash.xxh3_128_digest(view[:size - CHECKSUM_BYTES])
    return size


def decode(data: bytes, key: dict, block_hash: bytes, kv_bytes: int) -> memoryview:
    """The K/V bytes of a file read for this key and block hash, or BadBlockFile saying why not."""
    if len(data) < HEADER.size:
        raise BadBlockFile("truncated", f"{len(data)} bytes, shorter than the header")
    magic, version, key_len, hash_len, kv_len = HEADER.unpack_from(data)
    if magic != MAGIC:
        raise BadBlockFile("corrupt", f"magic {magic!r}")
    if version != FORMAT_VERSION:
        raise BadBlockFile("stale", f"format {version}, this engine writes {FORMAT_VERSION}")
    total = HEADER.size + key_len + hash_len + kv_len + CHECKSUM_BYTES
    if len(data) != total:
        raise BadBlockFile("truncated" if len(data) < total else "corrupt", f"{len(data)} bytes, header says {total}")
    body = memoryview(data)[:-CHECKSUM_BYTES]
    if xxhash.xxh3_128_digest(body) != data[-CHECKSUM_BYTES:]:
        raise BadBlockFile("corrupt", "checksum mismatch")
    start = HEADER.size
    file_key = json.loads(bytes(body[start:start + key_len]))
    if not same_kv(file_key, key):
        same_folder = file_key.get("model_path") == key["model_path"]
        raise BadBlockFile("stale" if same_folder else "foreign", f"written for {file_key.get('model_path')!r} "
                           f"under another key")
    if bytes(body[start + key_len:start + key_len + hash_len]) != block_hash:
        raise BadBlockFile("foreign", "another block's file under this name")
    if kv_len != kv_bytes:
        raise BadBlockFile("corrupt", f"{kv_len} bytes of K/V, a block holds {kv_bytes}")
    return body[start + key_len + hash_len:]
