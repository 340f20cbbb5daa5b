"""Quantized linear layers on CPU: 4-bit and 8-bit weights (`quantization=`), at every row count.

A decode step streams every weight once, so on a CPU its matmuls cost what their bytes cost:
8-bit weights are half of bfloat16's, 4-bit ones a quarter. Two kernels run such weights:

  nanopaged's (nanopaged/cpu/csrc/linear_quantized.cpp: linear_quantized), on a CPU with
    AVX512-VNNI: blocks of `group_size` inputs with a float16 scale d (and, 4-bit, a minimum m)
    each: w = q d + m (GGUF's Q4_1 as it ships; Q4_0 and int4-at-load map onto it) and w = q d
    (GGUF's Q8_0, and int8-at-load). Each row is quantized too, per block of inputs, to 8 bits
    (`quantize_activations` is the reference), so a block's products are exact integer sums, 64
    per instruction: llama.cpp's Q8 dot products, vLLM's CPU int8 (W8A8) kernels.
  torch's, elsewhere: weight-only, widened in registers: `aten::_weight_int4pack_mm_for_cpu`
    (groups of `group_size`, w = (q - 8) scale + zero, scales in the activations' dtype) and
    `aten::_weight_int8pack_mm` (one scale per output feature, w = q scale).

Either runs at every row count, so a request sees the same weights whatever runs beside it (batch
invariance needs exactly that), and the dense weights are not kept: what stays in the model's
dtype are the embeddings (a step reads one row of them per token), the norms, and the lm_head
"unless the file says otherwise" (a GGUF's own 8-bit output matrix is the file's choice); so does
the KV cache unless kv_cache_dtype says otherwise. docs/01_kv_cache_arithmetic.md, "What a weight
costs", has the bytes and what they cost in quality.

    gguf   the GGUF file's own blocks as they ship (models/gguf.py): Q4_0/Q4_1 and Q8_0 decoder
           layers (Q8_0 on nanopaged's kernel only), a mixture's experts each its slice of the
           stacked tensors, and the output matrix where it ships as Q8_0 (the demo model's, tied
           to its embeddings)
    int4   the checkpoint quantized at load: min/max per group of `quantization_group_size`
    int8   the checkpoint quantized at load: absmax per group of `quantization_group_size` (torch's
           kernel: per output feature)
    w8a8   the checkpoint quantized at load: absmax per output feature, and each row at run time
           per token (W8A8Linear): one integer sum over the whole row, no scale inside it; the hidden
           states rotated first (cpu/rotation.py), so that a row's few large features do not set its scale
"""
from __future__ import annotations

import logging
import re

import torch
from torch import nn

from nanopaged.cpu.linear import CppLinear
from nanopaged.cpu.build import available, cpu_ops
from nanopaged.cpu.rotation import rotate_hidden_states
from nanopaged.models.gguf import BLOCK, load_gguf_linears

logger = logging.getLogger(__name__)

LAYER_LINEARS = ("self_attn.qkv_proj", "self_attn.o_proj", "mlp.gate_up_proj", "mlp.down_proj")


def quantized_ops_available() -> bool:
    aten = torch.ops.aten
    return all(hasattr(aten, op) for op in ("_weight_int4pack_mm_for_cpu", "_convert_weight_to_int4pack_for_cpu",
                                            "_weight_int8pack_mm"))


def nanopaged_kernels():
    """nanopaged's compiled kernels where they built with AVX512-VNNI, else None (torch's weight-only
    kernels then: the plain loops of a build without VNNI are slower than they are)."""
    return cpu_ops() if available() is None and cpu_ops().has_avx512_vnni else None


def kernel_name(method: str | None = None) -> str:
    if method == "w8a8":
        ops = nanopaged_kernels()
        return ("torch's integer matmul" if ops is None else "nanopaged's on AMX-INT8" if ops.has_amx_int8
                else "nanopaged's on AVX512-VNNI") + ", rows quantized to 8 bits per token"
    return ("nanopaged's, rows quantized to 8 bits per block (AVX512-VNNI)" if nanopaged_kernels() is not None
            else "torch's weight-only")


