"""The one place the settings become kernels: which fast path runs in place of the reference.

The model a reader studies (models/llama.py, attention/torch_backend.py, nn.Linear) is what runs
unless this module chooses otherwise. `choose` reads the settings and the CPU's flags once, before
a weight is loaded, and returns a `FastPath`: the linear kernel, the layer kernels, the attention
backend and the sampler's argmax. `FastPath.apply` then swaps the chosen layers into the loaded
model in one call (ModelRunner.load_model). A setting the user named is honoured or refused with
a ValueError that says why; only "auto" is decided here:

    cpu_linear   auto, for a bfloat16 model on a CPU with bfloat16 matrix units: packed (oneDNN)
                 where the CPU has AMX, whose tiles oneDNN drives; dpbf16 (nanopaged's kernel) where
                 it has AVX512-BF16 without AMX and the kernels build; reference elsewhere
    cpu_kernels  auto: fused beside a packed linear (packed or dpbf16) when the attention backend is
                 left to choose and the kernels build (the first time on a machine, they are
                 compiled first); reference elsewhere, float32 included
    attention    auto: cpu beside the fused layers (they attend with its kernel), else what
                 attention/backends.py says for the device (torch on CPU)

Where each fast function replaces which reference, and the test that holds them equal, is
docs/00_how_to_read.md, "The fast path beside the reference".
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

from torch import nn

from nanopaged.attention.backends import resolve_attention_backend
from nanopaged.cpu.features import bf16_matrix_units


@dataclass
class FastPath:
    """What runs in place of the readable reference. All "reference" (and argmax None: the
    sampler's torch.argmax) is the path a student reads."""
    linear: str = "reference"           # packed | dpbf16 | reference (cpu/linear.py)
    layers: str = "reference"           # fused | reference (cpu/fused.py)
    attention_backend: str = "torch"    # the name in attention/backends.py: ATTENTION_BACKENDS
    quantization: str | None = None     # gguf | int4 | int8 (cpu/quantized_linear.py)
    quantization_group_size: int = 32
    gguf_file: str | None = None
    quantized: dict | None = None       # what quantizing did (get_stats, the load log)

    @property
    def argmax(self) -> Callable | None:
        """The sampler's argmax where a kernel replaces torch's: the fused path's, else None."""
        if self.layers != "fused":
            return None
        from nanopaged.cpu.fused import argmax_rows
        return argmax_rows

    def apply(self, model: nn.Module) -> None:
        """Swap the chosen layers into a loaded model, in the one order that works: quantize (each
        quantized layer keeps its dense twin for steps of many rows), pack the dense linears (the
        twins included), then describe every layer to the fused loop."""
        if self.quantization:
            from nanopaged.cpu.quantized_linear import quantize_linears
            self.quantized = quantize_linears(model, self.quantization, self.quantization_group_size, self.gguf_file)
        if self.linear != "reference":
            from nanopaged.cpu.linear import pack_linears
            pack_linears(model, self.linear)
        if self.layers == "fused":
            from nanopaged.cpu.fused import fuse_layers
            fuse_layers(model)


def choose(config) -> FastPath:
    """The fast path for an EngineConfig (config.py), or a ValueError naming the setting that
    cannot run here and why. Nothing is built unless a fast path is a candidate."""
    linear = choose_linear(config.cpu_linear, config.device, config.dtype)
    layers = choose_layers(config.cpu_kernels, config.device, linear, config.attention_backend, config.block_size)
    attention = "cpu" if layers == "fused" else config.attention_backend
    attention = resolve_attention_backend(attention, config.device, config.dtype)
    if attention == "cpu":
        check_cpu_attention(config.block_size)
    return FastPath(linear, layers, attention, config.quantization, config.quantization_group_size, config.gguf_file)


def choose_linear(name: str, device: str, dtype: str) -> str:
    units = bf16_matrix_units()
    can_pack = device == "cpu" and dtype == "bfloat16" and bool(units)
    if name == "auto":
        if not can_pack:
            return "reference"
        if "amx_bf16" not in units and dpbf16_builds():
            return "dpbf16"
        return "packed"
    if name in ("packed", "dpbf16") and not can_pack:
        raise ValueError(f"cpu_linear={name!r} needs device='cpu', dtype='bfloat16' and a CPU with bfloat16 "
                         f"matrix units (amx_bf16 or avx512_bf16); got device={device!r}, dtype={dtype!r}, "
                         f"units {units or 'none'}")
    if name == "dpbf16" and "avx512_bf16" not in units:
        raise ValueError(f"cpu_linear='dpbf16' needs AVX512-BF16 (the CPU's flag avx512_bf16); this CPU has {units}")
    if name == "dpbf16" and not dpbf16_builds():
        from nanopaged.cpu.build import available
        raise ValueError(f"cpu_linear='dpbf16': {available() or 'the kernels were built without AVX512-BF16'}")
    return name


def dpbf16_builds() -> bool:
    from nanopaged.cpu.build import available, cpu_ops
    return available() is None and bool(cpu_ops().has_avx512_bf16)


def choose_layers(name: str, device: str, linear: str, attention_backend: str, block_size: int = 16) -> str:
    """auto: fused where the linears are packed (the path that is not held to Hugging Face token
    for token anyway), the attention backend is left to choose and the kernels build."""
    candidate = device == "cpu" and linear != "reference" and attention_backend in ("auto", "cpu") and block_size >= 2
    if name == "reference" or (name == "auto" and not candidate):
        return "reference"
    from nanopaged.cpu.build import available     # only when the fast path is a candidate
    if name == "auto":
        return "fused" if available() is None else "reference"
    if device != "cpu":
        raise ValueError(f"cpu_kernels='fused' runs on CPU (device is {device!r})")
    if attention_backend not in ("auto", "cpu"):
        raise ValueError(f"cpu_kernels='fused' attends with the cpu backend's kernel; got "
                         f"attention_backend={attention_backend!r} (use 'auto' or 'cpu')")
    why_not = available()
    if why_not:
        raise ValueError(f"cpu_kernels='fused': {why_not}")
    return name


def check_cpu_attention(block_size: int) -> None:
    """The `cpu` backend needs its kernels, and pairs of tokens side by side in a block."""
    from nanopaged.cpu.build import available
    why_not = available()
    if why_not:
        raise ValueError(f"attention_backend='cpu': {why_not}")
    if block_size < 2:
        raise ValueError("attention_backend='cpu' keeps pairs of tokens side by side in a block: block_size "
                         f"must be at least 2, got {block_size}")
