"""Weight-only quantized linear layers on CPU: 4-bit and 8-bit weights (`quantization=`).

A decode step streams every weight once, so on a CPU its matmuls cost what their bytes cost:
4-bit weights are a quarter of bfloat16's. Two kernels unpack such weights inside the multiply:

  nanopaged's (nanopaged/cpu/csrc/linear_quantized.cpp: linear_quantized), on a CPU with AVX-512:
    blocks of `group_size` inputs with a float16 scale d and minimum m each, w = q d + m (GGUF's
    Q4_1 as it ships; Q4_0 and int4-at-load map onto it), and 8-bit blocks w = q d (GGUF's Q8_0);
    the codes are widened in registers, on VDPBF16PS for bfloat16 rows where the CPU has AVX512-BF16.
  torch's, elsewhere: `aten::_weight_int4pack_mm_for_cpu` (groups of `group_size`, w = (q - 8)
    scale + zero, scales in the activations' dtype) and, for int8, `aten::_weight_int8pack_mm`
    (one scale per output feature, w = q scale).

They win for a few rows; from a few rows up the packed bfloat16 kernels (cpu/linear.py) run near
the matmul peak instead, and the 4-bit ones do not. Batch-invariant (the default where the fast path
holds it: cpu/choose.py), a layer runs its quantized weight at every row count, so a request is
computed with the same numbers whatever runs beside it, and keeps no dense twin. Without it, a
layer keeps both and picks by the step's row count: the quantized weight for at most
ROWS_FOR_QUANTIZED rows (one request at a time, a few streams), the dense weight for more; a
request's answer then depends on how many others share its steps
(docs/01_kv_cache_arithmetic.md, "What a weight costs", has the figures and the memory each holds).

    gguf   the GGUF file's own blocks as they ship (models/gguf.py): Q4_0/Q4_1 and Q8_0 decoder
           layers (Q8_0 on nanopaged's kernel only), and the output matrix where it ships as Q8_0
           (the demo model's, tied to its embeddings)
    int4   the checkpoint quantized at load: min/max per group of `quantization_group_size`
    int8   the checkpoint quantized at load: absmax per output feature

Otherwise the embeddings, the lm_head, the norms and the sampler keep the model's dtype ("unless
the file says otherwise": a GGUF's own 8-bit output matrix is the file's choice), and so does the
KV cache.
"""
from __future__ import annotations

import logging

import torch
from torch import nn

logger = logging.getLogger(__name__)

ROWS_FOR_QUANTIZED = 6     # at most this many rows: the quantized kernel; more: the dense one (measured: docs/01)
LAYER_LINEARS = ("self_attn.qkv_proj", "self_attn.o_proj", "mlp.gate_up_proj", "mlp.down_proj")


def quantized_ops_available() -> bool:
    aten = torch.ops.aten
    return all(hasattr(aten, op) for op in ("_weight_int4pack_mm_for_cpu", "_convert_weight_to_int4pack_for_cpu",
                                            "_weight_int8pack_mm"))


def nanopaged_kernels():
    """nanopaged's compiled kernels where they built with AVX-512, else None (torch's int4 kernel
    then: the plain loops of a build without AVX-512 are slower than it)."""
    from nanopaged.cpu.build import available, cpu_ops
    return cpu_ops() if available() is None and cpu_ops().has_avx512 else None


# ---- the layers ------------------------------------------------------------------------
class QuantizedLinear(nn.Module):
    """A quantized weight; unless batch-invariant, also the layer it replaced (`dense`), for steps
    of more than `rows_for_quantized` rows."""
    cpp_kernel = "quantized"    # with nanopaged's kernels (`ops`), the fused layer loop runs it in C++ (fused.py)
    ops = None

    def __init__(self, dense: nn.Linear, keep_dense: bool = True) -> None:
        super().__init__()
        self.in_features, self.out_features = dense.in_features, dense.out_features
        self.shard_sizes = getattr(dense, "shard_sizes", None)
        self.bias = None if dense.bias is None else dense.bias.detach()
        self.dense = dense if keep_dense else None
        self.rows_for_quantized = ROWS_FOR_QUANTIZED if keep_dense else None     # None: every step

    def forward(self, x: torch.Tensor) -> torch.Tensor:      # x: (tokens, in_features)
        if self.dense is not None and x.shape[0] > self.rows_for_quantized:
            return self.dense(x)
        y = self.quantized_matmul(x)
        return y if self.bias is None else y + self.bias


