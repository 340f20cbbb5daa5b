"""LoRA adapters: one base model, many fine-tuned adapters, requests for any of them in one step.

    request.py   LoRARequest: which adapter a request runs with (vLLM's fields)
    adapter.py   a PEFT folder read into A, B and scaling per layer and projection, checked
    layers.py    the LoRA linear: base(x) plus each row's adapter update, grouped by adapter
    manager.py   adapters read on demand, kept in memory (max_cpu_loras) and in slots (max_loras)

The engine installs this module when `enable_lora=True` (engine/llm_engine.py: CONFIG_EXTENSIONS):
the LoRA linears wrap the model's projections, the manager becomes one of the scheduler's admission
rules (a slot for the request's adapter) and one of the runner's `before_forward` hooks (the step's
rows of each adapter), and `process_request(..., lora_request=...)` hands it each request to check.
The prefix cache keys blocks by adapter in the core itself (core/block_pool.py: extra_keys).
docs/12_lora.md.
"""
from __future__ import annotations

from nanopaged.lora.manager import LoRAManager
from nanopaged.lora.request import LoRARequest

__all__ = ["LoRAManager", "LoRARequest", "install"]


def install(engine) -> LoRAManager:
    """Wrap the engine's model for adapters and hook the manager in (engine.extensions["nanopaged.lora"])."""
    return LoRAManager(engine)
