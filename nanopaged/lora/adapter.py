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
request that asks for the adapter is added. So is a folder that is no adapter at all: each config
field nanopaged reads is checked for its type and range, the files' sizes are checked before they
are read (MAX_CONFIG_BYTES; max_weights_bytes, from the model's shapes and the rank), the tensors'
names and shapes are checked in the safetensors header before any tensor is read, and whatever else
reading raises becomes the request's ValueError. docs/12_lora.md, "Limits".
"""
from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass, field
from functools import cached_property
from pathlib import Path

import torch
import xxhash
from safetensors import SafetensorError
from safetensors.torch import load_file

from nanopaged.lora.request import LoRARequest
from nanopaged.models.config import ModelConfig

CONFIG_FILE, WEIGHTS_FILE = "adapter_config.json", "adapter_model.safetensors"
KEY = re.compile(r"layers\.(\d+)\.(self_attn|mlp)\.(\w+)\.lora_([AB])\.weight$")
UNSUPPORTED = {      # adapter_config.json fields that ask for more than an update of the projections
    "use_dora": "DoRA (use_dora)", "modules_to_save": "modules_to_save (whole modules trained beside the adapter)",
    "rank_pattern": "a rank per module (rank_pattern)", "alpha_pattern": "an alpha per module (alpha_pattern)",
}
# Sizes checked before a byte is read: peft writes a config of about a kilobyte, and a safetensors header
# holds a name, a dtype, a shape and two offsets per tensor; its tensors can be no bigger than the model's
# projections allow at the adapter's rank, in the widest float (FLOAT_BYTES' largest).
MAX_CONFIG_BYTES = 1 << 20
HEADER_BYTES_PER_TENSOR, HEADER_BYTES_EXTRA = 1024, 1 << 16
FLOAT_BYTES = {"F64": 8, "F32": 4, "F16": 2, "BF16": 2, "F8_E4M3": 1, "F8_E5M2": 1}   # safetensors' names


def projection_shapes(m: ModelConfig) -> dict[str, tuple[int, int]]:
    """(in_features, out_features) of each projection an adapter may target, as Hugging Face names them."""
    q, kv = m.num_attention_heads * m.head_dim, m.num_key_value_heads * m.head_dim
    return {"q_proj": (m.hidden_size, q), "k_proj": (m.hidden_size, kv), "v_proj": (m.hidden_size, kv),
            "o_proj": (q, m.hidden_size), "gate_proj": (m.hidden_size, m.intermediate_size),
            "up_proj": (m.hidden_size, m.intermediate_size), "down_proj": (m.intermediate_size, m.hidden_size)}


def max_weights_bytes(m: ModelConfig, rank: int) -> int:
    """The largest adapter_model.safetensors an adapter of `rank` can be on this model: every projection
    of every layer adapted, A (rank, in) and B (out, rank) in the widest float, and a header for each."""
    values = rank * sum(i + o for i, o in projection_shapes(m).values()) * m.num_hidden_layers
    return values * max(FLOAT_BYTES.values()) + max_header_bytes(m) + 8


def max_header_bytes(m: ModelConfig) -> int:
    return HEADER_BYTES_PER_TENSOR * 2 * len(projection_shapes(m)) * m.num_hidden_layers + HEADER_BYTES_EXTRA


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

    @cached_property
    def digest(self) -> str:
        """Its update by content: lora_int_id is a number a caller picks, the same in another run for another adapter."""
        h = xxhash.xxh3_128(repr((self.rank, self.scaling, sorted(self.weights))).encode())
        for key in sorted(self.weights):
            for w in self.weights[key]:
                h.update(w.detach().cpu().contiguous().view(torch.uint8).numpy())
        return h.hexdigest()


def load_adapter(request: LoRARequest, m: ModelConfig, max_lora_rank: int, dtype: torch.dtype) -> LoRAAdapter:
    """The adapter `request` names, checked against the model; a ValueError that names what does not fit."""
    try:
        return _load_adapter(request, m, max_lora_rank, dtype)
    except ValueError:
        raise
    except Exception as e:      # whatever a hostile or broken folder raises costs its request, never the engine
        raise ValueError(f"LoRA adapter {request.lora_name!r} cannot be read: {type(e).__name__}: "
                         f"{_short(e)}") from None


def _load_adapter(request: LoRARequest, m: ModelConfig, max_lora_rank: int, dtype: torch.dtype) -> LoRAAdapter:
    folder, name = Path(request.lora_path), request.lora_name
    rank, scaling = check_config(read_config(folder, name), name, max_lora_rank)
    path = weights_path(folder, name)
    shapes = read_header(path, name, max_weights_bytes(m, rank), max_header_bytes(m))
    check_shapes(shapes, m, rank, name)                     # before any tensor is read
    tensors = read_weights(path, name)
    return LoRAAdapter(name, request.lora_int_id, rank, scaling, pair_up(tensors, m, rank, dtype, name))


def read_config(folder: Path, name: str) -> object:
    """adapter_config.json's JSON, its size checked first."""
    path = folder / CONFIG_FILE
    if not path.is_file():
        raise ValueError(f"LoRA adapter {name!r}: no {CONFIG_FILE} in {str(folder)!r} (a PEFT adapter folder, "
                         "as peft's save_pretrained writes it)")
    size = path.stat().st_size
    if size > MAX_CONFIG_BYTES:
        raise ValueError(f"LoRA adapter {name!r}: {CONFIG_FILE} is {size} bytes, more than the "
                         f"{MAX_CONFIG_BYTES} an adapter config may be")
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError, RecursionError) as e:      # RecursionError: nesting deeper than json reads
        raise ValueError(f"LoRA adapter {name!r}: {CONFIG_FILE} cannot be read ({type(e).__name__}: "
                         f"{_short(e)})") from None


