"""Attention backends: store new K/V into the paged pool, then attend through block tables.

`get_backend(name, device)` picks one (see docs/05_model_runner_and_kernels.md):
  torch   the reference, any device;
  triton  Triton store + paged-attention kernels; CUDA, or CPU under TRITON_INTERPRET=1;
  flash   Triton store + flash-attn; CUDA with flash-attn installed;
  auto    flash if possible, else triton on CUDA, else torch.
triton and flash_attn are imported only when their backend is chosen, so nanopaged imports
and runs without them.
"""
from __future__ import annotations

import importlib.util
import os

from nanopaged.attention.metadata import AttentionMetadata
from nanopaged.attention.torch_backend import TorchAttentionBackend

BACKENDS = ("auto", "torch", "triton", "flash")


def _installed(package: str) -> bool:
    """Whether `package` can be imported, without importing it (find_spec only looks)."""
    return importlib.util.find_spec(package) is not None


def _interpreting() -> bool:
    # Triton's interpreter runs kernels on CPU tensors; it must be on before triton is imported.
    return os.environ.get("TRITON_INTERPRET") == "1"


def _resolve(name: str, device: str) -> str:
    """The backend `name` means on `device`, or a ValueError saying what is missing."""
    cuda = device == "cuda"
    if name == "auto":
        if cuda and _installed("flash_attn") and _installed("triton"):
            return "flash"
        return "triton" if cuda and _installed("triton") else "torch"
    if name == "triton":
        if not _installed("triton"):
            raise ValueError("attention_backend='triton' needs triton: pip install -e '.[triton]'")
        if not (cuda or _interpreting()):
            raise ValueError(f"attention_backend='triton' needs CUDA (device is {device!r}) "
                             "or TRITON_INTERPRET=1 set before triton is imported (CPU, tests only)")
    if name == "flash":
        if not cuda:
            raise ValueError(f"attention_backend='flash' needs CUDA (device is {device!r}); "
                             "on CUDA install it with: pip install -e '.[flash]'")
        if not _installed("flash_attn"):
            raise ValueError("attention_backend='flash' needs flash-attn: pip install -e '.[flash]'")
        if not _installed("triton"):   # its store kernel is Triton's
            raise ValueError("attention_backend='flash' needs triton too: pip install -e '.[triton]'")
    return name


def get_backend(name: str, device: str):
    """An attention backend object for `name` (one of BACKENDS) on `device` ('cpu' or 'cuda')."""
    if name not in BACKENDS:
        raise ValueError(f"attention_backend must be one of {BACKENDS}, got {name!r}")
    name = _resolve(name, device)
    if name == "triton":
        from nanopaged.attention.triton_backend import TritonAttentionBackend
        return TritonAttentionBackend()
    if name == "flash":
        from nanopaged.attention.flash_backend import FlashAttentionBackend
        return FlashAttentionBackend()
    return TorchAttentionBackend()


__all__ = ["AttentionMetadata", "TorchAttentionBackend", "get_backend", "BACKENDS"]
