"""The LoRA manager: adapters as a pooled resource, read on demand, kept in slots, evicted LRU.

Two pools, as in vLLM (vllm/lora/worker_manager.py, models.py):

    memory  adapters read from their folders, at most `max_cpu_loras`; a request's adapter is read
            when the request is added (a folder that is missing or wrong fails that request with a
            ValueError, before any work), and stays while an unfinished request uses it; beyond
            that, the least recently used is dropped first (and read again if asked for again)
    slots   `max_loras` places in the model's LoRA linears (lora/layers.py): the adapters one step
            can apply. A waiting request whose adapter holds no slot is admitted only while fewer
            than `max_loras` adapters run (`has_slot`, one of the scheduler's admission rules);
            otherwise it waits, counted in `slot_waits`, and requests behind it go ahead. An adapter
            stays in its slot after its requests finish; a new one takes the least recently used
            slot that the step does not need.

Its LoRA linears wrap the model's projections in the model pipeline's `adapters` stage (`wrap`), so
the fused layer loop is built once with their slots. Before each forward (`before_forward`) the manager
puts the step's adapters into slots and tells the LoRA linears which rows use which slot.
extension.py attaches it to the engine; docs/12_lora.md.
"""
from __future__ import annotations

import threading
import weakref
from collections import OrderedDict
from dataclasses import asdict, dataclass, replace

import torch

from nanopaged.core.request import Request
from nanopaged.cpu.build import cpu_ops
from nanopaged.cpu.fused import FusedLlamaModel
from nanopaged.cpu.choose import OWN_KERNEL_FLAGS, choose
from nanopaged.lora.adapter import LoRAAdapter, load_adapter
from nanopaged.lora.layers import StepAdapters, wrap_linears
from nanopaged.lora.request import LoRARequest


@dataclass
class LoRAStats:
    """The manager's counters since the engine started, and its gauges (get_stats()["lora"])."""
    adapters_read: int = 0         # folders read from disk
    slot_loads: int = 0            # adapters put into a slot
    slot_waits: int = 0            # times a waiting request was held back: its adapter had no slot
    steps_with_adapters: int = 0
    active_adapter_steps: int = 0  # adapters applied, summed over steps (/ steps_with_adapters: the mean)
    max_active_adapters: int = 0   # gauges from here on: not counted from a reset
    active_now: int = 0            # adapters in the last step
    adapters_in_memory: int = 0
    adapters_in_slots: int = 0

    def copy(self) -> "LoRAStats":
        return replace(self)

    def since(self, base: "LoRAStats") -> "LoRAStats":
        """The counts from `base` (a copy taken at reset_stats) to now; the gauges as they are."""
        counts = {f: getattr(self, f) - getattr(base, f) for f in list(self.__dataclass_fields__)[:5]}
        return replace(self, **counts)

    def as_dict(self) -> dict:
        steps = self.steps_with_adapters
        return {**asdict(self), "mean_active_adapters": self.active_adapter_steps / steps if steps else 0.0}


