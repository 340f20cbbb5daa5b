"""The model every engine loads: --model, the demo model, or random weights of a named shape (dense,
a mixture of experts at OLMoE's or Qwen3-30B-A3B's shape, written a layer at a time so the writer
never holds the model, or SmolVLM's vision-language shape); and the spec workload's draft model, cut from the target. Folders made here
are written once into the cache (cache_dir()/bench)."""
from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import sys
from pathlib import Path
from typing import Callable

import torch

from benchmarks.quality import DATA
from benchmarks.tokenizer import train_tokenizer
from nanopaged.models.demo_model import cache_dir, demo_model_path
from nanopaged.models.config import ModelConfig

# Random-weight models for machines with no model files: the shapes are data
# (benchmarks/data/model_shapes.json), weights drawn once and cached. Dense: qwen3-0.6b is
# nano-vllm's benchmark shape. Mixtures of experts for the moe workload (benchmarks/moe.py): OLMoE's
# and Qwen3-30B-A3B's (12 of its layers). Vision-language for the multimodal workload: SmolVLM-256M's.
# tiny-qwen3, tiny-olmoe and tiny-smolvlm are for tests. For benchmarks/research/parallel.py: the demo model's shape
# with 8 query and 2 KV heads of 64 (its 9 and 3 do not split in two), and OLMoE's at a quarter of its width.
SHAPES = json.loads((DATA / "model_shapes.json").read_text())
RANDOM_CONFIGS, MOE_CONFIGS, VLM_CONFIGS = SHAPES["dense"], SHAPES["moe"], SHAPES["vision"]
# Idefics3's markers: the global image, a tile's grid place, around an image, an image token; a turn's end.
IDEFICS3_TOKENS = (["<global-img>"] + [f"<row_{i}_col_{j}>" for i in range(1, 7) for j in range(1, 7)]
                   + ["<fake_token_around_image>", "<image>", "<end_of_utterance>"])


