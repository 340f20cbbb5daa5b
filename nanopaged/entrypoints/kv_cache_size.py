"""How much KV cache a token costs, for any model's config.json (docs/01_kv_cache_arithmetic.md).

    python -m nanopaged.entrypoints.kv_cache_size path/to/config.json [--dtype bfloat16] [--tokens 8192]

Every token keeps a key and a value vector per kv head in every layer, so

    bytes per token = 2 (K and V) x layers x kv heads x head dim x bytes per value

(`ModelConfig.kv_bytes_per_token`, the same number the model runner divides the memory
budget by; with kv_cache_dtype="int8" each row of K and V adds its 4-byte scale). Only the kv
heads count: with grouped-query attention several query heads read one kv head, which is why
Qwen2.5-72B stores 8 heads per layer, not 64.
"""
from __future__ import annotations

import argparse
import json
from dataclasses import dataclass
from pathlib import Path

from nanopaged.config import DTYPES
from nanopaged.models.config import ModelConfig


@dataclass
class KVCacheSize:
    architecture: str
    num_layers: int
    num_kv_heads: int
    head_dim: int
    bytes_per_value: int
    bytes_per_token: int
    num_tokens: int

    @property
    def total_bytes(self) -> int:
        return self.bytes_per_token * self.num_tokens

    def describe(self) -> str:
        """The arithmetic spelled out, in binary (KiB/MiB/GiB) and decimal (MB/GB) units."""
        t = self.total_bytes
        return (f"{self.architecture}: {self.num_layers} layers, {self.num_kv_heads} kv heads, "
                f"head dim {self.head_dim}, {self.bytes_per_value} bytes per value\n"
                f"per token:  2 x {self.num_layers} x {self.num_kv_heads} x {self.head_dim} x "
                f"{self.bytes_per_value} = {self.bytes_per_token:,} bytes "
                f"({self.bytes_per_token / 2**20:.4f} MiB, {self.bytes_per_token / 1e6:.3f} MB)\n"
                f"{self.num_tokens:,} tokens: {t:,} bytes ({t / 2**30:.3f} GiB, {t / 1e9:.3f} GB)")


def kv_cache_size(config: dict | str | Path, dtype: str = "bfloat16", num_tokens: int = 1) -> KVCacheSize:
    """KV bytes per token (and for `num_tokens` tokens) of a config.json dict, file or model folder."""
    if dtype not in DTYPES:
        raise ValueError(f"dtype must be one of {sorted(DTYPES)}, got {dtype!r}")
    if not isinstance(num_tokens, int) or isinstance(num_tokens, bool) or num_tokens < 1:
        raise ValueError(f"num_tokens must be an integer >= 1, got {num_tokens!r}")
    if not isinstance(config, dict):
        path = Path(config)
        if path.is_dir():
            path = path / "config.json"
        if not path.is_file():
            raise ValueError(f"no config.json at {str(config)!r}")
        config = json.loads(path.read_text())
    m = ModelConfig.from_dict(config)
    nbytes = DTYPES[dtype][1]
    return KVCacheSize(architecture=m.architecture, num_layers=m.num_hidden_layers,
                       num_kv_heads=m.num_key_value_heads, head_dim=m.head_dim,
                       bytes_per_value=nbytes, bytes_per_token=m.kv_bytes_per_token(nbytes),
                       num_tokens=num_tokens)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m nanopaged.entrypoints.kv_cache_size",
                                     description="KV cache bytes per token of a Hugging Face config.json")
    parser.add_argument("config", help="a config.json, or a model folder holding one")
    parser.add_argument("--dtype", default="bfloat16", choices=sorted(DTYPES),
                        help="the KV cache's dtype (default bfloat16)")
    parser.add_argument("--tokens", type=int, default=8192, help="tokens to size for (default 8192)")
    args = parser.parse_args(argv)
    try:
        size = kv_cache_size(args.config, args.dtype, args.tokens)
    except ValueError as e:
        parser.error(str(e))
    print(size.describe())


if __name__ == "__main__":
    main()
