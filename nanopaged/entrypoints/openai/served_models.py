"""The models a server answers to: the base model by its served name, LoRA adapters by theirs.

A request's `model` field picks one (protocol.py); GET /v1/models lists them, the base model first,
in vLLM's ModelCard shape; `--lora-modules` loads adapters at start-up and, with
`--allow-runtime-lora-updating`, POST /v1/load_lora_adapter and /v1/unload_lora_adapter change them
while the server runs (app.py). An adapter is read through the engine's LoRA manager
(nanopaged/lora/manager.py) when it is loaded, so a bad folder is refused then, not at its first
request. vLLM: vllm/entrypoints/openai/serving_models.py. docs/08_server.md, "LoRA adapters".
"""
from __future__ import annotations

import threading
import time
from dataclasses import dataclass
from types import MappingProxyType

from nanopaged.entrypoints.openai.protocol import OpenAIError
from nanopaged.lora.request import LoRARequest


@dataclass(frozen=True)
class Table:
    """The names served, as one value: replaced whole on a load or an unload, never changed, so a
    handler that reads `ServedModels.table` once sees one consistent table without taking a lock."""
    adapters: MappingProxyType          # name -> LoRARequest
    cards: tuple[dict, ...]             # /v1/models' entries, the base model's first


class ServedModels:
    def __init__(self, name: str, path: str, max_model_len: int, lora_manager=None) -> None:
        """`lora_manager`: the engine's (its LoRA extension's manager); None: the base model only."""
        self.name, self.path, self.max_model_len, self.lora_manager = name, path, max_model_len, lora_manager
        self.base_card = self._card(name, path, None, int(time.time()))
        self.lock = threading.Lock()            # one load or unload at a time
        self.next_id = 1                        # lora_int_ids are never reused: the engine keys its cache by them
        self.created: dict[str, int] = {}
        self.table = Table(MappingProxyType({}), (self.base_card,))

    @property
    def serves_adapters(self) -> bool:
        return self.lora_manager is not None

    @property
    def adapters(self):
        """name -> LoRARequest, for protocol.parse_request; None where the server serves no adapters."""
        return self.table.adapters if self.serves_adapters else None

    def load(self, name: str, path: str) -> LoRARequest:
        """Read the adapter at `path` and serve it as `name` (the next lora_int_id). Blocks on the
        folder's read: call it off the event loop. OpenAIError (400) naming what is wrong."""
        with self.lock:
            if name in self.table.adapters:
                raise OpenAIError(f"The lora adapter '{name}' has already been loaded.", param="lora_name",
                                  type="InvalidUserInput", code=400)
            if name == self.name:
                raise OpenAIError(f"'{name}' is the base model's name; give the adapter another", param="lora_name",
                                  type="InvalidUserInput", code=400)
            try:
                lora_request = LoRARequest(name, self.next_id, path)
                self.lora_manager.adapter(lora_request)        # read and checked now; a ValueError if not
            except ValueError as e:
                raise OpenAIError(str(e), param="lora_path", type="BadRequestError", code=400) from None
            self.next_id += 1
            self.created[name] = int(time.time())
            self._publish({**self.table.adapters, name: lora_request})
            return lora_request

    def unload(self, name: str) -> None:
        """Stop serving `name`: requests that name it from now on are 404s; the manager drops the
        adapter from memory once no request uses it. OpenAIError (404) for a name not served."""
        with self.lock:
            lora_request = self.table.adapters.get(name)
            if lora_request is None:
                raise OpenAIError(f"The lora adapter '{name}' cannot be found.", param="lora_name", status=404,
                                  type="NotFoundError", code=404)
            self._publish({n: r for n, r in self.table.adapters.items() if n != name})
            del self.created[name]
            self.lora_manager.unload(lora_request.lora_int_id)

    def _publish(self, adapters: dict[str, LoRARequest]) -> None:
        cards = [self._card(n, r.lora_path, self.name, self.created[n]) for n, r in adapters.items()]
        self.table = Table(MappingProxyType(adapters), (self.base_card, *cards))

    def _card(self, name: str, root: str, parent: str | None, created: int) -> dict:
        """vLLM's ModelCard: `root` the folder it was read from, `parent` the base model of an adapter."""
        return {"id": name, "object": "model", "created": created, "owned_by": "nanopaged", "root": root,
                "parent": parent, "max_model_len": self.max_model_len}