def write_random_moe(name: str, folder: Path) -> None:
    """`name`'s config and random bfloat16 weights as Hugging Face lays them out (each expert's gate, up and
    down on its own), one safetensors shard per layer, written as drawn."""
    from safetensors.torch import save_file
    cfg = {**MOE_CONFIGS[name], "bos_token_id": 1, "eos_token_id": 2, "pad_token_id": 2, "dtype": "bfloat16"}
    folder.mkdir(parents=True)
    (folder / "config.json").write_text(json.dumps(cfg, indent=2) + "\n")
    g = torch.Generator().manual_seed(0)

    def rand(*shape):
        return (torch.randn(*shape, generator=g) * shape[-1] ** -0.5).to(torch.bfloat16)

    h, vocab = cfg["hidden_size"], cfg["vocab_size"]
    weight_map = {}

    def write(name: str, tensors: dict) -> None:
        save_file(tensors, folder / name, metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(tensors, name))

    write("model-outer.safetensors", {"model.embed_tokens.weight": rand(vocab, h), "lm_head.weight": rand(vocab, h),
                                      "model.norm.weight": torch.ones(h, dtype=torch.bfloat16)})
    for i in range(cfg["num_hidden_layers"]):
        write(f"model-layer{i:02d}.safetensors", random_layer(cfg, i, rand))
    (folder / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    train_tokenizer(4096, model_max_length=cfg["max_position_embeddings"]).save_pretrained(folder)


def random_layer(cfg: dict, i: int, rand) -> dict:
    h, p = cfg["hidden_size"], f"model.layers.{i}."
    d = cfg.get("head_dim") or h // cfg["num_attention_heads"]
    q, kv, inter = cfg["num_attention_heads"] * d, cfg["num_key_value_heads"] * d, cfg.get("moe_intermediate_size",
                                                                                              cfg["intermediate_size"])
    ones = lambda n: torch.ones(n, dtype=torch.bfloat16)          # noqa: E731
    t = {p + "input_layernorm.weight": ones(h), p + "post_attention_layernorm.weight": ones(h),
         p + "self_attn.q_proj.weight": rand(q, h), p + "self_attn.k_proj.weight": rand(kv, h),
         p + "self_attn.v_proj.weight": rand(kv, h), p + "self_attn.o_proj.weight": rand(h, q),
         p + "mlp.gate.weight": rand(cfg["num_experts"], h)}
    norms = (q, kv) if cfg["model_type"] == "olmoe" else (d, d)   # OLMoE's q/k norm spans the projection
    t[p + "self_attn.q_norm.weight"], t[p + "self_attn.k_norm.weight"] = ones(norms[0]), ones(norms[1])
    for e in range(cfg["num_experts"]):
        x = f"{p}mlp.experts.{e}."
        t[x + "gate_proj.weight"], t[x + "up_proj.weight"] = rand(inter, h), rand(inter, h)
        t[x + "down_proj.weight"] = rand(h, inter)
    return t


def resolve_model(args) -> str:
    if args.random_weights:
        return str(build_random_model(args.random_weights))
    return str(args.model) if args.model else str(demo_model_path())


def build_random_model(name: str) -> Path:
    """A Hugging Face folder with `name`'s shape and random weights, made once and cached; its tokenizer
    is trained in-process (no download), the model keeps its own vocabulary for its true cost."""
    folder = cache_dir() / "bench" / f"{name}-random-v2"   # v2: its own tokenizer
    if name in VLM_CONFIGS:
        return write_once(folder, f"random weights for {name}", lambda tmp: write_random_vlm(name, tmp))
    if name not in RANDOM_CONFIGS:                         # a mixture of experts, written layer by layer
        return write_once(folder, f"random weights for {name}", lambda tmp: write_random_moe(name, tmp))

    def write(tmp: Path) -> None:
        from transformers import AutoConfig, AutoModelForCausalLM
        cfg = dict(RANDOM_CONFIGS[name])
        config = AutoConfig.for_model(cfg.pop("model_type", "qwen3"), **cfg, bos_token_id=1, eos_token_id=2,
                                      pad_token_id=2)      # a hybrid's shape names its model_type
        torch.manual_seed(0)
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
        model.save_pretrained(tmp, safe_serialization=True)   # writes generation_config.json too
        train_tokenizer(4096, model_max_length=cfg["max_position_embeddings"]).save_pretrained(tmp)

    return write_once(folder, f"random weights for {name}", write)


def write_random_vlm(name: str, folder: Path) -> None:
    """An Idefics3ForConditionalGeneration of `name`'s shape with random weights, its Idefics3Processor (SmolVLM's
    image sizes) and tokenizer (SmolLM2's, or the tiny one, with Idefics3's markers) and SmolVLM's chat template."""
    from transformers import (AutoTokenizer, Idefics3Config, Idefics3ForConditionalGeneration,
                              Idefics3ImageProcessorPil, Idefics3Processor)
    shape = VLM_CONFIGS[name]
    tokenizer = AutoTokenizer.from_pretrained(demo_model_path()) if shape["tokenizer"] == "smollm2" \
        else train_tokenizer(512)
    tokenizer.add_special_tokens({"additional_special_tokens": IDEFICS3_TOKENS})
    template = (DATA / "smolvlm_chat_template.jinja").read_text().rstrip("\n")
    tokenizer.chat_template = template
    p = shape["processor"]
    images = Idefics3ImageProcessorPil(**{k: v for k, v in p.items() if k != "image_seq_len"})
    text = {**shape["text_config"], "bos_token_id": 1, "eos_token_id": 2, "pad_token_id": 2}
    config = Idefics3Config(text_config=text, vision_config=shape["vision_config"], scale_factor=shape["scale_factor"],
                            image_token_id=tokenizer.convert_tokens_to_ids("<image>"),
                            tie_word_embeddings=shape["tie_word_embeddings"], pad_token_id=2)
    torch.manual_seed(0)
    Idefics3ForConditionalGeneration(config).save_pretrained(folder, safe_serialization=True)
    Idefics3Processor(images, tokenizer, image_seq_len=p["image_seq_len"], chat_template=template).save_pretrained(folder)


def write_once(folder: Path, what: str, write: Callable[[Path], None]) -> Path:
    """`folder`, a model folder made once: if it has no config.json yet, `write` fills a
    temporary folder beside it, which is then renamed, so a half-written folder is never used."""
    if (folder / "config.json").is_file():       # the folder exists only once it is whole (the rename below)
        return folder
    print(f"bench: writing {what} into {folder} (once)", file=sys.stderr)
    tmp = folder.with_name(folder.name + f".tmp-{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    write(tmp)
    shutil.rmtree(folder, ignore_errors=True)
    os.rename(tmp, folder)
    return folder


# ---- the spec workload's draft model -------------------------------------------------------

DRAFT_NOTE = ("a layer-truncated self-draft (an early exit): the target's first {n} of its {total} decoder "
              "layers, with its embedding, final norm and lm_head; not a separately trained model")
LAYER = re.compile(r"^model\.layers\.(\d+)\.")


def build_draft_model(model_dir: str, num_layers: int) -> Path:
    """The target's embedding, first `num_layers` decoder layers, final norm and lm_head (unless tied) as
    a model of its own with the target's tokenizer, made once and cached under a stamp of its weights."""
    src = Path(model_dir).resolve()
    config = json.loads((src / "config.json").read_text())
    total = config["num_hidden_layers"]
    if not 1 <= num_layers < total:
        raise ValueError(f"--draft-layers {num_layers}: the model has {total} layers; a draft keeps 1 to {total - 1}")
    weights = sorted(src.glob("*.safetensors"))
    stamp = hashlib.sha256(repr([str(src)] + [(w.name, w.stat().st_size, w.stat().st_mtime_ns)
                                              for w in weights]).encode()).hexdigest()[:10]

    def write(tmp: Path) -> None:
        from safetensors import safe_open
        from safetensors.torch import save_file
        state = {}
        for w in weights:
            with safe_open(str(w), "pt") as f:
                for name in f.keys():
                    m = LAYER.match(name)
                    if m is None or int(m.group(1)) < num_layers:
                        state[name] = f.get_tensor(name)
        needed = ["model.embed_tokens.weight", "model.norm.weight"]
        needed += [] if config.get("tie_word_embeddings") else ["lm_head.weight"]
        missing = [n for n in needed if n not in state]
        if missing:
            raise ValueError(f"{src}: no {', '.join(missing)} in its weights; cannot cut a draft model from it")
        config["num_hidden_layers"] = num_layers
        if isinstance(config.get("layer_types"), list):
            config["layer_types"] = config["layer_types"][:num_layers]
        tmp.mkdir(parents=True)
        save_file(state, str(tmp / "model.safetensors"), metadata={"format": "pt"})
        (tmp / "config.json").write_text(json.dumps(config, indent=2) + "\n")
        for f in src.iterdir():       # tokenizer, chat template, generation config; not the weights, not links
            if f.is_file() and not f.is_symlink() and f.suffix != ".safetensors" \
                    and f.name not in ("config.json", "model.safetensors.index.json"):
                shutil.copy2(f, tmp / f.name)

    return write_once(cache_dir() / "bench" / f"{src.name}-first{num_layers}-draft-{stamp}",
                      f"the draft model (the first {num_layers} of {total} layers of {src})", write)


def vocab_limit(model_dir: str) -> int:
    from transformers import AutoTokenizer
    return min(ModelConfig.from_folder(model_dir).vocab_size,
               len(AutoTokenizer.from_pretrained(model_dir)))
