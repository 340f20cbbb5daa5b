"""ModelConfig: the few numbers of a Hugging Face config.json that the engine needs.

Read once from the model folder; the runner sizes the KV cache from it (bytes per token =
2 x layers x kv heads x head dim x bytes per value) and the model builds its layers
from it. Anything this engine cannot run faithfully is refused here, by name.
docs/01_kv_cache_arithmetic.md does the arithmetic.
"""
from __future__ import annotations

import json
from dataclasses import dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING

from nanopaged.models.classifier import CLASSIFICATION_ARCHITECTURES, labels
from nanopaged.models.hybrid import HybridConfig, granite_hybrid, qwen3_5_hybrid
from nanopaged.models.shipped_int8 import shipped_int8
from nanopaged.models.vision_config import idefics3_vision

if TYPE_CHECKING:
    from nanopaged.models.moe import MoEConfig

# architecture -> (q/k/v projections have a bias, RMSNorm on q and k: per "head", over the whole "projection")
SUPPORTED_ARCHITECTURES = {
    "LlamaForCausalLM": (False, False),
    "MistralForCausalLM": (False, False),
    "Qwen2ForCausalLM": (True, False),
    "Qwen3ForCausalLM": (False, "head"),
    "Qwen3MoeForCausalLM": (False, "head"),          # mixtures of experts: models/moe.py
    "MixtralForCausalLM": (False, False),
    "OlmoeForCausalLM": (False, "projection"),
    "Qwen3_5ForCausalLM": (False, "head"),          # a hybrid: DeltaNet beside gated attention (models/qwen3_5.py)
    "GraniteMoeHybridForCausalLM": (False, False),  # a hybrid: Mamba-2 beside attention (models/granite_hybrid.py)
}
MOE_ARCHITECTURES = ("Qwen3MoeForCausalLM", "MixtralForCausalLM", "OlmoeForCausalLM")
SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3")
# config.json's model_type -> its architecture, for configs that leave out "architectures"
MODEL_TYPES = {"llama": "LlamaForCausalLM", "mistral": "MistralForCausalLM", "qwen2": "Qwen2ForCausalLM",
               "qwen3": "Qwen3ForCausalLM", "qwen3_moe": "Qwen3MoeForCausalLM", "mixtral": "MixtralForCausalLM",
               "olmoe": "OlmoeForCausalLM", "qwen3_5_text": "Qwen3_5ForCausalLM",
               "granitemoehybrid": "GraniteMoeHybridForCausalLM"}
# a vision-language checkpoint read for its language model alone: architecture -> the language model's, which
# config.json's text_config describes; its weights carry this prefix, and the vision tower's are skipped
LANGUAGE_MODEL_OF = {"Qwen3_5ForConditionalGeneration": "Qwen3_5ForCausalLM"}
# a vision-language model run whole, images and all (multimodal/): architecture -> its language model's
VISION_LANGUAGE_MODELS = {"Idefics3ForConditionalGeneration": "LlamaForCausalLM",
                          "Qwen2_5_VLForConditionalGeneration": "Qwen2ForCausalLM"}
HYBRID_ARCHITECTURES = {"Qwen3_5ForCausalLM": qwen3_5_hybrid,       # config.json -> HybridConfig (models/hybrid.py)
                        "GraniteMoeHybridForCausalLM": granite_hybrid}
REQUIRED_FIELDS = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads")


