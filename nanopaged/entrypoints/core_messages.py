"""What crosses the socket between the API servers and the engine core, and how it is written.

`nanopaged serve` runs as vLLM V1 lays it out (docs/08_server.md, "Processes"): API-server
processes do HTTP, JSON, chat templates, tokenizing, detokenizing and stop strings; one
engine-core process schedules and runs the model. They talk over one ZeroMQ socket pair, in
messages that are plain structs written as MessagePack (msgspec). Nothing is pickled: a
decoder reads only the message types below, so a malformed or hostile message is an error,
never code run. vLLM: vllm/v1/engine/__init__.py (EngineCoreRequest, EngineCoreOutputs).

API server -> engine core                    engine core -> API server
    Hello        (once, so the core knows it)     Accepted / Refused   (each AddRequest)
    AddRequest   (token ids; with images, the      Outputs              (each step: new token ids)
                  prompt's text and the images)
    Abort        (client gone, stop string)       Figures              (the /metrics gauges and counts)
    Adapter      (read or drop a LoRA adapter)    AdapterDone          (each Adapter)
supervisor -> engine core: ClientGone (an API server died: abort its requests), Shutdown.
"""
from __future__ import annotations

import dataclasses

import msgspec

from nanopaged.lora.request import LoRARequest
from nanopaged.pooling_params import PoolingParams
from nanopaged.sampling_params import RequestOutputKind, SamplingParams
from nanopaged.structured_output.params import StructuredOutputsParams


# ---- API server -> engine core ----------------------------------------------------------------
class Hello(msgspec.Struct, tag=True):
    pass


class AddRequest(msgspec.Struct, tag=True):
    """A request tokenized and checked by the API server. The core asks for every step's tokens
    (DELTA) and no text: `params` are the client's, `core_params` turns off what the API server
    does itself (detokenize, stop strings)."""
    request_id: str
    prompt_token_ids: list[int]
    params: dict                      # SamplingParams' fields (params_to_wire)
    cache_salt: str | None = None
    lora: list | None = None          # [name, int id, path]
    pooling: dict | None = None       # an embedding request: PoolingParams' fields (params is then {})
    prefix_keys: list[bytes] = []     # data parallelism: the router's keys of its first blocks (dp_router.py)
    # A prompt with images: its text and its images, encoded (PNG), for the core's processor to place them.
    prompt: str | None = None
    images: list[bytes] = []


class Abort(msgspec.Struct, tag=True):
    request_ids: list[str]


class Adapter(msgspec.Struct, tag=True):
    """load: read and check the adapter (LoRA manager's `adapter`); else: drop it once unused."""
    load: bool
    lora: list                        # [name, int id, path]


class ClientGone(msgspec.Struct, tag=True):
    client: str


class Shutdown(msgspec.Struct, tag=True):
    pass


# ---- engine core -> API server ----------------------------------------------------------------
class Accepted(msgspec.Struct, tag=True):
    request_id: str


class Refused(msgspec.Struct, tag=True):
    request_id: str
    message: str                      # the ValueError's text: the API server makes it a 400


class SampleDelta(msgspec.Struct, array_like=True):
    """One sequence's new tokens this step. `logprobs`: per token, its top list [[id, logprob, rank], ...]."""
    index: int
    token_ids: list[int]
    logprobs: list[list[list]] | None
    finish_reason: str | None
    stop_reason: int | str | None


class RequestDelta(msgspec.Struct, array_like=True):
    request_id: str
    samples: list[SampleDelta]
    num_cached_tokens: int
    prompt_logprobs: list[list[list] | None] | None = None    # the entries new since the last delta
    embedding: list[float] | None = None     # a pooling engine's vector, once its request is done


class Outputs(msgspec.Struct, tag=True):
    deltas: list[RequestDelta]
    failed: str | None = None         # the step raised: these requests were aborted, this is why


