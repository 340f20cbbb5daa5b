"""LoRA: the extension that applies a request's adapter (vLLM's `lora_request`).

Installed with the engine when `enable_lora=True`; a request's `lora_request` field names its adapter.
Through the contract: the model pipeline's `adapters` stage wraps the projections (manager.py: wrap),
`prepare` reads and checks the adapter before the request is queued, the adapter's id keys the
request's prefix-cache blocks, `admit` holds a request whose adapter has no slot, `before_forward`
hands the LoRA linears the step's rows of each adapter. docs/12_lora.md.
"""
from __future__ import annotations

from nanopaged.core.request import Request
from nanopaged.engine.extension import Extension
from nanopaged.lora.manager import LoRAManager, adapter_id
from nanopaged.lora.settings import check_lora_settings
from nanopaged.models.pipeline import ModelStage


class LoRA(Extension):
    name = "lora"
    request_fields = ("lora_request",)

    @classmethod
    def check_config(cls, config) -> None:
        if config.enable_lora:     # vLLM reads the other three settings only then, too
            check_lora_settings(config)

    @classmethod
    def wanted(cls, config) -> bool:
        return config.enable_lora

    @classmethod
    def late_install(cls, config, fields: dict) -> bool:
        raise ValueError(f"lora_request={fields.get('lora_request')!r} needs an engine made with enable_lora=True "
                         "(the adapters' linears are wrapped when the model loads)")

    def __init__(self, config) -> None:
        super().__init__(config)
        self.manager = LoRAManager(config)
        self.base = self.manager.stats.copy()

    def model_stages(self) -> list[ModelStage]:
        return [ModelStage("adapters", self.manager.wrap)]

    def attach(self, engine) -> None:
        self.manager.find_fused_loop(engine.runner.model)

    def prepare(self, samples: list[Request], fields: dict) -> None:
        self.manager.prepare(samples, fields["lora_request"])

    def block_hash_keys(self, request: Request) -> tuple:
        """The same tokens under another adapter are another prefix; the adapter's weights by content beside its
        id, for a prefix cache that outlives the process (a block file read by the next run)."""
        key = adapter_id(request)
        return (key, self.manager.adapters[key].digest) if key else ()

    def admit(self, request: Request, running: list[Request]) -> bool:
        return self.manager.has_slot(request, running)

    def before_forward(self, scheduler_output, model_input) -> None:
        self.manager.before_forward(scheduler_output, model_input)

    def stats(self) -> dict:
        """Adapters in memory and in slots, folders read, slot loads and waits, active per step."""
        return self.manager.stats.since(self.base).as_dict()

    def reset_stats(self) -> None:
        self.base = self.manager.stats.copy()

    def progress(self) -> str:
        return f"adapters {self.manager.stats.active_now}"
