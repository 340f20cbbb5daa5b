"""A GGUF file's quantized weights as they ship, for the 4- and 8-bit kernels (quantization="gguf").

The demo model ships as llama.cpp's GGUF format: each linear weight in blocks of 32 values along
its input axis, 4 bits a value plus a float16 scale (Q4_0: w = (q - 8) d) and a minimum (Q4_1:
w = q d + m). The converter (models/demo_model.py) dequantizes them once into a float32
safetensors folder; with quantization="gguf" the engine loads that folder as usual and then
puts the file's own 4-bit codes back under the linears (`nanopaged/cpu/quantized_linear.py: Int4Linear`):
Q4_1's w = q d + m is the kernel's (q - 8) scale + zero with scale = d and zero = m + 8 d.

Two things are undone on the way, as transformers' GGUF loader undoes them: llama.cpp stores
q_proj and k_proj with the rows of each head's two rotary halves interleaved (`unpermute_rows`),
and it names tensors its own way (`GGUF_NAMES`). The output matrix (the lm_head; the
demo model ties it to the embeddings, `token_embd`) ships as Q8_0, 8 bits and a float16 scale per
block of 32, and runs as shipped too (`Q8Linear`), as do decoder linears a file stores as Q8_0
(a "Q8_0" GGUF's). A linear stored in any other type (F16, K-quants, ...), or whose stacked
parts mix 4- and 8-bit types, keeps the dequantized weights the folder holds, and is listed by
`load_gguf_linears`.
"""
from __future__ import annotations

import numpy as np
import torch

from nanopaged.models.config import ModelConfig

BLOCK = 32                    # values per GGUF block, Q4_0, Q4_1 and Q8_0 alike
# our fused module -> the GGUF tensors whose rows it stacks, in order
GGUF_NAMES = {"self_attn.qkv_proj": ("attn_q", "attn_k", "attn_v"), "self_attn.o_proj": ("attn_output",),
              "mlp.gate_up_proj": ("ffn_gate", "ffn_up"), "mlp.down_proj": ("ffn_down",)}


def q4_blocks(raw: np.ndarray, kind: str) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(codes (out, in) int32 in 0..15, scale (out, in / 32), zero (out, in / 32)) of a Q4_0 or
    Q4_1 tensor's raw bytes (out, blocks x bytes), with w = (q - 8) * scale + zero."""
    size = {"Q4_0": 18, "Q4_1": 20}[kind]
    out = raw.shape[0]
    blocks = raw.reshape(out, -1, size)
    d = blocks[:, :, 0:2].copy().view(np.float16)[..., 0].astype(np.float32)
    if kind == "Q4_1":
        m, qs = blocks[:, :, 2:4].copy().view(np.float16)[..., 0].astype(np.float32), blocks[:, :, 4:]
        zero = m + 8 * d
    else:
        qs, zero = blocks[:, :, 2:], np.zeros_like(d)
    # a block's 16 bytes: the low nibbles are its values 0..15, the high nibbles 16..31
    codes = np.concatenate([qs & 0x0F, qs >> 4], axis=2).reshape(out, -1).astype(np.int32)
    return codes, d, zero


def q8_blocks(raw: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(codes (out, in) int32 in -128..127, scale (out, in / 32)) of a Q8_0 tensor's raw bytes
    (out, blocks x 34): a float16 scale d, then 32 signed bytes; w = q * d."""
    blocks = raw.reshape(raw.shape[0], -1, 34)
    d = blocks[:, :, 0:2].copy().view(np.float16)[..., 0].astype(np.float32)
    codes = blocks[:, :, 2:].copy().view(np.int8).reshape(raw.shape[0], -1).astype(np.int32)
    return codes, d


def unpermute_rows(n_rows: int, n_heads: int) -> np.ndarray:
    """The GGUF row each Hugging Face row of q_proj / k_proj comes from: llama.cpp's converter
    interleaves the two rotary halves of every head (transformers: reverse_permute_weights)."""
    return np.arange(n_rows).reshape(n_heads, n_rows // n_heads // 2, 2).swapaxes(2, 1).reshape(n_rows)


def find_gguf(folder: str) -> str:
    """The GGUF file a model folder came from (a .gguf in it, or the link models/demo_model.py
    writes), or a ValueError saying where to put one."""
    from pathlib import Path

    from nanopaged.models.demo_model import source_gguf
    files = sorted(Path(folder).glob("*.gguf"))
    found = files[0] if files else source_gguf(Path(folder))
    if found is None:
        raise ValueError(f"quantization='gguf' needs the model's GGUF file: pass the .gguf file itself as the "
                         f"model, or put it (or a link to it) in {folder}")
    return str(found)


def load_gguf_linears(path: str, cfg: ModelConfig) -> tuple[dict, list[str]]:
    """{"model.layers.{i}.{module}": (codes, scale, zero)} for every fused linear whose tensors are
    all Q4_0/Q4_1, or (codes, scale) where they are all Q8_0, rows unpermuted and stacked as the
    module stacks them; "lm_head": (codes, scale) when the output matrix (`output.weight`, or the
    tied `token_embd.weight`) ships as Q8_0; and the names of the linears left dense (another
    type), for the load's log."""
    import gguf
    reader = gguf.GGUFReader(path)
    tensors = {t.name: t for t in reader.tensors}
    heads = {"attn_q": cfg.num_attention_heads, "attn_k": cfg.num_key_value_heads}
    found, dense = {}, []
    for i in range(cfg.num_hidden_layers):
        for module, parts in GGUF_NAMES.items():
            ts = [tensors[f"blk.{i}.{p}.weight"] for p in parts]
            kinds = {t.tensor_type.name for t in ts}
            if not (kinds <= {"Q4_0", "Q4_1"} or kinds == {"Q8_0"}):     # one kernel for the stacked parts
                dense.append(f"model.layers.{i}.{module} ({', '.join(t.tensor_type.name for t in ts)})")
                continue
            pieces = []
            for part, t in zip(parts, ts):
                raw = np.asarray(t.data)
                blocks = q8_blocks(raw) if kinds == {"Q8_0"} else q4_blocks(raw, t.tensor_type.name)
                if part in heads:
                    rows = unpermute_rows(raw.shape[0], heads[part])
                    blocks = tuple(b[rows] for b in blocks)
                pieces.append(blocks)
            found[f"model.layers.{i}.{module}"] = tuple(
                torch.from_numpy(np.concatenate([p[j] for p in pieces])) for j in range(len(pieces[0])))
    output = tensors.get("output.weight", tensors.get("token_embd.weight"))
    if output is not None and output.tensor_type.name == "Q8_0":
        found["lm_head"] = tuple(torch.from_numpy(a) for a in q8_blocks(np.asarray(output.data)))
    elif output is not None:
        dense.append(f"lm_head ({output.tensor_type.name})")
    return found, dense