def check_config(config: object, name: str, max_lora_rank: int) -> tuple[int, float]:
    """(rank, scaling) from adapter_config.json, each field nanopaged reads checked for its type and
    range, and refused for what nanopaged cannot apply."""
    if not isinstance(config, dict):
        raise ValueError(f"LoRA adapter {name!r}: {CONFIG_FILE} must hold a JSON object, got a JSON "
                         f"{type(config).__name__}")
    get = lambda key, kind, default, what: _typed(config, key, kind, default, what, name)  # noqa: E731
    peft_type = get("peft_type", str, "LORA", "a string")
    if peft_type != "LORA":
        raise ValueError(f"LoRA adapter {name!r} is a {peft_type[:100]} adapter; nanopaged applies LoRA only")
    rank = get("r", int, None, "a positive integer")
    if rank is None or rank < 1:
        raise ValueError(f"LoRA adapter {name!r}: {CONFIG_FILE}'s r must be a positive integer, got {rank!r}")
    if rank > max_lora_rank:
        raise ValueError(f"LoRA adapter {name!r} has rank {rank}, above max_lora_rank={max_lora_rank}")
    alpha = get("lora_alpha", (int, float), rank, "a positive number")
    if not math.isfinite(alpha) or alpha <= 0:
        raise ValueError(f"LoRA adapter {name!r}: {CONFIG_FILE}'s lora_alpha must be a positive finite number, "
                         f"got {alpha!r}")
    rslora = get("use_rslora", bool, False, "true or false")
    get("target_modules", (str, list), None, "a module name or a list of them")
    kinds = {"use_dora": (bool, "true or false"), "modules_to_save": (list, "a list"),
             "rank_pattern": (dict, "an object"), "alpha_pattern": (dict, "an object")}
    for key, what in UNSUPPORTED.items():
        if get(key, kinds[key][0], None, kinds[key][1]):
            raise ValueError(f"LoRA adapter {name!r} uses {what}, which nanopaged does not support")
    bias = get("bias", str, "none", "a string")
    if bias != "none":
        raise ValueError(f"LoRA adapter {name!r} trains biases (bias={_short(bias)}), which nanopaged does "
                         "not support")
    return rank, alpha / math.sqrt(rank) if rslora else alpha / rank


def _typed(config: dict, key: str, kind, default, what: str, name: str):
    """config[key] if it is of `kind` (None or absent: `default`); a ValueError naming the field if not."""
    value = config.get(key)
    if value is None:
        return default
    kinds = kind if isinstance(kind, tuple) else (kind,)
    if not isinstance(value, kinds) or (isinstance(value, bool) and bool not in kinds):   # JSON's true is no number
        raise ValueError(f"LoRA adapter {name!r}: {CONFIG_FILE}'s {key} must be {what}, got {_short(value)}")
    return value


def weights_path(folder: Path, name: str) -> Path:
    path = folder / WEIGHTS_FILE
    if not path.is_file():
        other = ", ".join(sorted(p.name for p in folder.glob("adapter_model*"))) or "none"
        raise ValueError(f"LoRA adapter {name!r}: no {WEIGHTS_FILE} in {str(folder)!r} (found: {other}; nanopaged "
                         "reads safetensors only)")
    return path


