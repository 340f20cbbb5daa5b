"""The tier key: everything besides its tokens that a block's K/V depend on, so a file is only ever read back
by an engine that would have computed the same bytes.

The chained block hash already covers the tokens, the cache salt, the adapter and a prompt's images; the key
adds the model (its config.json and weights, by content, not by path), the dtypes, the block's shape, the
quantization, the kernels that computed it, the hash function and the rank. A file's name holds the key's
digest; the file holds the key in full, so a file moved under another name is caught (block_file.py).
"""
from __future__ import annotations

import json
from pathlib import Path

import xxhash

FORMAT_VERSION = 1              # the layout of a block file (block_file.py); another version is stale
CHUNK_BYTES = 1 << 24           # weights are hashed in chunks of 16 MiB, never read whole into memory


def files_digest(paths: list[Path]) -> str:
    """xxh3_128 over the files' names, sizes and bytes: the weights by content (one read at start-up)."""
    h = xxhash.xxh3_128()
    for path in paths:
        h.update(f"{path.name}:{path.stat().st_size}\n".encode())
        with open(path, "rb") as f:
            while chunk := f.read(CHUNK_BYTES):
                h.update(chunk)
    return h.hexdigest()


def model_files(config) -> list[Path]:
    """The files that decide the weights: config.json, every safetensors file, and a GGUF file if it is read."""
    folder = Path(config.model)
    files = [folder / "config.json", *sorted(folder.glob("*.safetensors"))]
    return files + ([Path(config.gguf_file)] if config.gguf_file else [])


def tier_key(config, runner, rank: int = 0) -> dict:
    """The key as plain data; `model_path` alone is only for telling a stale file from a foreign one."""
    fast = runner.fast_path
    return {
        "format": FORMAT_VERSION,
        "model_path": str(Path(config.model).resolve()),
        "architecture": runner.model_config.architecture,
        "weights": files_digest(model_files(config)),
        "dtype": config.dtype,
        "kv_cache_dtype": str(runner.kv_cache_dtype).removeprefix("torch."),
        "block_shape": list(runner.kv_cache_shape(1)),      # layers, K/V, 1, block_size, kv heads, row
        "block_size": config.block_size,
        "quantization": [fast.quantization, fast.quantization_group_size if fast.quantization else None],
        "kernels": [fast.linear, fast.layers, fast.attention_backend],   # other kernels round differently
        "prefix_hash": config.prefix_hash,
        "tensor_parallel": [rank, config.tensor_parallel_size],
    }


def key_bytes(key: dict) -> bytes:
    """The key as written into every file: canonical JSON."""
    return json.dumps(key, sort_keys=True, separators=(",", ":")).encode()


def same_kv(a: dict, b: dict) -> bool:
    """Would both keys' engines compute the same bytes? (A copy of the model folder elsewhere would.)"""
    return {k: v for k, v in a.items() if k != "model_path"} == {k: v for k, v in b.items() if k != "model_path"}


def key_digest(key: dict) -> str:
    """The part of a file's name that stands for the key: engines with the same K/V share files."""
    return xxhash.xxh3_64_hexdigest(key_bytes({k: v for k, v in key.items() if k != "model_path"}))
