"""The LoRA settings (EngineConfig's enable_lora, max_loras, max_lora_rank, max_cpu_loras), checked when
enable_lora=True, before any weight loads."""
from __future__ import annotations

from nanopaged.validation import check_range


def check_lora_settings(cfg) -> None:
    """vLLM's LoRA settings, and where adapters cannot run: across tensor-parallel ranks (their A and B
    are not sharded) and under CUDA graphs (a graph replays one step's grouping of rows by adapter)."""
    check_range("max_loras", cfg.max_loras, 1, integer=True)
    check_range("max_lora_rank", cfg.max_lora_rank, 1, 512, integer=True)
    check_range("max_cpu_loras", cfg.max_cpu_loras, cfg.max_loras, integer=True, optional=True)
    if cfg.max_cpu_loras is None:
        cfg.max_cpu_loras = cfg.max_loras
    if cfg.model_config.moe is not None:
        raise ValueError("enable_lora=True runs on dense models: nanopaged applies no adapter to a mixture of "
                         "experts' experts")
    if cfg.tensor_parallel_size > 1:
        raise ValueError(f"enable_lora=True runs in one process: with tensor_parallel_size="
                         f"{cfg.tensor_parallel_size} the ranks hold slices of each linear, and nanopaged does "
                         "not slice adapters' A and B to match")
    if cfg.device == "cuda" and not cfg.enforce_eager:
        raise ValueError("enable_lora=True on CUDA needs enforce_eager=True: a CUDA graph would replay one "
                         "step's grouping of rows by adapter")
