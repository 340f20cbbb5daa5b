"""LoRARequest: which adapter a request runs with, by vLLM's names (vllm/lora/request.py).

A request names its adapter by `lora_name` (what a server's `model` field says), `lora_int_id` (a
positive integer the engine keys slots and the prefix cache by) and `lora_path` (a PEFT folder as
`peft` saves it: adapter_config.json and adapter_model.safetensors). Two requests with the same id
must name the same folder. Reading the folder: nanopaged/lora/adapter.py.
"""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class LoRARequest:
    lora_name: str
    lora_int_id: int
    lora_path: str = ""

    def __post_init__(self) -> None:
        if not isinstance(self.lora_name, str) or not self.lora_name:
            raise ValueError(f"LoRARequest.lora_name must be a non-empty string, got {self.lora_name!r}")
        if isinstance(self.lora_int_id, bool) or not isinstance(self.lora_int_id, int) or self.lora_int_id < 1:
            raise ValueError(f"LoRARequest.lora_int_id must be an integer >= 1 (0 is the base model), "
                             f"got {self.lora_int_id!r}")
        if not isinstance(self.lora_path, str) or not self.lora_path:
            raise ValueError(f"LoRARequest.lora_path must name a PEFT adapter folder, got {self.lora_path!r}")
