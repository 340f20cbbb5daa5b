"""LoRA adapters (in progress, issue 38): LoRARequest (request.py) and reading PEFT folders (adapter.py).

The engine does not apply adapters yet: `generate(..., lora_request=...)` still refuses one.
"""