class Figures(msgspec.Struct, tag=True):
    """The engine's live figures for /metrics: gauges as they are, counters as totals since start."""
    running: int
    waiting: int
    kv_usage: float
    preemptions: int
    prefix_queries: int
    prefix_hits: int
    generation_tokens: int
    counters: dict = {}               # each extension's (Extension.counters): name -> [help, total or totals]
    prefix_keys: list[bytes] = []     # the prefix keys of the requests it took since its last figures


class AdapterDone(msgspec.Struct, tag=True):
    lora_int_id: int
    error: str | None = None


def figures_of(engine, stats) -> Figures:
    """The engine's figures for /metrics (metrics.py), from engine/stats.py's counts, their one owner."""
    s = engine.scheduler
    counters = {name: list(counter) for ext in engine.extensions for name, counter in ext.counters().items()}
    return Figures(len(s.running), len(s.waiting), s.block_pool.usage(), stats.num_preemptions,
                   stats.prefix_cache_queries, stats.prefix_cache_hits, stats.num_generated_tokens, counters)


TO_CORE = Hello | AddRequest | Abort | Adapter | ClientGone | Shutdown
FROM_CORE = Accepted | Refused | Outputs | Figures | AdapterDone
encode = msgspec.msgpack.Encoder().encode
core_decoder = msgspec.msgpack.Decoder(TO_CORE)          # what the core reads
client_decoder = msgspec.msgpack.Decoder(FROM_CORE)      # what an API server reads


# ---- SamplingParams and LoRARequest as plain data ------------------------------------------------
def params_to_wire(params: SamplingParams) -> dict:
    """The fields a caller may set, as plain values (an enum by name, structured outputs as a dict)."""
    out = {}
    for f in dataclasses.fields(params):
        if not f.init:
            continue
        value = getattr(params, f.name)
        if isinstance(value, RequestOutputKind):
            value = value.name
        elif dataclasses.is_dataclass(value):
            value = dataclasses.asdict(value)
        out[f.name] = value
    return out


def params_from_wire(fields: dict, **changes) -> SamplingParams:
    """SamplingParams again (its own checks run), with `changes` on top; a ValueError if they fail."""
    fields = {**fields, **changes}
    known = {f.name for f in dataclasses.fields(SamplingParams) if f.init}
    unknown = sorted(set(fields) - known)
    if unknown:
        raise ValueError(f"unknown sampling parameters {unknown}")
    if isinstance(fields.get("output_kind"), str):
        fields["output_kind"] = RequestOutputKind[fields["output_kind"]]
    if isinstance(fields.get("structured_outputs"), dict):
        fields["structured_outputs"] = StructuredOutputsParams(**fields["structured_outputs"])
    if isinstance(fields.get("logit_bias"), dict):       # MessagePack keeps int keys; JSON-made dicts may not
        fields["logit_bias"] = {int(k): v for k, v in fields["logit_bias"].items()}
    return SamplingParams(**fields)


def core_params(fields: dict) -> SamplingParams:
    """What the engine core runs: the client's params, but every step's new tokens (DELTA, whatever
    the client asked: the API server builds what it asked from them) and no text work (the API
    server detokenizes and finds stop strings, then aborts the request in the core)."""
    return params_from_wire(fields, detokenize=False, stop=None, include_stop_str_in_output=False,
                            output_kind="DELTA")


def pooling_from_wire(fields: dict):
    """PoolingParams again (its own checks run); a ValueError for a field it does not have."""
    known = {f.name for f in dataclasses.fields(PoolingParams)}
    unknown = sorted(set(fields) - known)
    if unknown:
        raise ValueError(f"unknown pooling parameters {unknown}")
    return PoolingParams(**fields)


def lora_to_wire(lora: LoRARequest | None) -> list | None:
    return None if lora is None else [lora.lora_name, lora.lora_int_id, lora.lora_path]


def lora_from_wire(lora: list | None) -> LoRARequest | None:
    return None if lora is None else LoRARequest(str(lora[0]), int(lora[1]), str(lora[2]))