# ---- the layers ------------------------------------------------------------------------
class QuantizedLinear(CppLinear):
    """A quantized weight in place of a dense layer, run at every row count."""
    ops = None                  # nanopaged's kernels, where they run it: the fused layer loop then runs it in C++

    def __init__(self, dense: nn.Linear) -> None:
        super().__init__()
        self.in_features, self.out_features = dense.in_features, dense.out_features
        self.bias = None if dense.bias is None else dense.bias.detach()

    def forward(self, x: torch.Tensor) -> torch.Tensor:      # x: (tokens, in_features)
        y = self.quantized_matmul(x)
        return y if self.bias is None else y + self.bias

    def describe_cpp(self, describe):
        """In C++ where nanopaged's kernels hold the codes; else None (torch's kernel, called back)."""
        if self.ops is None:
            return None
        lin = self.ops.Linear()
        lin.out_features, lin.kind = self.out_features, self.ops.LinearKind.QUANTIZED
        lin.packed, lin.group, lin.bits = self.packed, self.group_size, self.bits
        lin.bias = torch.empty(0) if self.bias is None else self.bias
        return lin


class Int4Linear(QuantizedLinear):
    bits = 4

    def __init__(self, dense: nn.Linear, codes: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor,
                 group_size: int) -> None:
        """codes (out, in) in 0..15; scale and zero (out, in / group_size): w = (q - 8) scale + zero."""
        super().__init__(dense)
        self.group_size = group_size
        self.ops = nanopaged_kernels()
        if self.ops is not None:      # w = q d + m: d = scale, m = zero - 8 scale (GGUF's Q4_1 d and m, exactly)
            self.packed = self.ops.pack_quantized(codes, scale, zero - 8 * scale, group_size, 4)
            self.scale_zero = torch.empty(0)
            return
        self.packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(codes.to(torch.int32).contiguous(), 1)
        dtype = dense.weight.dtype
        self.scale_zero = torch.stack([scale.t(), zero.t()], dim=-1).to(dtype).contiguous()   # (groups, out, 2)

    def quantized_matmul(self, x: torch.Tensor) -> torch.Tensor:
        if self.ops is not None:
            return self.ops.linear_quantized(x, self.packed, self.out_features, self.group_size, 4)
        return torch.ops.aten._weight_int4pack_mm_for_cpu(x, self.packed, self.group_size, self.scale_zero)

    @property
    def quantized_bytes(self) -> int:
        return self.packed.nbytes + self.scale_zero.nbytes


class Q8Linear(QuantizedLinear):
    """8-bit codes in blocks of `group_size` inputs with a float16 scale each (GGUF's Q8_0, as it
    ships; int8 at load): nanopaged's kernel only."""
    bits = 8

    def __init__(self, dense: nn.Linear, codes: torch.Tensor, scale: torch.Tensor, group_size: int) -> None:
        super().__init__(dense)
        self.group_size = group_size
        self.ops = nanopaged_kernels()
        self.packed = self.ops.pack_quantized(codes, scale, torch.empty(0), group_size, 8)

    def quantized_matmul(self, x: torch.Tensor) -> torch.Tensor:
        return self.ops.linear_quantized(x, self.packed, self.out_features, self.group_size, 8)

    @property
    def quantized_bytes(self) -> int:
        return self.packed.nbytes


class W8A8Linear(QuantizedLinear):
    """W8A8 (vLLM's CPU int8 scheme): 8-bit weights with one scale per output feature, each row
    quantized to 8 bits at run time with one scale of its own, and one integer sum over the whole row
    (no scale inside it): y = (sum_i q_i xq_i) d dx, a single float multiply at the end. On AMX's int8
    tiles (csrc/linear_amx.cpp) where the CPU has them and a row is whole steps of 64, else on
    nanopaged's VNNI kernel (G = in_features: one block the row's length), else torch's integer matmul
    (_int_mm). Each sums integers exactly, so any order gives the same sum, and the three the same bits:
    a row's bits depend neither on its batch nor on the kernel."""
    bits = 8

    def __init__(self, dense: nn.Linear) -> None:
        super().__init__(dense)
        self.group_size = dense.in_features
        shipped = getattr(dense, "weight_scale", None)   # a checkpoint's own: its codes in the weight (models/loader.py)
        codes, scale = ((dense.weight.detach().round(), shipped) if shipped is not None
                        else int8_codes(dense.weight.detach(), self.group_size))
        self.scale = scale.half().float().reshape(-1)      # the VNNI kernel keeps float16 scales: every path does
        self.ops = nanopaged_kernels()
        self.amx = self.ops is not None and self.ops.has_amx_int8 and self.in_features % 64 == 0
        self.codes_t = torch.empty(0, dtype=torch.int8)
        if self.amx:
            self.packed = self.ops.pack_amx_int8(codes, self.scale)
        elif self.ops is not None:
            self.packed = self.ops.pack_quantized(codes, self.scale[:, None], torch.empty(0), self.group_size, 8)
        else:
            self.packed, self.codes_t = torch.empty(0, dtype=torch.uint8), codes.to(torch.int8).t().contiguous()

    def quantized_matmul(self, x: torch.Tensor) -> torch.Tensor:
        if self.amx:
            return self.ops.linear_amx_int8(x, self.packed, self.out_features)
        if self.ops is not None:
            return self.ops.linear_quantized(x, self.packed, self.out_features, self.group_size, 8)
        return w8a8_reference(x, self.codes_t, self.scale)

    def describe_cpp(self, describe):
        lin = super().describe_cpp(describe)
        if lin is not None and self.amx:
            lin.kind = self.ops.LinearKind.AMX_INT8
        return lin

    @property
    def quantized_bytes(self) -> int:
        return self.packed.nbytes + self.codes_t.nbytes + (0 if self.ops is not None else self.scale.nbytes)


