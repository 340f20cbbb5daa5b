"""LoRA adapters: one base model, many fine-tuned adapters, requests for any of them in one step.

    extension.py  LoRA: how it attaches to the engine (engine/extension.py), with enable_lora=True
    settings.py   vLLM's four settings (max_loras, max_lora_rank, max_cpu_loras), checked
    request.py    LoRARequest: which adapter a request runs with (vLLM's fields)
    adapter.py    a PEFT folder read into A, B and scaling per layer and projection, checked
    layers.py     the LoRA linear: base(x) plus each row's adapter update, grouped by adapter
    manager.py    adapters read on demand, kept in memory (max_cpu_loras) and in slots (max_loras)

docs/12_lora.md.
"""
from __future__ import annotations

from nanopaged.lora.request import LoRARequest

__all__ = ["LoRARequest"]