def read_header(path: Path, name: str, max_bytes: int, max_header: int) -> dict[str, tuple[str, tuple]]:
    """{tensor name: (dtype, shape)} from the safetensors header (8 bytes of its length, then JSON),
    the file's and the header's sizes checked before either is read."""
    size = path.stat().st_size
    if size > max_bytes:
        raise ValueError(f"LoRA adapter {name!r}: {WEIGHTS_FILE} is {size} bytes, more than the {max_bytes} "
                         "an adapter of its rank can hold on this model")
    broken = f"LoRA adapter {name!r}: {WEIGHTS_FILE} cannot be read"
    with path.open("rb") as f:
        head = f.read(8)
        length = int.from_bytes(head, "little") if len(head) == 8 else -1
        if not 0 < length <= min(max_header, size - 8):
            raise ValueError(f"{broken} (its header says {length} bytes; a safetensors header within the file, "
                             f"at most {max_header} bytes, was expected)")
        try:
            header = json.loads(f.read(length))
        except (ValueError, RecursionError) as e:
            raise ValueError(f"{broken} (its header: {type(e).__name__}: {_short(e)})") from None
    if not isinstance(header, dict):
        raise ValueError(f"{broken} (its header is no JSON object)")
    shapes = {}
    for key, entry in header.items():
        if key == "__metadata__":
            continue
        dtype = entry.get("dtype") if isinstance(entry, dict) else None
        shape = entry.get("shape") if isinstance(entry, dict) else None
        if not isinstance(dtype, str) or not isinstance(shape, list) or not all(
                type(n) is int and n >= 0 for n in shape):
            raise ValueError(f"{broken} (tensor {_short(key)} has no dtype and shape)")
        shapes[key] = (dtype, tuple(shape))
    return shapes


def check_shapes(shapes: dict[str, tuple[str, tuple]], m: ModelConfig, rank: int, name: str) -> None:
    """Every tensor an A or B of a projection the model has, in a float dtype, paired, of the shape the
    model and the rank need."""
    projections, found = projection_shapes(m), {}
    for key, (dtype, shape) in shapes.items():
        hit = KEY.search(key)
        if hit is None:
            raise ValueError(f"LoRA adapter {name!r} holds {_short(key)}; nanopaged applies adapters to the decoder "
                             f"layers' {', '.join(projections)} only (no embedding, lm_head or DoRA weights)")
        layer, proj, which = int(hit.group(1)), hit.group(3), hit.group(4)
        if proj not in projections or layer >= m.num_hidden_layers:
            raise ValueError(f"LoRA adapter {name!r} targets {_short(key)}, which this model "
                             f"({m.num_hidden_layers} layers; {', '.join(projections)}) does not have")
        if dtype not in FLOAT_BYTES:
            raise ValueError(f"LoRA adapter {name!r}: {key!r} is {_short(dtype)}, not a floating-point tensor")
        found.setdefault((layer, proj), {})[which] = shape
    for (layer, proj), pair in sorted(found.items()):
        if set(pair) != {"A", "B"}:
            raise ValueError(f"LoRA adapter {name!r}: layer {layer}'s {proj} has lora_{''.join(pair)} without its pair")
        fan_in, fan_out = projections[proj]
        if pair["A"] != (rank, fan_in) or pair["B"] != (fan_out, rank):
            raise ValueError(f"LoRA adapter {name!r}: layer {layer}'s {proj} has A {pair['A']} and B "
                             f"{pair['B']}; this model needs A ({rank}, {fan_in}) and B ({fan_out}, {rank})")
    if not found:
        raise ValueError(f"LoRA adapter {name!r} holds no LoRA weights")


def read_weights(path: Path, name: str) -> dict[str, torch.Tensor]:
    try:
        return load_file(path)
    except (SafetensorError, OSError, ValueError) as e:
        raise ValueError(f"LoRA adapter {name!r}: {WEIGHTS_FILE} cannot be read ({_short(e)})") from None


def pair_up(tensors: dict[str, torch.Tensor], m: ModelConfig, rank: int, dtype: torch.dtype,
            name: str) -> dict[tuple[int, str], tuple[torch.Tensor, torch.Tensor]]:
    """Each (layer, projection)'s A and B in the model's dtype; the header said what they are (check_shapes),
    and safetensors holds each tensor to its header."""
    found = {}
    for key, t in tensors.items():
        hit = KEY.search(key)
        found.setdefault((int(hit.group(1)), hit.group(3)), {})[hit.group(4)] = t.to(dtype).contiguous()
    return {where: (pair["A"], pair["B"]) for where, pair in sorted(found.items())}


def _short(value, most: int = 200) -> str:
    """A value's repr for an error message, cut: a hostile file's field may be megabytes long."""
    text = repr(value) if not isinstance(value, BaseException) else str(value)
    return text if len(text) <= most else text[:most] + "..."