def w8a8_reference(x: torch.Tensor, codes_t: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """y = (xq codes^T) (dx d) in torch: each row quantized alone (quantize_activations, one block the
    row's length), the integer matmul exact, the scales' product in float32 as the kernel forms it."""
    xq, dx = quantize_activations(x, x.shape[1])
    sums = torch._int_mm(xq.to(torch.int8), codes_t).float()
    return (sums * (scale[None, :] * dx)).to(x.dtype)


class Int8Linear(QuantizedLinear):
    """torch's weight-only int8 kernel, where nanopaged's did not build with VNNI."""

    def __init__(self, dense: nn.Linear, codes: torch.Tensor, scale: torch.Tensor) -> None:
        """codes (out, in) in -128..127; scale (out,) or (out, 1): w = q scale."""
        super().__init__(dense)
        self.codes = codes.to(torch.int8).contiguous()
        self.scale = scale.reshape(-1).to(dense.weight.dtype)

    def quantized_matmul(self, x: torch.Tensor) -> torch.Tensor:
        return torch.ops.aten._weight_int8pack_mm(x, self.codes, self.scale)

    @property
    def quantized_bytes(self) -> int:
        return self.codes.nbytes + self.scale.nbytes


# ---- quantizing a float weight ----------------------------------------------------------
def int4_codes(weight: torch.Tensor, group_size: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Asymmetric 4-bit codes per group of `group_size` inputs: (codes, scale, zero), with the
    group's minimum at q = 0 and its maximum at q = 15 (the round-to-nearest min/max method)."""
    out_f, in_f = weight.shape
    w = weight.float().reshape(out_f, in_f // group_size, group_size)
    lo, hi = w.amin(dim=-1), w.amax(dim=-1)
    scale = ((hi - lo) / 15).clamp(min=1e-10)
    codes = ((w - lo[..., None]) / scale[..., None]).round().clamp(0, 15)
    return codes.reshape(out_f, in_f), scale, lo + 8 * scale


def int8_codes(weight: torch.Tensor, group_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Symmetric 8-bit codes per group of `group_size` inputs: (codes, scale (out, in / group_size)),
    each group's absmax mapped to 127 (group_size = in_features: one scale per output feature)."""
    out_f, in_f = weight.shape
    w = weight.float().reshape(out_f, in_f // group_size, group_size)
    scale = (w.abs().amax(dim=-1) / 127).clamp(min=1e-10)
    return (w / scale[..., None]).round().clamp(-128, 127).reshape(out_f, in_f), scale


def quantize_activations(x: torch.Tensor, group_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """What nanopaged's kernel does to the rows it multiplies: per block of `group_size` inputs,
    codes in -127..127 (the block's largest |x| mapped to 127, rounded half to even) and their
    scale; x ~ codes * scale. The reference the tests hold the kernel to."""
    rows, in_f = x.shape
    blocks = x.float().reshape(rows, in_f // group_size, group_size)
    amax = blocks.abs().amax(dim=-1, keepdim=True)
    inv = torch.where(amax > 0, torch.full_like(amax, 127).div(amax), 0)     # `127 / amax` would multiply by 1 / amax
    return (blocks * inv).round().reshape(rows, in_f), (amax / 127).squeeze(-1)


# ---- the model --------------------------------------------------------------------------
NO_Q8_KERNEL = "Q8_0: nanopaged's kernels did not build with AVX512-VNNI here"     # 8-bit blocks run on them only


def quantized_linear(method: str, dense: nn.Linear, group_size: int, shipped: tuple | None) -> QuantizedLinear:
    """The quantized layer for one dense one: the file's blocks (`shipped`), or its weight quantized."""
    if method == "gguf":
        q8 = len(shipped) == 2                           # Q8_0: (codes, scale); Q4: (codes, scale, zero)
        return (Q8Linear if q8 else Int4Linear)(dense, *shipped, group_size)
    weight = dense.weight.detach()
    if method == "w8a8":
        return W8A8Linear(dense)
    if method == "int4":
        return Int4Linear(dense, *int4_codes(weight, group_size), group_size)
    if nanopaged_kernels() is not None:
        return Q8Linear(dense, *int8_codes(weight, group_size), group_size)
    return Int8Linear(dense, *int8_codes(weight, weight.shape[1]))


def check_scales_shipped(model: nn.Module) -> None:
    """A checkpoint that ships int8 W8A8 holds codes in every decoder linear's weight: each needs its scales."""
    for i, layer in enumerate(model.model.layers):
        for name in LAYER_LINEARS:
            if not hasattr(layer.get_submodule(name), "weight_scale"):
                raise ValueError(f"the checkpoint ships int8 W8A8, but model.layers.{i}.{name} has no weight_scale")


def layer_linears(layer: nn.Module) -> list[str]:
    """A decoder layer's linears to quantize: LAYER_LINEARS, and in a mixture of experts each expert's
    gate_up and down (models/moe.py; its router stays dense: one row per expert)."""
    if not hasattr(layer.mlp, "experts"):
        return list(LAYER_LINEARS)
    return [*LAYER_LINEARS[:2], *(f"mlp.experts.{e}.{p}" for e in range(len(layer.mlp.experts))
                                  for p in ("gate_up_proj", "down_proj"))]


def quantize_linears(model: nn.Module, method: str, group_size: int, gguf_path: str | None) -> dict:
    """Swap the decoder layers' linears for quantized ones, in place (before the dense weights are
    packed), the dense weights dropped. Returns what the load log and get_stats report: the method,
    the kernel, how many layers, their bytes, and the linears left dense."""
    if not quantized_ops_available():
        logger.warning("quantization=%r: this torch has no weight-only int4/int8 CPU kernels; "
                       "running the dense weights", method)
        return {"quantization": None, "quantized_linears": 0, "quantized_bytes": 0, "left_dense": [],
                "weights_replaced": 0}
    found, left_dense = {}, []
    if method == "w8a8" and not model.config.shipped_int8:       # shipped codes run as they ship
        rotate_hidden_states(model)
    if method == "w8a8" and model.config.shipped_int8:
        check_scales_shipped(model)
    if method == "gguf":
        found, left_dense = load_gguf_linears(gguf_path, model.config)
        group_size = BLOCK
    swapped = []
    if "lm_head" in found and nanopaged_kernels() is not None:     # the file's 8-bit output matrix
        model.lm_head = Q8Linear(model.lm_head, *found["lm_head"], group_size)
        swapped.append(model.lm_head)
    elif "lm_head" in found:
        left_dense.append(f"lm_head ({NO_Q8_KERNEL})")
    for i, layer in enumerate(model.model.layers):
        for name in layer_linears(layer):
            full = f"model.layers.{i}.{name}"
            if method == "gguf" and full not in found:
                continue
            if method == "gguf" and found[full][0].shape != layer.get_submodule(name).weight.shape:
                raise ValueError(f"{gguf_path}: its {full} is {tuple(found[full][0].shape)}, the model's "
                                 f"{tuple(layer.get_submodule(name).weight.shape)}: the GGUF file is not this model's")
            if method == "gguf" and len(found[full]) == 2 and nanopaged_kernels() is None:
                listed = f"{re.sub(r'[.]experts[.][0-9]+[.]', '.experts.*.', full)} ({NO_Q8_KERNEL})"
                if listed not in left_dense:                 # a layer's experts once: they share a type
                    left_dense.append(listed)
                continue
            new = quantized_linear(method, layer.get_submodule(name), group_size, found.get(full))
            owner, _, attr = name.rpartition(".")
            setattr(layer.get_submodule(owner), attr, new)
            swapped.append(new)
    return {"quantization": method, "kernel": kernel_name(method), "quantized_linears": len(swapped),
            "quantized_bytes": sum(m.quantized_bytes for m in swapped), "left_dense": left_dense,
            "weights_replaced": sum(m.in_features * m.out_features for m in swapped)}
