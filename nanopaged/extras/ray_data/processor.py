"""build_processor: a dataset of prompts in, the same rows with their generations out, lazily.

    ds = build_processor(config, preprocess=..., postprocess=...)(ds)

is three Ray Data operators on `ds`, nothing more:

    ds.map(preprocess)            a row of yours -> a row in (rows.py); plain tasks, any node
    ds.map_batches(Replica, ...)  a pool of `concurrency` actors, each one replica (replica.py or
                                  server_replica.py), fed `batch_size` rows at a time, up to
                                  `max_concurrent_batches` batches in flight per actor
    ds.map(postprocess)           a row out -> a row of yours

Nothing runs until the dataset is consumed (iter_rows, write_parquet, take); then Ray streams:
blocks flow through the three operators with back-pressure, so a dataset larger than memory is
never held in one place. Ray places the actors (num_cpus and custom resources per replica), restarts
a dead one and hands its unfinished batches to another (Ray Data's defaults for actor pools: restarts
and task retries unlimited). Ray's own ray.data.llm builds the same three stages around vLLM.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

from nanopaged.extras.ray_data.config import EngineProcessorConfig, ServerProcessorConfig, pool_size


@dataclass(frozen=True)
class Processor:
    config: EngineProcessorConfig | ServerProcessorConfig
    preprocess: Callable[[dict], dict] | None = None
    postprocess: Callable[[dict], dict] | None = None

    def __call__(self, ds):
        """The processor's operators appended to the dataset `ds` (a ray.data.Dataset); runs nothing yet."""
        import ray.data
        config = self.config
        if self.preprocess is not None:
            ds = ds.map(self.preprocess)
        ds = ds.map_batches(
            replica_class(config),
            fn_constructor_kwargs=config.replica_kwargs(),
            batch_size=config.batch_size,
            batch_format="pyarrow",
            # up to max_concurrent_batches batches sent to each actor, and running in it at once
            compute=ray.data.ActorPoolStrategy(**pool_size(config.concurrency),
                                               max_tasks_in_flight_per_actor=config.max_concurrent_batches,
                                               max_concurrent_calls_per_actor=config.max_concurrent_batches),
            num_cpus=config.cpus_per_replica,
            resources=config.resources_per_replica,
        )
        if self.postprocess is not None:
            ds = ds.map(self.postprocess)
        return ds


def build_processor(config: EngineProcessorConfig | ServerProcessorConfig,
                    preprocess: Callable[[dict], dict] | None = None,
                    postprocess: Callable[[dict], dict] | None = None) -> Processor:
    """ray.data.llm's build_processor, for nanopaged's two configs."""
    if not isinstance(config, (EngineProcessorConfig, ServerProcessorConfig)):
        raise ValueError(f"config must be an EngineProcessorConfig or a ServerProcessorConfig, "
                         f"got {type(config).__name__}")
    for name, fn in (("preprocess", preprocess), ("postprocess", postprocess)):
        if fn is not None and not callable(fn):
            raise ValueError(f"{name} must be a function of a row, got {fn!r}")
    return Processor(config, preprocess, postprocess)


def replica_class(config) -> type:
    if isinstance(config, EngineProcessorConfig):
        from nanopaged.extras.ray_data.replica import EngineReplica
        return EngineReplica
    from nanopaged.extras.ray_data.server_replica import ServerReplica
    return ServerReplica
