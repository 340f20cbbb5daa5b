"""The attention backends by name: the interface each implements, which one `auto` means here,
and loading the chosen one.

The table names each by "module:class" and a backend's module is imported only when it is
chosen, so nanopaged imports without triton or flash-attn installed
(docs/05_model_runner_and_kernels.md, "Backends").
"""
from __future__ import annotations

import importlib
import importlib.util
import os
from typing import TYPE_CHECKING, Protocol

from nanopaged.validation import check_choice

if TYPE_CHECKING:
    import torch
    from torch import nn

    from nanopaged.attention.metadata import AttentionMetadata


class AttentionBackend(Protocol):
    """What a backend does; torch_backend.py is the reference every other one is tested against."""
    name: str

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor,
                v_cache: torch.Tensor, meta: AttentionMetadata, scale: float) -> torch.Tensor:
        """One layer's two jobs: store the step's K/V in their slots (meta.slot_mapping), then attend
        each new row over its request's K/V through its block table. q: (tokens, heads, head_dim);
        k, v: (tokens, kv_heads, head_dim); returns (tokens, heads, head_dim)."""

    def wrap_model(self, model: nn.Module, runner) -> nn.Module:
        """How the whole model is launched: the model itself, or a wrapper (CUDA graphs)."""

ATTENTION_BACKENDS = {
    "torch": "nanopaged.attention.torch_backend:TorchAttentionBackend",
    "triton": "nanopaged.attention.triton_backend:TritonAttentionBackend",
    "flash": "nanopaged.attention.flash_backend:FlashAttentionBackend",
    "cpu": "nanopaged.cpu.attention:CpuAttentionBackend",     # the CPU annex's (nanopaged/cpu/)
}


def resolve_attention_backend(name: str, device: str, dtype: str) -> str:
    """The backend `name` means on `device`, or a ValueError saying what is missing.

    auto: flash on CUDA in float16/bfloat16 when flash-attn and triton are installed (flash-attn
    has no float32 kernels), else triton on CUDA when it is installed, else the torch reference.
    """
    check_choice("attention_backend", name, ("auto", *ATTENTION_BACKENDS))
    cuda = device == "cuda"
    if name == "auto":
        if cuda and dtype != "float32" and _installed("flash_attn") and _installed("triton"):
            return "flash"
        return "triton" if cuda and _installed("triton") else "torch"
    if name == "triton":
        if not _installed("triton"):
            raise ValueError("attention_backend='triton' needs triton: pip install -e '.[triton]'")
        # Triton's interpreter runs kernels on CPU tensors; it must be on before triton is imported.
        if not (cuda or os.environ.get("TRITON_INTERPRET") == "1"):
            raise ValueError(f"attention_backend='triton' needs CUDA (device is {device!r}) "
                             "or TRITON_INTERPRET=1 set before triton is imported (CPU, tests only)")
    if name == "cpu" and device != "cpu":    # whether its kernels build here: cpu/choose.py asks
        raise ValueError(f"attention_backend='cpu' runs on CPU (device is {device!r})")
    if name == "flash":
        if not cuda:
            raise ValueError(f"attention_backend='flash' needs CUDA (device is {device!r}); "
                             "on CUDA install it with: pip install -e '.[flash]'")
        if not _installed("flash_attn"):
            raise ValueError("attention_backend='flash' needs flash-attn: pip install -e '.[flash]'")
        if not _installed("triton"):   # its store kernel is Triton's
            raise ValueError("attention_backend='flash' needs triton too: pip install -e '.[triton]'")
    return name


def load_attention_backend(name: str) -> AttentionBackend:
    """An instance of the backend class the table names (importing its module only now)."""
    module, cls = ATTENTION_BACKENDS[name].split(":")
    return getattr(importlib.import_module(module), cls)()


def _installed(package: str) -> bool:
    """Whether `package` can be imported, without importing it (find_spec only looks)."""
    return importlib.util.find_spec(package) is not None
