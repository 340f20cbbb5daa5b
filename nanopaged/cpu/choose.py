"""The one place the settings become kernels: which fast path runs in place of the reference.

The model a reader studies (models/llama.py, attention/torch_backend.py, nn.Linear) is what runs
unless this module chooses otherwise. `choose` reads the settings and the CPU's flags once, before
a weight is loaded, and returns a `FastPath`: the linear kernel, the layer kernels, the attention
backend and the sampler's argmax. `FastPath.stages` are its stages of the model pipeline
(models/pipeline.py: quantize, pack, fuse), which swap the chosen layers into the loaded model.
A setting the user named is honoured or refused with a ValueError that says why; only "auto" is
decided here (under tensor parallelism every rank runs the reference layers, its own):

    batch_invariant  auto (or vLLM's VLLM_BATCH_INVARIANT=1/0 where the setting is not given): on
                 where the chosen path computes each row in an order that depends on that row
                 alone (dpbf16 linears, the fused layers, the cpu attention: a CPU with AVX512-BF16
                 where the kernels build), off elsewhere, with the reason in the log
    cpu_linear   auto, for a bfloat16 model on a CPU with bfloat16 matrix units: dpbf16 (nanopaged's
                 kernel) where the CPU has AVX512-BF16 and the kernels build; packed (oneDNN) where
                 batch invariance is off and the CPU has AMX, whose tiles oneDNN drives, or where
                 dpbf16 cannot run; reference elsewhere
    cpu_kernels  auto: fused beside a packed linear (packed or dpbf16) when the attention backend is
                 left to choose and the kernels build (the first time on a machine, they are
                 compiled first), a mixture's experts grouped (cpu/moe.py); reference elsewhere,
                 float32 included
    attention    auto: cpu beside the fused layers (they attend with its kernel), else what
                 attention/backends.py says for the device (torch on CPU)

Where each fast function replaces which reference, and the test that holds them equal, is
docs/00_how_to_read.md, "The fast path beside the reference".
"""
from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Callable

from torch import nn

from nanopaged.attention.backends import resolve_attention_backend
from nanopaged.cpu import build
from nanopaged.cpu.features import bf16_matrix_units
from nanopaged.cpu.fused import argmax_rows, fuse_layers
from nanopaged.cpu.linear import pack_linears
from nanopaged.cpu.quantized_linear import quantize_linears
from nanopaged.models.pipeline import ModelStage


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
    batch_invariant: bool = False       # every row computed alone: the same tokens in any batch
    quantized: dict | None = None       # what quantizing did (get_stats, the load log)

    @property
    def argmax(self) -> Callable | None:
        """The sampler's argmax where a kernel replaces torch's: the fused path's, else None."""
        return argmax_rows if self.layers == "fused" else None

    def stages(self) -> list[ModelStage]:
        """Its stages of the model pipeline (models/pipeline.py), each only where chosen: quantize,
        pack the linears left dense, then group a mixture's experts and describe every layer to the
        fused loop (after any other stage has wrapped a linear: an adapter's updates)."""
        stages = []
        if self.quantization:
            stages.append(ModelStage("quantize", self._quantize))
        if self.linear != "reference":
            stages.append(ModelStage("pack", self._pack))
        if self.layers == "fused":
            stages.append(ModelStage("fuse", self._fuse))
        return stages

    def _pack(self, model: nn.Module) -> nn.Module:
        pack_linears(model, self.linear)
        return model

    def _fuse(self, model: nn.Module) -> nn.Module:
        fuse_layers(model)
        return model

    def _quantize(self, model: nn.Module) -> nn.Module:
        self.quantized = quantize_linears(model, self.quantization, self.quantization_group_size, self.gguf_file)
        return model


def choose(config) -> FastPath:
    """The fast path for an EngineConfig (config.py), or a ValueError naming the setting that
    cannot run here and why. Nothing is built unless a fast path is a candidate."""
    asked = asked_batch_invariance(config.batch_invariant)
    linear = choose_linear(config.cpu_linear, config.device, config.dtype, invariant=asked is not False)
    layers = choose_layers(config.cpu_kernels, config.device, linear, config.attention_backend, config.block_size)
    attention = "cpu" if layers == "fused" else config.attention_backend
    if config.tensor_parallel_size > 1:      # the parallel layers keep their own forward: nothing packed or fused
        linear = layers = "reference"        # (the attention stays as chosen)
    attention = resolve_attention_backend(attention, config.device, config.dtype)
    if attention == "cpu":
        check_cpu_attention(config.block_size)
    if config.kv_cache_dtype != "auto" and attention not in ("torch", "cpu"):
        raise ValueError(f"kv_cache_dtype={config.kv_cache_dtype!r} runs on the torch and cpu attention backends, "
                         f"not {attention!r} (attention_backend='torch' reads it on any device)")
    why_not = not_batch_invariant(config.device, config.tensor_parallel_size, linear, layers, attention)
    if asked and why_not:
        raise ValueError(f"batch_invariant=True cannot hold here: {why_not}")
    return FastPath(linear, layers, attention, config.quantization, config.quantization_group_size, config.gguf_file,
                    batch_invariant=asked is not False and why_not is None)


