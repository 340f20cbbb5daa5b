"""A checkpoint that ships its linears in 8 bits: compressed-tensors' int8 W8A8, as vLLM loads it.

llm-compressor writes such a checkpoint: each decoder linear's weight as int8 codes with a float scale
per output feature (`<name>.weight`, `<name>.weight_scale`), and config.json's `quantization_config`
saying how the rows are to be quantized at run time. nanopaged runs one scheme of it, the one its W8A8
layer computes (cpu/quantized_linear.py: W8A8Linear): weights symmetric per channel, activations
symmetric per token, dynamic. The loader puts each weight's codes in the layer's weight (integers up to
127 are exact in bfloat16) and its scales in a buffer `weight_scale` beside it (models/loader.py), and
the quantize stage builds the W8A8 layer from both: the codes as they ship, the scales as every W8A8
layer keeps them (float16, where vLLM keeps float32). Nothing is rotated (cpu/rotation.py).
"""
from __future__ import annotations

WEIGHTS = {"num_bits": 8, "type": "int", "symmetric": True, "strategy": "channel"}
ACTIVATIONS = {"num_bits": 8, "type": "int", "symmetric": True, "strategy": "token", "dynamic": True}


def shipped_int8(cfg: dict) -> bool:
    """Whether config.json says the checkpoint ships compressed-tensors' int8 W8A8; a ValueError naming
    what it ships where that is any other quantization."""
    q = cfg.get("quantization_config")
    if not q:
        return False
    groups = list((q.get("config_groups") or {}).values())
    scheme = groups[0] if len(groups) == 1 else {}
    if (q.get("quant_method") == "compressed-tensors" and q.get("format", "int-quantized") == "int-quantized"
            and _matches(scheme.get("weights"), WEIGHTS) and _matches(scheme.get("input_activations"), ACTIVATIONS)
            and set(q.get("ignore") or []) <= {"lm_head"}):
        return True
    raise ValueError(f"quantization_config {q.get('quant_method')!r} (format {q.get('format')!r}, "
                     f"{len(groups)} config group(s), ignore {q.get('ignore')}): nanopaged loads compressed-tensors' "
                     f"int8 W8A8 only: weights {WEIGHTS}, input activations {ACTIVATIONS}, at most lm_head ignored")


def _matches(given: dict | None, wanted: dict) -> bool:
    return isinstance(given, dict) and all(given.get(k, False if k == "dynamic" else None) == v for k, v in wanted.items())
