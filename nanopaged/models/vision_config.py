"""A vision-language model's vision numbers from its config.json, checked before a weight is read.

models/config.py keeps them in ModelConfig.vision, beside the text model's, and reads this module only for
such a model; no torch here.
"""
from __future__ import annotations


def idefics3_vision(cfg: dict, vocab_size: int) -> dict:
    """Idefics3 / SmolVLM: the tower's (models/siglip.py) and the connector's numbers (models/idefics3.py):
    {"vision_config": config.json's, "scale_factor", "image_token_id"}."""
    v = cfg.get("vision_config") or {}
    for name in ("hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads", "image_size",
                 "patch_size"):
        if not isinstance(v.get(name), int) or isinstance(v.get(name), bool) or v[name] < 1:
            raise ValueError(f"vision_config field {name!r} must be a positive integer, got {v.get(name)!r}")
    if v.get("hidden_act", "gelu_pytorch_tanh") != "gelu_pytorch_tanh":
        raise ValueError(f"unsupported vision_config hidden_act {v['hidden_act']!r}; only 'gelu_pytorch_tanh'")
    if v["hidden_size"] % v["num_attention_heads"]:
        raise ValueError(f"vision_config num_attention_heads={v['num_attention_heads']} must divide "
                         f"hidden_size={v['hidden_size']}")
    side, scale = v["image_size"] // v["patch_size"], cfg.get("scale_factor", 2)
    if not isinstance(scale, int) or scale < 1 or side % scale:
        raise ValueError(f"scale_factor must be a positive integer dividing the {side} patches along a tile's "
                         f"side (image_size / patch_size), got {scale!r}")
    image_token_id = cfg.get("image_token_id")
    if not isinstance(image_token_id, int) or not 0 <= image_token_id < vocab_size:
        raise ValueError(f"image_token_id must be a token id below vocab_size={vocab_size}, got "
                         f"{image_token_id!r}")
    vision_config = {"num_channels": 3, "layer_norm_eps": 1e-6, **v}
    return {"vision_config": vision_config, "scale_factor": scale, "image_token_id": image_token_id}