class LoRAManager:
    def __init__(self, cfg) -> None:
        self.max_loras, self.max_cpu_loras, self.max_lora_rank = cfg.max_loras, cfg.max_cpu_loras, cfg.max_lora_rank
        # adapters run in one process (no tensor parallelism): the model's own shapes, dtype and device
        self.model_config, self.dtype = cfg.model_config, getattr(torch, cfg.dtype)
        self.device = torch.device(cfg.device)
        self.adapters: OrderedDict[int, LoRAAdapter] = OrderedDict()   # read adapters, least recently used first
        self.requests: dict[int, LoRARequest] = {}                      # id -> the LoRARequest it was read for
        self.users: dict[int, weakref.WeakSet] = {}                     # id -> requests that name it
        self.slot_ids = [0] * self.max_loras          # the adapter id in each slot; 0: empty
        self.slot_last_step = [-1] * self.max_loras
        self.num_steps = 0
        self.stats = LoRAStats()
        self.lock = threading.Lock()
        self.step = StepAdapters([])
        self.layers: list = []
        self.fused = None                     # the fused layer loop, where it runs the updates in C++
        # the updates run on nanopaged's dpbf16 kernel where the linears run on one of nanopaged's (each row
        # alone: batch invariance); every CPU with AMX-BF16 has AVX512-BF16 too
        self.ops = cpu_ops() if choose(cfg).linear in OWN_KERNEL_FLAGS else None

    def wrap(self, model):
        """The model pipeline's `adapters` stage: every decoder projection in a LoRA linear."""
        self.layers = wrap_linears(model, self.max_loras, self.step, self.device, self.ops)
        return model

    def find_fused_loop(self, model) -> None:
        """After the pipeline: the fused layer loop, if the fuse stage built one (its descriptors hold the slots)."""
        self.fused = model.model if isinstance(getattr(model, "model", None), FusedLlamaModel) else None

    # ---- requests in ---------------------------------------------------------------------------
    def prepare(self, samples: list[Request], lora_request) -> None:
        """Check the LoRARequest and read its adapter (a ValueError if it cannot be applied); the
        request's sequences then carry it."""
        if not isinstance(lora_request, LoRARequest):
            raise ValueError(f"lora_request must be a LoRARequest, got {type(lora_request).__name__}")
        with self.lock:            # the server adds requests on several threads
            known = self.requests.get(lora_request.lora_int_id)
            if known is not None and (known.lora_name, known.lora_path) != (lora_request.lora_name,
                                                                            lora_request.lora_path):
                raise ValueError(f"lora_int_id={lora_request.lora_int_id} already names adapter {known.lora_name!r} "
                                 f"at {known.lora_path!r}; give {lora_request.lora_name!r} another id")
            self._adapter(lora_request)
            users = self.users.setdefault(lora_request.lora_int_id, weakref.WeakSet())
            for sample in samples:
                sample.extension_fields["lora_request"] = lora_request
                users.add(sample)

    def adapter(self, lora_request: LoRARequest) -> LoRAAdapter:
        """The adapter, read from its folder unless it is in memory; the least recently used unused
        ones dropped beyond max_cpu_loras. (The server adds requests on its threads: one at a time.)"""
        with self.lock:
            return self._adapter(lora_request)

    def _adapter(self, lora_request: LoRARequest) -> LoRAAdapter:
        key = lora_request.lora_int_id
        if key in self.adapters:
            self.adapters.move_to_end(key)
            return self.adapters[key]
        adapter = load_adapter(lora_request, self.model_config, self.max_lora_rank, self.dtype)
        self.stats.adapters_read += 1
        self.adapters[key], self.requests[key] = adapter, lora_request
        for old in [k for k in self.adapters if k != key and not self.in_use(k)]:
            if len(self.adapters) <= self.max_cpu_loras:
                break
            self.remove(old)
        self.stats.adapters_in_memory = len(self.adapters)
        return adapter

    def in_use(self, key: int) -> bool:
        return any(not r.is_finished for r in self.users.get(key, ()))

    def unload(self, key: int) -> None:
        """The server's unload: drop the adapter now unless a request still uses it (then it goes
        the LRU way, once they finish)."""
        with self.lock:
            if not self.in_use(key):
                self.remove(key)

    def remove(self, key: int) -> None:
        """Forget an adapter: from memory and from its slot."""
        self.adapters.pop(key, None)
        self.requests.pop(key, None)
        if key in self.slot_ids:
            self.slot_ids[self.slot_ids.index(key)] = 0
        self.stats.adapters_in_memory = len(self.adapters)

    # ---- the scheduler's admission rule --------------------------------------------------------
    def has_slot(self, request: Request, running: list[Request]) -> bool:
        """Base-model requests always fit; an adapter's, if it runs already or a slot is free."""
        key = adapter_id(request)
        if not key:
            return True
        active = {adapter_id(r) for r in running} - {0}
        if key in active or len(active) < self.max_loras:
            return True
        self.stats.slot_waits += 1
        return False

    # ---- before each forward -------------------------------------------------------------------
    def before_forward(self, out, inputs) -> None:
        """Put the step's adapters into slots and hand each LoRA linear the rows of each slot."""
        rows: dict[int, list[int]] = {}
        start = 0
        for request, num_new in out.scheduled:     # the runner lays each request's rows out in this order
            if adapter_id(request):
                rows.setdefault(adapter_id(request), []).extend(range(start, start + num_new))
            start += num_new
        self.num_steps += 1
        self.step.groups = [(self.slot_of(key, rows), torch.tensor(r, device=self.device)) for key, r in rows.items()]
        if self.fused is not None:
            self.fused.decoder.lora_groups = self.step.groups
        self.stats.active_now = len(rows)
        self.stats.adapters_in_slots = sum(1 for k in self.slot_ids if k)
        if rows:
            self.stats.steps_with_adapters += 1
            self.stats.active_adapter_steps += len(rows)
            self.stats.max_active_adapters = max(self.stats.max_active_adapters, len(rows))

    def slot_of(self, key: int, needed) -> int:
        """The adapter's slot; loaded into the least recently used slot this step does not need."""
        if key in self.slot_ids:
            slot = self.slot_ids.index(key)
        else:
            free = [s for s in range(self.max_loras) if self.slot_ids[s] not in needed]
            slot = min(free, key=lambda s: self.slot_last_step[s])   # the scheduler keeps one free
            adapter = self.adapter(self.requests[key])
            for layer in self.layers:
                layer.load(slot, adapter)
            self.slot_ids[slot] = key
            self.stats.slot_loads += 1
        self.slot_last_step[slot] = self.num_steps
        return slot


def adapter_id(request: Request) -> int:
    """The request's lora_int_id; 0: the base model."""
    lora_request = request.extension_fields.get("lora_request")
    return lora_request.lora_int_id if lora_request else 0
