"""Load Hugging Face safetensors weights into the model, shard by shard.

Hugging Face stores q_proj, k_proj and v_proj (and gate_proj, up_proj) separately; our
model fuses each group into one Linear (`qkv_proj`, `gate_up_proj`). A checkpoint tensor
whose name ends in one of the fused parts is copied into its slice of the fused weight,
as vLLM's `packed_modules_mapping` does. Every parameter must be loaded exactly once.
(docs/05_model_runner_and_kernels.md)
"""
from __future__ import annotations

import math
from pathlib import Path

import torch
from safetensors import safe_open
from torch import nn

from nanopaged.models.classifier import classification_head

# checkpoint name part -> (fused module name, shard index)
PACKED = {
    "q_proj": ("qkv_proj", 0), "k_proj": ("qkv_proj", 1), "v_proj": ("qkv_proj", 2),
    "gate_proj": ("gate_up_proj", 0), "up_proj": ("gate_up_proj", 1),
}
# Mixtral's names for the same parts (its MoE block and each expert's gate, down and up projections)
RENAMED = {"block_sparse_moe": "mlp", "w1": "gate_proj", "w2": "down_proj", "w3": "up_proj"}
# a mixture's experts stacked in one tensor per projection, (experts, rows, cols), as transformers holds them:
# expert e's slice is its fused gate_up (gate rows, then up rows) or its down
STACKED_EXPERTS = ("gate_up_proj", "down_proj")


def load_weights(model: nn.Module, folder: str | Path, read=None, rename=None) -> None:
    """`read(f, name)`: what to load of checkpoint tensor `name` in the open file `f`; by default
    all of it (the tensor-parallel loader reads one rank's slice). `rename(name)`: the model's name
    for it, or None to leave it unread; by default the name itself (under expert parallelism a
    rank's own experts are numbered from 0, and the others' are not its to read)."""
    read = read or (lambda f, name: f.get_tensor(name))
    rename = rename or (lambda name: name)
    folder = Path(folder)
    files = sorted(folder.glob("*.safetensors"))
    if not files:
        raise ValueError(f"no *.safetensors weights in {folder}")
    classification_head(model)                # a classifier's score head in place of lm_head (models/classifier.py)
    params = dict(model.named_parameters())   # a tied lm_head appears once, as embed_tokens
    loaded: set[tuple[str, int | None]] = set()
    scales: dict[str, torch.Tensor] = {}      # int8 weights' scales per output row (models/shipped_int8.py)
    for file in files:
        try:
            _load_file(file, params, loaded, model, read, rename, scales)
        except ValueError as e:
            raise ValueError(f"{file}: {e}") from e
        except Exception as e:   # a truncated or foreign file fails in safetensors' own way
            raise ValueError(f"{file} is not a readable safetensors file: {type(e).__name__}: {e}") from e
    if scales and not getattr(getattr(model, "config", None), "shipped_int8", False):
        raise ValueError(f"{folder} holds int8 weight scales ({next(iter(scales))}_scale) but its config.json "
                         "declares no int8 W8A8 quantization_config")
    for name, scale in scales.items():      # after every file: a weight and its scale may lie in two
        _load_one(params, name, scale, set(), model, scale=True)
    missing = sorted(f"{n}[shard {s}]" if s is not None else n
                     for n, s in _expected(model, params) - loaded)
    if missing:
        raise ValueError(f"weights missing from {folder}: {', '.join(missing[:5])}"
                         + (f" and {len(missing) - 5} more" if len(missing) > 5 else ""))


def weight_bytes(folder: str | Path, dtype: torch.dtype) -> int:
    """The bytes the checkpoint's tensors take in `dtype`, from the files' headers alone (nothing is read)."""
    total = 0
    for file in sorted(Path(folder).glob("*.safetensors")):
        try:
            with safe_open(str(file), framework="pt") as f:
                total += sum(math.prod(f.get_slice(name).get_shape()) for name in f.keys())
        except Exception:       # an unreadable file is load_weights' to report, by name
            continue
    return total * dtype.itemsize


# a vision-language checkpoint read for its language model (models/config.py: LANGUAGE_MODEL_OF): where its
# language model's weights are, and what else it holds (the vision tower, multi-token-prediction layers)
LANGUAGE_MODEL_PREFIX, NOT_THE_LANGUAGE_MODEL = "model.language_model.", ("model.visual.", "mtp.")