@dataclass
class ModelConfig:
    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    rope_scaling: dict | None
    max_position_embeddings: int
    tie_word_embeddings: bool
    qkv_bias: bool
    qk_norm: bool | str                 # False, "head" or "projection"
    eos_token_ids: tuple[int, ...]
    moe: MoEConfig | None = None        # the experts of a mixture-of-experts model (models/moe.py)
    shipped_int8: bool = False          # its linears ship as int8 W8A8 (models/shipped_int8.py)
    hybrid: HybridConfig | None = None  # linear-attention layers beside attention ones (models/hybrid.py)
    partial_rotary_factor: float = 1.0  # the share of each head's dims that RoPE rotates (the rest pass)
    attn_output_gate: bool = False      # q_proj also yields a gate: attention's output x sigmoid(gate) (Qwen3.5)
    mrope_section: tuple[int, ...] | None = None   # M-RoPE: head_dim / 2 frequencies cut into (t, h, w) sections
    language_model_of: str | None = None  # read from this vision-language checkpoint, its language model only
    vision: dict | None = None          # a vision-language model's vision config, its tower and connector (multimodal/)
    num_labels: int | None = None       # a *ForSequenceClassification: its classes (None: a causal LM)
    id2label: dict[int, str] | None = None   # class index -> its name, from config.json

    @classmethod
    def from_folder(cls, folder: str | Path) -> "ModelConfig":
        folder = Path(folder)
        cfg = read_json(folder / "config.json")
        try:
            return cls.from_dict(cfg, _generation_eos(folder) or _as_tuple(cfg.get("eos_token_id")))
        except ValueError as e:
            raise ValueError(f"{folder / 'config.json'}: {e}") from e

    @classmethod
    def from_dict(cls, cfg: dict, eos_token_ids: tuple[int, ...] = ()) -> "ModelConfig":
        archs = cfg.get("architectures") or [MODEL_TYPES.get(cfg.get("model_type"), "?")]
        if isinstance(archs, list) and archs and archs[0] in LANGUAGE_MODEL_OF:     # its text part, as a text model
            text = {"tie_word_embeddings": cfg.get("tie_word_embeddings", False), **(cfg.get("text_config") or {}),
                    "architectures": [LANGUAGE_MODEL_OF[archs[0]]]}
            return replace(cls.from_dict(text, eos_token_ids or _as_tuple(text.get("eos_token_id"))),
                           language_model_of=archs[0])
        if isinstance(archs, list) and archs and archs[0] in VISION_LANGUAGE_MODELS:    # the tower beside the text
            return _vision_language(cls, cfg, archs[0], eos_token_ids)
        if not isinstance(archs, list):
            raise ValueError(f"'architectures' must be a list of class names, got {archs!r}")
        if archs and archs[0] in CLASSIFICATION_ARCHITECTURES:    # its decoder as the LM's (models/classifier.py)
            base = cls.from_dict({**cfg, "architectures": [CLASSIFICATION_ARCHITECTURES[archs[0]]]}, eos_token_ids)
            return replace(base, architecture=archs[0], **labels(cfg))
        arch = archs[0]
        if arch not in SUPPORTED_ARCHITECTURES:
            raise ValueError(f"unsupported model architecture {arch!r}; nanopaged runs "
                             f"{', '.join([*SUPPORTED_ARCHITECTURES, *CLASSIFICATION_ARCHITECTURES])}")
        if cfg.get("hidden_act", "silu") != "silu":
            raise ValueError(f"unsupported hidden_act {cfg['hidden_act']!r}; only 'silu'")
        window = cfg.get("sliding_window")
        if window is not None and cfg.get("use_sliding_window", arch in ("MistralForCausalLM", "MixtralForCausalLM")):
            raise ValueError(f"sliding-window attention (sliding_window={window}) is not supported")
        qkv_bias, qk_norm = SUPPORTED_ARCHITECTURES[arch]
        for name in REQUIRED_FIELDS:
            if not isinstance(cfg.get(name), int) or isinstance(cfg.get(name), bool) or cfg[name] < 1:
                raise ValueError(f"field {name!r} must be a positive integer, got {cfg.get(name)!r}")
        kv_heads = cfg.get("num_key_value_heads")
        if kv_heads is not None and (not isinstance(kv_heads, int) or kv_heads < 1
                                     or cfg["num_attention_heads"] % kv_heads):
            raise ValueError(f"field 'num_key_value_heads' must divide num_attention_heads="
                             f"{cfg['num_attention_heads']}, got {kv_heads!r}")
        heads = cfg["num_attention_heads"]
        rope_theta, rope_scaling = _rope(cfg)
        return cls(
            architecture=arch,
            vocab_size=cfg["vocab_size"],
            hidden_size=cfg["hidden_size"],
            intermediate_size=cfg["intermediate_size"],
            num_hidden_layers=cfg["num_hidden_layers"],
            num_attention_heads=heads,
            num_key_value_heads=cfg.get("num_key_value_heads") or heads,
            head_dim=cfg.get("head_dim") or cfg["hidden_size"] // heads,
            rms_norm_eps=cfg.get("rms_norm_eps", 1e-6),
            rope_theta=rope_theta,
            rope_scaling=rope_scaling,
            max_position_embeddings=cfg.get("max_position_embeddings", 2048),
            tie_word_embeddings=cfg.get("tie_word_embeddings", False),
            qkv_bias=cfg.get("attention_bias", qkv_bias),
            qk_norm=qk_norm,
            eos_token_ids=eos_token_ids,
            moe=_moe(cfg, arch),
            shipped_int8=shipped_int8(cfg),
            hybrid=HYBRID_ARCHITECTURES[arch](cfg) if arch in HYBRID_ARCHITECTURES else None,
            partial_rotary_factor=float((cfg.get("rope_parameters") or {}).get(
                "partial_rotary_factor", cfg.get("partial_rotary_factor", 1.0))),
            attn_output_gate=arch == "Qwen3_5ForCausalLM",
        )

    def kv_bytes_per_token(self, bytes_per_value: int) -> int:
        """K and V, every attention layer: 2 x layers x kv heads x head dim x bytes per value."""
        return 2 * self.num_attention_layers * self.num_key_value_heads * self.head_dim * bytes_per_value

    @property
    def num_attention_layers(self) -> int:
        return len(self.hybrid.attention_layers) if self.hybrid else self.num_hidden_layers


