"""A LoRA adapter read from a PEFT folder, as `peft` saves it, into plain tensors.

LoRA (Hu et al., 2021) leaves a linear's weight W as it is and adds a low-rank update:
W x + (B (A x)) * scaling, A (r, in), B (out, r), scaling = lora_alpha / r (or / sqrt(r) with
`use_rslora`). PEFT saves adapter_config.json (r, lora_alpha, the target modules, ...) and
adapter_model.safetensors, one A and one B per adapted module:

    base_model.model.model.layers.{i}.self_attn.q_proj.lora_A.weight   (r, hidden)
    base_model.model.model.layers.{i}.self_attn.q_proj.lora_B.weight   (heads x head_dim, r)

What nanopaged's model can apply is an update to the seven projections of a decoder layer
(q/k/v/o, gate/up/down). Anything else an adapter may hold (DoRA's magnitudes, `modules_to_save`,
embedding or lm_head adapters, a bias, ranks per module, a rank above `max_lora_rank`, a module the
model lacks or a shape that does not fit it) is a ValueError that names it, raised before the
request that asks for the adapter is added.
"""
from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass, field
from pathlib import Path

import torch

from nanopaged.lora.request import LoRARequest
from nanopaged.models.config import ModelConfig

CONFIG_FILE, WEIGHTS_FILE = "adapter_config.json", "adapter_model.safetensors"
KEY = re.compile(r"layers\.(\d+)\.(self_attn|mlp)\.(\w+)\.lora_([AB])\.weight$")
UNSUPPORTED = {      # adapter_config.json fields that ask for more than an update of the projections
    "use_dora": "DoRA (use_dora)", "modules_to_save": "modules_to_save (whole modules trained beside the adapter)",
    "rank_pattern": "a rank per module (rank_pattern)", "alpha_pattern": "an alpha per module (alpha_pattern)",
}


def projection_shapes(m: ModelConfig) -> dict[str, tuple[int, int]]:
    """(in_features, out_features) of each projection an adapter may target, as Hugging Face names them."""
    q, kv = m.num_attention_heads * m.head_dim, m.num_key_value_heads * m.head_dim
    return {"q_proj": (m.hidden_size, q), "k_proj": (m.hidden_size, kv), "v_proj": (m.hidden_size, kv),
            "o_proj": (q, m.hidden_size), "gate_proj": (m.hidden_size, m.intermediate_size),
            "up_proj": (m.hidden_size, m.intermediate_size), "down_proj": (m.intermediate_size, m.hidden_size)}


@dataclass
class LoRAAdapter:
    """One adapter's update, per (layer, projection): A (r, in) and B (out, r), in the model's dtype."""
    name: str
    int_id: int
    rank: int
    scaling: float
    weights: dict[tuple[int, str], tuple[torch.Tensor, torch.Tensor]] = field(repr=False)

    @property
    def num_bytes(self) -> int:
        return sum(a.nbytes + b.nbytes for a, b in self.weights.values())


def load_adapter(request: LoRARequest, m: ModelConfig, max_lora_rank: int, dtype: torch.dtype) -> LoRAAdapter:
    """The adapter `request` names, checked against the model; a ValueError that names what does not fit."""
    folder = Path(request.lora_path)
    config = read_config(folder, request.lora_name)
    rank, alpha = config.get("r"), config.get("lora_alpha", config.get("r"))
    if not isinstance(rank, int) or rank < 1:
        raise ValueError(f"LoRA adapter {request.lora_name!r}: adapter_config.json's r must be a positive integer, "
                         f"got {rank!r}")
    if rank > max_lora_rank:
        raise ValueError(f"LoRA adapter {request.lora_name!r} has rank {rank}, above max_lora_rank={max_lora_rank}")
    scaling = alpha / math.sqrt(rank) if config.get("use_rslora") else alpha / rank
    tensors = read_weights(folder, request.lora_name)
    return LoRAAdapter(request.lora_name, request.lora_int_id, rank, scaling,
                       pair_up(tensors, m, rank, dtype, request.lora_name))