def _load_file(file: Path, params, loaded, model, read, rename, scales) -> None:
    text_only = getattr(getattr(model, "config", None), "language_model_of", None)
    # checkpoint name prefix -> ours: a text-only reading's, or a model's laid out unlike its checkpoint (idefics3.py)
    prefixes = {LANGUAGE_MODEL_PREFIX: "model."} if text_only else getattr(model, "checkpoint_prefixes", {})
    with safe_open(str(file), framework="pt") as f:
        for stored in f.keys():
            if stored.endswith("rotary_emb.inv_freq") or (text_only and stored.startswith(NOT_THE_LANGUAGE_MODEL)):
                continue                   # recomputed, never a real weight; or not the language model's
            name = next((new + stored[len(old):] for old, new in prefixes.items() if stored.startswith(old)), stored)
            name = rename(name)
            if name is None:
                continue                   # not this model's to hold (another rank's expert)
            if name.endswith(".weight_scale"):
                scales[name.removesuffix("_scale")] = read(f, stored)
                continue
            if name == "lm_head.weight" and "lm_head.weight" not in params:
                continue                   # tied embeddings: the checkpoint may still carry it
            _load_one(params, name, read(f, stored), loaded, model)


def _load_one(params, name, tensor, loaded, model, scale: bool = False) -> None:
    """Copy `tensor` into its parameter (its slice of a fused one); `scale`: it is the scale of those rows,
    kept beside them (_keep_scale)."""
    parts = [RENAMED.get(part, part) for part in name.split(".")]
    name = ".".join(parts)
    if parts[-2:-1] == ["experts"] and parts[-1] in STACKED_EXPERTS:
        for e, weight in enumerate(tensor):
            target = ".".join(parts[:-1] + [str(e), parts[-1], "weight"])
            _copy(params, target, weight, slice(None))
            loaded.update({(target, 0), (target, 1)} if parts[-1] == "gate_up_proj" else {(target, None)})
        return
    for i, part in enumerate(parts):
        if part in PACKED:
            fused, shard = PACKED[part]
            target = ".".join(parts[:i] + [fused] + parts[i + 1:])
            module = model.get_submodule(".".join(parts[:i]))
            sizes = getattr(module, fused).shard_sizes
            start = sum(sizes[:shard])
            rows = slice(start, start + sizes[shard])
            _keep_scale(model, target, rows, tensor) if scale else _copy(params, target, tensor, rows)
            loaded.add((target, shard))
            return
    _keep_scale(model, name, slice(None), tensor) if scale else _copy(params, name, tensor, slice(None))
    loaded.add((name, None))


def _keep_scale(model, weight_name: str, rows: slice, scale: torch.Tensor) -> None:
    """An int8 weight's scale per output row (models/shipped_int8.py), kept where its layer keeps its
    weight: a float32 buffer `weight_scale` of the layer, which the quantize stage reads beside the codes."""
    layer = model.get_submodule(weight_name.rpartition(".")[0])
    if not hasattr(layer, "weight_scale"):
        layer.register_buffer("weight_scale", torch.zeros(layer.weight.shape[0], dtype=torch.float32))
    if layer.weight_scale[rows].numel() != scale.numel():
        raise ValueError(f"shape of {weight_name + '_scale'!r}: checkpoint {tuple(scale.shape)}, model "
                         f"{layer.weight_scale[rows].numel()} rows")
    layer.weight_scale[rows] = scale.reshape(-1).float()


def _expected(model, params) -> set:
    """(parameter, shard) pairs a complete checkpoint fills; shard None for unfused ones."""
    expected = set()
    for name in params:
        module_name, _, param_name = name.rpartition(".")
        sizes = getattr(model.get_submodule(module_name), "shard_sizes", None)
        if sizes is None or param_name not in ("weight", "bias"):
            expected.add((name, None))
        else:
            expected.update((name, s) for s in range(len(sizes)))
    return expected


def _copy(params, name, tensor, rows: slice) -> None:
    if name not in params:
        raise ValueError(f"checkpoint tensor {name!r} has no place in the model")
    param = params[name]
    dst = param.data[rows]
    if dst.shape != tensor.shape:
        raise ValueError(f"shape of {name!r}: checkpoint {tuple(tensor.shape)}, model {tuple(dst.shape)}")
    with torch.no_grad():
        dst.copy_(tensor.to(dst.dtype))