class Int4Linear(QuantizedLinear):
    bits = 4

    def __init__(self, dense: nn.Linear, codes: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor,
                 group_size: int, keep_dense: bool = True) -> None:
        """codes (out, in) in 0..15; scale and zero (out, in / group_size): w = (q - 8) scale + zero."""
        super().__init__(dense, keep_dense)
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
    ships): nanopaged's kernel only."""
    bits = 8

    def __init__(self, dense: nn.Linear, codes: torch.Tensor, scale: torch.Tensor, group_size: int,
                 keep_dense: bool = True) -> None:
        super().__init__(dense, keep_dense)
        self.group_size = group_size
        self.ops = nanopaged_kernels()
        self.packed = self.ops.pack_quantized(codes, scale, torch.empty(0), group_size, 8)

    def quantized_matmul(self, x: torch.Tensor) -> torch.Tensor:
        return self.ops.linear_quantized(x, self.packed, self.out_features, self.group_size, 8)

    @property
    def quantized_bytes(self) -> int:
        return self.packed.nbytes


class Int8Linear(QuantizedLinear):
    def __init__(self, dense: nn.Linear, codes: torch.Tensor, scale: torch.Tensor, keep_dense: bool = True) -> None:
        """codes (out, in) in -128..127; scale (out,): w = q scale."""
        super().__init__(dense, keep_dense)
        self.codes = codes.to(torch.int8).contiguous()
        self.scale = scale.to(dense.weight.dtype)

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


def int8_codes(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Symmetric 8-bit codes per output feature: (codes, scale), the absmax mapped to 127."""
    w = weight.float()
    scale = (w.abs().amax(dim=1) / 127).clamp(min=1e-10)
    return (w / scale[:, None]).round().clamp(-128, 127), scale


# ---- the model --------------------------------------------------------------------------
NO_Q8_KERNEL = "Q8_0: nanopaged's kernels did not build with AVX-512 here"     # 8-bit blocks run on them only


def quantize_linears(model: nn.Module, method: str, group_size: int, gguf_path: str | None,
                     batch_invariant: bool = False) -> dict:
    """Swap the decoder layers' linears for quantized ones, in place (before the dense weights are
    packed: the packing then reaches the `dense` inside each, where one is kept). Returns what the
    load log and get_stats report: the method, how many layers, their bytes, the linears left dense,
    and the most rows a step may have to run the quantized kernel (None: every step, batch-invariant)."""
    if not quantized_ops_available():
        logger.warning("quantization=%r: this torch has no weight-only int4/int8 CPU kernels; "
                       "running the dense weights", method)
        return {"quantization": None, "quantized_linears": 0, "quantized_bytes": 0, "left_dense": [],
                "rows_for_quantized": 0}
    keep = not batch_invariant
    found, left_dense = {}, []
    if method == "gguf":
        from nanopaged.models.gguf import BLOCK, load_gguf_linears
        cfg = model.config
        found, left_dense = load_gguf_linears(gguf_path, cfg)
        group_size = BLOCK
    swapped = []
    if "lm_head" in found and nanopaged_kernels() is not None:     # the file's 8-bit output matrix
        model.lm_head = Q8Linear(model.lm_head, *found["lm_head"], BLOCK, keep_dense=keep)
        swapped.append(model.lm_head)
    elif "lm_head" in found:
        left_dense.append(f"lm_head ({NO_Q8_KERNEL})")
    for i, layer in enumerate(model.model.layers):
        for name in LAYER_LINEARS:
            full = f"model.layers.{i}.{name}"
            dense = layer.get_submodule(name)
            if method == "gguf":
                if full not in found:
                    continue
                q8 = len(found[full]) == 2                       # Q8_0: (codes, scale); Q4: (codes, scale, zero)
                if q8 and nanopaged_kernels() is None:
                    left_dense.append(f"{full} ({NO_Q8_KERNEL})")
                    continue
                new = (Q8Linear if q8 else Int4Linear)(dense, *found[full], group_size, keep_dense=keep)
            elif method == "int4":
                new = Int4Linear(dense, *int4_codes(dense.weight.detach(), group_size), group_size, keep_dense=keep)
            else:
                new = Int8Linear(dense, *int8_codes(dense.weight.detach()), keep_dense=keep)
            owner, _, attr = name.rpartition(".")
            setattr(layer.get_submodule(owner), attr, new)
            swapped.append(new)
    return {"quantization": method, "quantized_linears": len(swapped),
            "quantized_bytes": sum(m.quantized_bytes for m in swapped), "left_dense": left_dense,
            "rows_for_quantized": ROWS_FOR_QUANTIZED if keep else None}