def asked_batch_invariance(setting: bool | None) -> bool | None:
    """The setting; where it is not given, vLLM's switch VLLM_BATCH_INVARIANT (1 or 0); else None: auto."""
    if setting is not None:
        return setting
    flag = os.environ.get("VLLM_BATCH_INVARIANT", "").strip()
    return {"1": True, "0": False}.get(flag)


def not_batch_invariant(device: str, tensor_parallel_size: int, linear: str, layers: str, attention: str) -> str | None:
    """Why a row's result could depend on the rest of its step on this path, or None where every
    kernel computes a row in an order that depends on that row alone (tests/engine/test_batch_invariance.py)."""
    if device != "cpu":
        return ("on CUDA nanopaged has no batch-invariant kernels: cuBLAS picks its GEMM, and a split over K, "
                "by the step's row count, and flash-attn splits the keys by the batch's size")
    if tensor_parallel_size > 1:
        return ("with tensor_parallel_size > 1 the ranks run the reference layers, through collectives no "
                "test holds to it")
    if linear != "dpbf16":
        return (f"the linear kernel is {linear!r}, whose blocking (oneDNN's, or MKL's sgemm in float32) depends on the "
                "step's row count; nanopaged's dpbf16 kernel, which computes each row alone, needs a bfloat16 model "
                "on a CPU with AVX512-BF16 (cpu_linear='dpbf16')")
    if layers != "fused" or attention != "cpu":
        return ("the torch reference layers and attention (cpu_kernels='reference', attention_backend="
                f"{attention!r}) are not held to it: the torch backend pads decode rows into groups by length")
    return None


def choose_linear(name: str, device: str, dtype: str, invariant: bool = False) -> str:
    """auto: nanopaged's dpbf16 where it runs, except on AMX without batch invariance, where oneDNN
    drives the tiles; oneDNN's packed kernel where dpbf16 cannot run; the reference elsewhere."""
    units = bf16_matrix_units()
    can_pack = device == "cpu" and dtype == "bfloat16" and bool(units)
    if name == "auto":
        if not can_pack:
            return "reference"
        if ("amx_bf16" not in units or invariant) and dpbf16_builds():
            return "dpbf16"
        return "packed"
    if name in ("packed", "dpbf16") and not can_pack:
        raise ValueError(f"cpu_linear={name!r} needs device='cpu', dtype='bfloat16' and a CPU with bfloat16 "
                         f"matrix units (amx_bf16 or avx512_bf16); got device={device!r}, dtype={dtype!r}, "
                         f"units {units or 'none'}")
    if name == "dpbf16" and "avx512_bf16" not in units:
        raise ValueError(f"cpu_linear='dpbf16' needs AVX512-BF16 (the CPU's flag avx512_bf16); this CPU has {units}")
    if name == "dpbf16" and not dpbf16_builds():
        raise ValueError(f"cpu_linear='dpbf16': {build.available() or 'the kernels were built without AVX512-BF16'}")
    return name


def dpbf16_builds() -> bool:
    return build.available() is None and bool(build.cpu_ops().has_avx512_bf16)


def choose_layers(name: str, device: str, linear: str, attention_backend: str, block_size: int = 16) -> str:
    """auto: fused where the linears are packed (the path that is not held to Hugging Face token
    for token anyway), the attention backend is left to choose and the kernels build; a mixture of
    experts' experts then run grouped (cpu/moe.py)."""
    candidate = device == "cpu" and linear != "reference" and attention_backend in ("auto", "cpu") and block_size >= 2
    if name == "reference" or (name == "auto" and not candidate):
        return "reference"
    if name == "auto":
        return "fused" if build.available() is None else "reference"
    if device != "cpu":
        raise ValueError(f"cpu_kernels='fused' runs on CPU (device is {device!r})")
    if attention_backend not in ("auto", "cpu"):
        raise ValueError(f"cpu_kernels='fused' attends with the cpu backend's kernel; got "
                         f"attention_backend={attention_backend!r} (use 'auto' or 'cpu')")
    why_not = build.available()
    if why_not:
        raise ValueError(f"cpu_kernels='fused': {why_not}")
    return name


def check_cpu_attention(block_size: int) -> None:
    """The `cpu` backend needs its kernels, and pairs of tokens side by side in a block."""
    why_not = build.available()
    if why_not:
        raise ValueError(f"attention_backend='cpu': {why_not}")
    if block_size < 2:
        raise ValueError("attention_backend='cpu' keeps pairs of tokens side by side in a block: block_size "
                         f"must be at least 2, got {block_size}")