def _vision_language(cls, cfg: dict, arch: str, eos_token_ids: tuple[int, ...]) -> ModelConfig:
    """Its language model (text_config in transformers 5's files, the top level in the hub's older Qwen2.5-VL
    ones; the head tied as the top level says, as transformers reads it) and its vision numbers."""
    text = dict(cfg.get("text_config") or cfg)
    text.update(architectures=[VISION_LANGUAGE_MODELS[arch]], tie_word_embeddings=cfg.get("tie_word_embeddings", False))
    if arch == "Idefics3ForConditionalGeneration":
        language = cls.from_dict(text, eos_token_ids or _as_tuple(text.get("eos_token_id")))
        return replace(language, architecture=arch, vision=idefics3_vision(cfg, language.vocab_size))
    # Qwen2.5-VL: M-RoPE's sections out of the rope dict (whose older type "mrope" means the default)
    rope = dict(text.get("rope_parameters") or text.get("rope_scaling") or {})
    section, rope_type = rope.pop("mrope_section", None), rope.pop("type", None) or rope.get("rope_type", "default")
    if not isinstance(section, list) or len(section) != 3 or not isinstance(cfg.get("vision_config"), dict):
        raise ValueError(f"{arch} needs a vision_config object and three mrope_section sizes in its rope dict; got "
                         f"vision_config {type(cfg.get('vision_config')).__name__}, mrope_section {section!r}")
    text.update(rope_parameters={**rope, "rope_type": "default" if rope_type == "mrope" else rope_type},
                rope_scaling=None)
    language = cls.from_dict(text, eos_token_ids or _as_tuple(text.get("eos_token_id")))
    if sum(section) != language.head_dim // 2:
        raise ValueError(f"mrope_section {section} must add up to head_dim / 2 = {language.head_dim // 2}")
    return replace(language, architecture=arch, vision=cfg["vision_config"], mrope_section=tuple(section))


def _rope(cfg: dict) -> tuple[float, dict | None]:
    """rope_theta and the scaling dict; transformers 5 folds both into `rope_parameters`."""
    params = dict(cfg.get("rope_parameters") or cfg.get("rope_scaling") or {})
    theta = cfg.get("rope_theta", params.get("rope_theta", 10000.0))
    rope_type = params.get("rope_type", params.get("type", "default"))
    if rope_type not in SUPPORTED_ROPE_TYPES:
        raise ValueError(f"unsupported rope scaling type {rope_type!r}; nanopaged supports "
                         f"{', '.join(SUPPORTED_ROPE_TYPES)}")
    return float(theta), (None if rope_type == "default" else {**params, "rope_type": rope_type})


def _moe(cfg: dict, arch: str) -> MoEConfig | None:
    if arch not in MOE_ARCHITECTURES:
        return None
    from nanopaged.models.moe import moe_config       # read only for a mixture of experts
    return moe_config(cfg, arch)


def _as_tuple(x) -> tuple[int, ...]:
    if x is None:
        return ()
    return tuple(x) if isinstance(x, (list, tuple)) else (int(x),)


def _generation_eos(folder: Path) -> tuple[int, ...]:
    """EOS ids from generation_config.json, which may list several (e.g. Llama 3)."""
    path = folder / "generation_config.json"
    if not path.exists():
        return ()
    return _as_tuple(read_json(path).get("eos_token_id"))


def read_json(path: Path) -> dict:
    """A JSON object from a file, or a ValueError that names the file."""
    try:
        data = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ValueError(f"{path} is not a readable JSON file: {e}") from e
    if not isinstance(data, dict):
        raise ValueError(f"{path} must hold a JSON object, got {type(data).__name__}")
    return data