def read_config(folder: Path, name: str) -> dict:
    """adapter_config.json, refused for what nanopaged cannot apply."""
    if not (folder / CONFIG_FILE).is_file():
        raise ValueError(f"LoRA adapter {name!r}: no {CONFIG_FILE} in {str(folder)!r} (a PEFT adapter folder, "
                         "as peft's save_pretrained writes it)")
    try:
        config = json.loads((folder / CONFIG_FILE).read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise ValueError(f"LoRA adapter {name!r}: {CONFIG_FILE} cannot be read ({e})") from None
    if config.get("peft_type", "LORA") != "LORA":
        raise ValueError(f"LoRA adapter {name!r} is a {config['peft_type']} adapter; nanopaged applies LoRA only")
    for key, what in UNSUPPORTED.items():
        if config.get(key):
            raise ValueError(f"LoRA adapter {name!r} uses {what}, which nanopaged does not support")
    if config.get("bias", "none") != "none":
        raise ValueError(f"LoRA adapter {name!r} trains biases (bias={config['bias']!r}), which nanopaged does "
                         "not support")
    return config


def read_weights(folder: Path, name: str) -> dict[str, torch.Tensor]:
    from safetensors import SafetensorError
    from safetensors.torch import load_file
    path = folder / WEIGHTS_FILE
    if not path.is_file():
        other = ", ".join(sorted(p.name for p in folder.glob("adapter_model*"))) or "none"
        raise ValueError(f"LoRA adapter {name!r}: no {WEIGHTS_FILE} in {str(folder)!r} (found: {other}; nanopaged "
                         "reads safetensors only)")
    try:
        return load_file(path)
    except (SafetensorError, OSError, ValueError) as e:
        raise ValueError(f"LoRA adapter {name!r}: {WEIGHTS_FILE} cannot be read ({e})") from None


def pair_up(tensors: dict[str, torch.Tensor], m: ModelConfig, rank: int, dtype: torch.dtype,
            name: str) -> dict[tuple[int, str], tuple[torch.Tensor, torch.Tensor]]:
    """Each (layer, projection)'s A and B, their shapes checked against the model's projection."""
    shapes, found = projection_shapes(m), {}
    for key, t in tensors.items():
        hit = KEY.search(key)
        if hit is None:
            raise ValueError(f"LoRA adapter {name!r} holds {key!r}; nanopaged applies adapters to the decoder "
                             f"layers' {', '.join(shapes)} only (no embedding, lm_head or DoRA weights)")
        layer, proj, which = int(hit.group(1)), hit.group(3), hit.group(4)
        if proj not in shapes or layer >= m.num_hidden_layers:
            raise ValueError(f"LoRA adapter {name!r} targets {key!r}, which this model "
                             f"({m.num_hidden_layers} layers; {', '.join(shapes)}) does not have")
        if not t.is_floating_point():
            raise ValueError(f"LoRA adapter {name!r}: {key!r} is {t.dtype}, not a floating-point tensor")
        found.setdefault((layer, proj), {})[which] = t
    weights = {}
    for (layer, proj), pair in sorted(found.items()):
        if set(pair) != {"A", "B"}:
            raise ValueError(f"LoRA adapter {name!r}: layer {layer}'s {proj} has lora_{''.join(pair)} without its pair")
        a, b = pair["A"], pair["B"]
        fan_in, fan_out = shapes[proj]
        if a.shape != (rank, fan_in) or b.shape != (fan_out, rank):
            raise ValueError(f"LoRA adapter {name!r}: layer {layer}'s {proj} has A {tuple(a.shape)} and B "
                             f"{tuple(b.shape)}; this model needs A ({rank}, {fan_in}) and B ({fan_out}, {rank})")
        weights[(layer, proj)] = (a.to(dtype).contiguous(), b.to(dtype).contiguous())
    if not weights:
        raise ValueError(f"LoRA adapter {name!r} holds no LoRA weights")
    return weights
