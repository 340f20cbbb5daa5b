"""Ray Data: one dataset through many engine replicas, on one machine or many.

    config.py           EngineProcessorConfig, ServerProcessorConfig: what build_processor takes, checked at once
    rows.py             a row in (a prompt or messages, its sampling params), a row out (text, tokens, error, stats)
    replica.py          EngineReplica: a Ray actor holding one LLMEngine, kept full across the batches it is handed
    server_replica.py   ServerReplica: the same rows through a running `nanopaged serve`, over its OpenAI API
    processor.py        build_processor: preprocess -> the replicas (map_batches) -> postprocess, on a Dataset

Ray schedules, streams, retries and scales; nanopaged only says what a replica is. The shape is
Ray's own `ray.data.llm` (build_processor, a config naming the engine, its concurrency and batch
size), so a vLLM user's script changes its config line. Needs the `[ray]` extra.
docs/14_ray_data.md.
"""
from nanopaged.extras.ray_data.config import EngineProcessorConfig, ServerProcessorConfig
from nanopaged.extras.ray_data.processor import Processor, build_processor

__all__ = ["EngineProcessorConfig", "ServerProcessorConfig", "Processor", "build_processor"]
