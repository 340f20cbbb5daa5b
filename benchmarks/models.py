"""The model every engine loads: --model, the demo model, or random weights of a named shape."""
from __future__ import annotations

import os
import shutil
import sys
from pathlib import Path

import torch

from benchmarks.tokenizer import train_tokenizer
from nanopaged.models.demo_model import cache_dir, demo_model_path
from nanopaged.models.config import ModelConfig

# Random-weight models for machines with no model files: a config written inline, weights
# drawn once and cached. qwen3-0.6b is nano-vllm's benchmark shape; tiny-qwen3 is for tests.
RANDOM_CONFIGS = {
    "qwen3-0.6b": dict(hidden_size=1024, num_hidden_layers=28, num_attention_heads=16,
                       num_key_value_heads=8, head_dim=128, intermediate_size=3072,
                       vocab_size=151936, rope_theta=1_000_000.0, max_position_embeddings=40960,
                       tie_word_embeddings=True, rms_norm_eps=1e-6),
    "tiny-qwen3": dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                       num_key_value_heads=2, head_dim=32, intermediate_size=128,
                       vocab_size=49152, rope_theta=1_000_000.0, max_position_embeddings=2048,
                       tie_word_embeddings=True, rms_norm_eps=1e-6),
}


def resolve_model(args) -> str:
    if args.random_weights:
        return str(build_random_model(args.random_weights))
    return str(args.model) if args.model else str(demo_model_path())


def build_random_model(name: str) -> Path:
    """A Hugging Face folder with `name`'s shape and random weights, made once and cached.

    The tokenizer is trained in-process (benchmarks/tokenizer.py, a few thousand tokens), so a bare
    GPU machine needs neither the demo model nor a download; the model's own vocabulary
    (Qwen3: 151936) is kept for its true cost, and make_trace draws ids below the tokenizer's.
    """
    folder = cache_dir() / "bench" / f"{name}-random-v2"   # v2: its own tokenizer
    if (folder / "model.safetensors").is_file():
        return folder
    from transformers import AutoModelForCausalLM, Qwen3Config
    print(f"bench: writing random weights for {name} into {folder} (once)", file=sys.stderr)
    cfg = dict(RANDOM_CONFIGS[name])
    config = Qwen3Config(**cfg, bos_token_id=1, eos_token_id=2, pad_token_id=2,
                         architectures=["Qwen3ForCausalLM"])
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    tmp = folder.with_name(folder.name + f".tmp-{os.getpid()}")
    model.save_pretrained(tmp, safe_serialization=True)   # writes generation_config.json too
    train_tokenizer(4096, model_max_length=cfg["max_position_embeddings"]).save_pretrained(tmp)
    shutil.rmtree(folder, ignore_errors=True)
    os.rename(tmp, folder)                                # a half-written folder is never used
    return folder


def vocab_limit(model_dir: str) -> int:
    from transformers import AutoTokenizer
    return min(ModelConfig.from_folder(model_dir).vocab_size,
               len(AutoTokenizer.from_pretrained(model_dir)))
