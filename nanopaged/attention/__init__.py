"""Attention backends: store new K/V into the paged pool, then attend through block tables.

`get_backend(name, device)` picks one. Only `torch` (the reference, any device) exists in
this version; `triton` and `flash` (CUDA kernels) are refused with a clear message.
"""
from __future__ import annotations

from nanopaged.attention.metadata import AttentionMetadata
from nanopaged.attention.torch_backend import TorchAttentionBackend

BACKENDS = ("auto", "torch", "triton", "flash")


def get_backend(name: str, device: str):
    if name not in BACKENDS:
        raise ValueError(f"attention_backend must be one of {BACKENDS}, got {name!r}")
    if name in ("auto", "torch"):
        return TorchAttentionBackend()
    raise ValueError(f"attention_backend={name!r} is not available in this version of nanopaged; "
                     "use 'torch' (or 'auto')")


__all__ = ["AttentionMetadata", "TorchAttentionBackend", "get_backend", "BACKENDS"]
