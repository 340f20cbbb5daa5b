"""Model code: one Llama-family implementation (Llama, SmolLM2, Mistral, Qwen2, Qwen3)."""
from nanopaged.models.config import ModelConfig
from nanopaged.models.llama import LlamaForCausalLM
from nanopaged.models.loader import load_weights

__all__ = ["ModelConfig", "LlamaForCausalLM", "load_weights"]
