"""What `build_processor` takes: where the rows go, how many replicas, how big a batch. Checked at once.

Two configs, one processor (processor.py):

    EngineProcessorConfig   replicas that each hold an engine (replica.py): Ray's vLLMEngineProcessorConfig
    ServerProcessorConfig   replicas that send rows to a running `nanopaged serve` (server_replica.py)

The names are ray.data.llm's where it has them (model_source, engine_kwargs, concurrency, batch_size,
max_concurrent_batches), nanopaged's where it does not. Every check runs in the driver, before Ray
starts an actor: a typo is a ValueError naming the field, not a replica that dies on every node.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from nanopaged.config import EngineConfig
from nanopaged.extras.ray_data.rows import params_of
from nanopaged.extras.ray_data.server_replica import check_sendable
from nanopaged.validation import check_range


@dataclass(frozen=True)
class EngineProcessorConfig:
    model_source: str | None = None           # a model folder, a .gguf file, or None: the demo model
    engine_kwargs: dict = field(default_factory=dict)   # LLM's settings, vLLM's names (nanopaged/vllm_compat.py)
    concurrency: int | tuple[int, int] = 1    # replicas; (min, max): Ray scales between them
    batch_size: int = 16                      # rows Ray hands a replica at a time
    # Batches in flight per replica: its engine runs all their rows at once. 16 x 16 = 256 rows, the
    # engine's max_num_seqs: a replica can batch as many rows as LLM.generate would.
    max_concurrent_batches: int = 16
    cpus_per_replica: int = 1                 # Ray's num_cpus for each replica, and its torch threads
    resources_per_replica: dict | None = None   # Ray custom resources a replica needs, e.g. {"replica_slot": 1}
    sampling_params: dict | None = None       # for rows without their own (None: SamplingParams' defaults)

    def __post_init__(self) -> None:
        check_common(self)
        check_range("cpus_per_replica", self.cpus_per_replica, 1, integer=True)
        if not isinstance(self.engine_kwargs, dict):
            raise ValueError(f"engine_kwargs must be a dict of LLM's settings, got {self.engine_kwargs!r}")
        if "cpu_threads" in self.engine_kwargs:
            raise ValueError("engine_kwargs cpu_threads: a replica's threads are cpus_per_replica "
                             "(Ray reserves that many CPUs for it and the replica runs that many torch threads)")
        if self.model_source is not None and Path(self.model_source).is_dir():     # checked here too when local
            EngineConfig.from_kwargs(str(self.model_source), **self.engine_kwargs)

    def replica_kwargs(self) -> dict:
        """The replica's constructor arguments (replica.py: EngineReplica)."""
        return dict(model_source=self.model_source, engine_kwargs=self.engine_kwargs,
                    cpus=self.cpus_per_replica, sampling_params=self.sampling_params)


@dataclass(frozen=True)
class ServerProcessorConfig:
    url: str                                  # the server's base URL, e.g. "http://127.0.0.1:8000"
    model: str | None = None                  # the served model's name (None: the server's own default)
    headers: dict = field(default_factory=dict)   # e.g. {"Authorization": "Bearer ..."} for a server with keys
    concurrency: int | tuple[int, int] = 1
    batch_size: int = 16
    max_concurrent_batches: int = 4
    max_concurrent_requests: int = 32         # requests in flight per replica; the server batches them
    cpus_per_replica: float = 0.25            # a replica only waits on HTTP
    resources_per_replica: dict | None = None
    sampling_params: dict | None = None
    timeout_s: float = 600.0                  # one request's limit; past it the batch fails, and the dataset

    def __post_init__(self) -> None:
        check_common(self)
        if not isinstance(self.url, str) or not self.url.startswith(("http://", "https://")):
            raise ValueError(f"url must be the server's http:// or https:// base URL, got {self.url!r}")
        check_range("max_concurrent_requests", self.max_concurrent_requests, 1, integer=True)
        check_range("cpus_per_replica", self.cpus_per_replica, 0, lo_open=True)
        check_range("timeout_s", self.timeout_s, 0, lo_open=True)
        if not isinstance(self.headers, dict):
            raise ValueError(f"headers must be a dict, got {type(self.headers).__name__}")
        if self.sampling_params is not None:
            check_sendable(params_of({}, self.sampling_params))

    def replica_kwargs(self) -> dict:
        """The replica's constructor arguments (server_replica.py: ServerReplica)."""
        return dict(url=self.url.rstrip("/"), model=self.model, headers=self.headers,
                    max_concurrent_requests=self.max_concurrent_requests, sampling_params=self.sampling_params,
                    timeout_s=self.timeout_s)


def check_common(config) -> None:
    check_concurrency(config.concurrency)
    check_range("batch_size", config.batch_size, 1, integer=True)
    check_range("max_concurrent_batches", config.max_concurrent_batches, 1, integer=True)
    resources = config.resources_per_replica
    if resources is not None and (not isinstance(resources, dict) or
                                  not all(isinstance(k, str) for k in resources)):
        raise ValueError(f"resources_per_replica must be a dict of Ray resource names to amounts, got {resources!r}")
    for name, amount in (resources or {}).items():
        check_range(f"resources_per_replica[{name!r}]", amount, 0, lo_open=True)
    if config.sampling_params is not None:
        if not isinstance(config.sampling_params, dict):
            raise ValueError(f"sampling_params must be a dict of SamplingParams fields, got {config.sampling_params!r}")
        params_of({}, config.sampling_params)             # a row's checks, here rather than on every row


def check_concurrency(concurrency) -> None:
    """An int (a fixed pool of replicas) or a (min, max) pair (Ray scales the pool between them)."""
    if isinstance(concurrency, (tuple, list)):
        if len(concurrency) != 2:
            raise ValueError(f"concurrency must be an int or a (min, max) pair, got {concurrency!r}")
        low, high = concurrency
        check_range("concurrency min", low, 1, integer=True)
        check_range("concurrency max", high, low, integer=True)
    else:
        check_range("concurrency", concurrency, 1, integer=True)


def pool_size(concurrency) -> dict:
    """ActorPoolStrategy's arguments for a concurrency."""
    if isinstance(concurrency, (tuple, list)):
        return {"min_size": concurrency[0], "max_size": concurrency[1]}
    return {"size": concurrency}
