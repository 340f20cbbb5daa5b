"""Pipeline parallelism's place in the engine's contract: its refusals, checked before any process starts,
and its figures in get_stats()["pipeline_parallel"].

It is not in the registry (nanopaged/extensions.py), whose extensions every engine imports: the layers
below LLM never import extras/. LLM.make_runner (nanopaged/llm.py) runs its check_config before it builds the
runner, as tensor parallelism's comes in, and installs it once the engine is built.
"""
from __future__ import annotations

from nanopaged.engine.extension import Extension
from nanopaged.engine.overlap import without_async_scheduling


class PipelineParallel(Extension):
    name = "pipeline_parallel"

    @classmethod
    def check_config(cls, config) -> None:
        """Each combination it cannot run, refused by name with the reason, before any weight loads."""
        pp = config.pipeline_parallel_size
        if pp == 1:
            return
        m = config.model_config
        refused = {
            "enable_lora=True": (config.enable_lora, "adapters run in one process (their slots hold every layer)"),
            "speculative_config": (config.speculative_config is not None,
                                   "drafts need each step's tokens before the next step is scheduled, while "
                                   "micro-batches are scheduled before the earlier ones' tokens are back"),
            f"runner={config.runner!r}": (config.runner != "generate",
                                          "pooling reads every layer's output in one process"),
            "a vision-language model": (m.vision is not None, "its image encoder runs in one process"),
            "a hybrid model": (m.hybrid is not None, "its state pages are not split by stage"),
            f"quantization={config.quantization!r}": (config.quantization is not None,
                                                     "quantized layers run in one process"),
        }
        for what, (present, why) in refused.items():
            if present:
                raise ValueError(f"pipeline_parallel_size={pp} cannot run with {what}: {why}")
        if pp > m.num_hidden_layers:
            raise ValueError(f"pipeline_parallel_size={pp} is more than the model's {m.num_hidden_layers} layers "
                             "(each stage holds at least one)")
        without_async_scheduling(config, f"pipeline_parallel_size={pp}", "the pipeline keeps micro-batches in "
                                 "flight instead (engine/batch_queue.py)")
        if config.device == "cuda":
            import torch       # only where CUDA is asked for
            ranks = pp * config.tensor_parallel_size
            if ranks > torch.cuda.device_count():
                raise ValueError(f"pipeline_parallel_size x tensor_parallel_size = {ranks} ranks, more than the "
                                 f"{torch.cuda.device_count()} CUDA devices here (one rank per device)")

    @classmethod
    def wanted(cls, config) -> bool:
        return config.pipeline_parallel_size > 1

    def attach(self, engine) -> None:
        self.engine = engine
        self.base = engine.runner.figures()

    def reset_stats(self) -> None:
        self.base = self.engine.runner.figures()

    def stats(self) -> dict:
        """Since the last reset: each stage's seconds busy and bubble (the share of the wall time batches were
        in flight that it waited), the bytes between stages per batch. Fixed or since the start: each stage's
        layers, each rank's weight and K/V bytes, the most batches in flight at once."""
        now, base = self.engine.runner.figures(), self.base
        wall = now["wall_s"] - base["wall_s"]
        busy = [b - a for a, b in zip(base["busy_s"], now["busy_s"])]
        batches = now["batches"] - base["batches"]
        queue = self.engine.batch_queue
        return {"stages": now["stages"], "memory_per_rank": [{"weight_bytes": w, "kv_cache_bytes": kv}
                                                             for w, kv in now["memory"]],
                "busy_s": busy, "wall_s": wall, "bubble": [1 - b / wall if wall else 0.0 for b in busy],
                "batches": batches, "max_batches_in_flight": queue.max_in_flight if queue else 1,
                "bytes_between_stages_per_batch": ((now["bytes_between_stages"] - base["bytes_between_stages"])
                                                   / batches if batches else 0.0)}
