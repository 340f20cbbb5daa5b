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
                 alone (amx or dpbf16 linears, the fused layers, the cpu attention: a CPU with
                 AMX-BF16 or AVX512-BF16 where the kernels build), off elsewhere, with the reason in the log
    cpu_linear   auto, for a bfloat16 model on a CPU with bfloat16 matrix units: amx (nanopaged's tile
                 kernel) where the CPU has AMX-BF16, dpbf16 (nanopaged's dot-product kernel) where it has
                 AVX512-BF16 only, so long as the kernels build; packed (oneDNN) where neither can run;
                 reference elsewhere
    cpu_kernels  auto: fused beside a bfloat16 packed linear (amx, dpbf16, packed) when the attention backend is
                 left to choose and the kernels build (the first time on a machine, they are
                 compiled first), a mixture's experts grouped (cpu/moe.py); reference elsewhere,
                 float32 included
    attention    auto: cpu beside the fused layers (they attend with its kernel), else what
                 attention/backends.py says for the device (torch on CPU)
    a hybrid     (models/hybrid.py) its linear layers' decode token in C++ (cpu/recurrent.py) on a CPU where
                 the kernels build and cpu_kernels is not "reference"; its other layers the reference's, the
                 linears as cpu_linear chooses, the attention torch's (its K/V sit in shared pages)

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
from nanopaged.cpu.recurrent import STATE_STEPS
from nanopaged.cpu.rotation import check_w8a8
from nanopaged.models.pipeline import ModelStage


@dataclass
class FastPath:
    """What runs in place of the readable reference. All "reference" (and argmax None: the
    sampler's torch.argmax) is the path a student reads."""
    linear: str = "reference"           # packed | dpbf16 | amx | reference (cpu/linear.py)
    layers: str = "reference"           # fused | reference (cpu/fused.py)
    attention_backend: str = "torch"    # the name in attention/backends.py: ATTENTION_BACKENDS
    quantization: str | None = None     # gguf | int4 | int8 | w8a8 (cpu/quantized_linear.py)
    quantization_group_size: int = 32
    gguf_file: str | None = None
    batch_invariant: bool = False       # every row computed alone: the same tokens in any batch
    state_steps: str = "reference"      # cpp | reference: a hybrid's decode token (cpu/recurrent.py)
    quantized: dict | None = None       # what quantizing did (get_stats, the load log)

    @property
    def argmax(self) -> Callable | None:
        """The sampler's argmax where a kernel replaces torch's: the fused path's, else None."""
        return argmax_rows if self.layers == "fused" else None

    def steps(self) -> dict | None:
        """A hybrid's decode-token kernels for its layers; None: the reference's."""
        return STATE_STEPS if self.state_steps == "cpp" else None

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
    if config.quantization == "w8a8":
        check_w8a8(config)
    linear = choose_linear(config.cpu_linear, config.device, config.dtype)
    layers = choose_layers(config.cpu_kernels, config.device, linear if config.dtype == "bfloat16" else "reference",
                           config.attention_backend, config.block_size)    # float32: fused ran slower (docs/05)
    attention = "cpu" if layers == "fused" else config.attention_backend
    if config.tensor_parallel_size > 1 or config.pipeline_parallel_size > 1:   # the ranks' layers keep their own
        linear = layers = "reference"        # forward: nothing packed or fused (the attention stays as chosen)
    state_steps = "reference"
    if config.model_config.hybrid:           # the fused loop knows attention layers only; K/V sits in shared pages
        layers, attention = "reference", "torch"
        cpp = config.device == "cpu" and config.cpu_kernels != "reference" and build.available() is None
        state_steps = "cpp" if cpp else "reference"
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
                    batch_invariant=asked is not False and why_not is None, state_steps=state_steps)


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
    if linear not in OWN_KERNEL_FLAGS:
        return (f"the linear kernel is {linear!r}, whose blocking (oneDNN's, or MKL's sgemm in float32) depends on the "
                "step's row count; nanopaged's amx and dpbf16 kernels, which compute each row alone, need a bfloat16 "
                "model on a CPU with AMX-BF16 or AVX512-BF16 (cpu_linear='amx' or 'dpbf16')")
    if layers != "fused" or attention != "cpu":
        return ("the torch reference layers and attention (cpu_kernels='reference', attention_backend="
                f"{attention!r}) are not held to it: the torch backend pads decode rows into groups by length")
    return None


def choose_linear(name: str, device: str, dtype: str) -> str:
    """auto: nanopaged's kernel for the CPU's best bfloat16 unit (amx, else dpbf16) where it builds,
    oneDNN's packed kernel where neither does, the reference elsewhere."""
    units = bf16_matrix_units()
    can_pack = device == "cpu" and dtype == "bfloat16" and bool(units)
    if name == "auto":
        if not can_pack:
            return "reference"
        return next((k for k in ("amx", "dpbf16") if OWN_KERNEL_FLAGS[k] in units and own_kernel_builds(k)), "packed")
    if name == "packed" and device == "cpu" and dtype == "float32":
        return name         # oneDNN's float32 kernel, as vLLM's CPU build runs float32: asked for, never auto
    if name in ("packed", "dpbf16", "amx") and not can_pack:
        raise ValueError(f"cpu_linear={name!r} needs device='cpu', dtype='bfloat16' (packed: or 'float32') and a "
                         f"CPU with bfloat16 matrix units (amx_bf16 or avx512_bf16); got device={device!r}, "
                         f"dtype={dtype!r}, units {units or 'none'}")
    if name in OWN_KERNEL_FLAGS and OWN_KERNEL_FLAGS[name] not in units:
        raise ValueError(f"cpu_linear={name!r} needs the CPU's flag {OWN_KERNEL_FLAGS[name]}; this CPU has {units}")
    if name in OWN_KERNEL_FLAGS and not own_kernel_builds(name):
        why = build.available() or "the kernels were built without its instructions"
        raise ValueError(f"cpu_linear={name!r}: {why}")
    return name


# nanopaged's own bfloat16 kernels and the CPU flag each needs (cpu/linear.py: KERNELS)
OWN_KERNEL_FLAGS = {"amx": "amx_bf16", "dpbf16": "avx512_bf16"}


def own_kernel_builds(name: str) -> bool:
    """Whether the kernels built here with `name`'s instructions (the build's has_amx_bf16, has_avx512_bf16)."""
    return build.available() is None and bool(getattr(build.cpu_ops(), "has_" + OWN_KERNEL_FLAGS[name]))


def choose_layers(name: str, device: str, linear: str, attention_backend: str, block_size: int = 16) -> str:
    """auto: fused where the linears are packed in bfloat16 (the path that is not held to Hugging Face
    token for token anyway), the attention backend is left to choose and the kernels build; a mixture of
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
