"""Images: the extension that feeds a vision-language model's encoder and keeps its outputs (vLLM's multimodal path).

Installed with the engine when the model folder holds a vision-language model (its ModelConfig has `vision`).
Through the contract: its input processor turns `{"prompt", "multi_modal_data": {"image": ...}}` into the
expanded token ids and one `EncoderInput` per image (input_processor.py); the scheduler's encoder cache
(core/encoder_cache.py) decides which images a step encodes; `before_forward` encodes them and puts their
rows in place of the image tokens' embeddings (encoder_outputs.py). docs/16_images_and_pooling.md.
"""
from __future__ import annotations

import logging

from nanopaged.engine.extension import Extension
from nanopaged.engine.overlap import without_async_scheduling
from nanopaged.multimodal.encoder_outputs import EncoderOutputs
from nanopaged.multimodal.input_processor import MultiModalInputProcessor, encoder_limits

logger = logging.getLogger(__name__)


class MultiModal(Extension):
    name = "multimodal"

    @classmethod
    def check_config(cls, config) -> None:
        if config.model_config.vision is None:
            return
        spec = config.speculative_config
        method = spec.get("method") if isinstance(spec, dict) else getattr(spec, "method", None)
        refused = {"runner='pooling'": config.runner != "generate",
                   f"tensor_parallel_size={config.tensor_parallel_size}": config.tensor_parallel_size != 1,
                   # w8a8 rotates the hidden states, and the encoder's rows would come in unrotated
                   "quantization='w8a8'": config.quantization == "w8a8",
                   "enable_lora=True (adapters are read for text models' layers)": config.enable_lora,
                   "a draft model (it reads no images; ngram and suffix drafts run)": method == "draft_model"}
        for what, is_set in refused.items():
            if is_set:
                raise ValueError(f"the vision-language model {config.model_config.architecture} cannot run with "
                                 f"{what}")
        without_async_scheduling(config, "a vision-language model", "a step's images are encoded before its "
                                 "forward pass, from the scheduler's decisions of that very step")
        if config.device == "cuda" and not config.enforce_eager:
            logger.info("a vision-language model runs without CUDA graphs: its steps take image rows as input")
            config.enforce_eager = True
        config.max_num_encoder_input_tokens, config.encoder_cache_size = encoder_limits(config)

    @classmethod
    def wanted(cls, config) -> bool:
        return config.model_config.vision is not None

    def attach(self, engine) -> None:
        self.model = engine.runner.model
        self.encoder_cache = engine.scheduler.encoder
        self.outputs = EncoderOutputs(self.model)
        self.base = (0, 0, 0.0)

    def input_processor(self, default):
        return MultiModalInputProcessor(default, type(self.model))

    def before_forward(self, scheduler_output, model_input) -> None:
        self.outputs(scheduler_output, model_input)

    def stats(self) -> dict:
        cache, (hits, encoded, seconds) = self.encoder_cache, self.base
        return {"encoder_cache_entries": len(cache.entries), "encoder_cache_rows": cache.cache_size - cache.num_free,
                "encoder_cache_size": cache.cache_size, "encoder_hits": cache.num_hits - hits,
                "encoder_calls": cache.num_encoded - encoded, "encoder_seconds": self.outputs.seconds - seconds}

    def reset_stats(self) -> None:
        self.base = (self.encoder_cache.num_hits, self.encoder_cache.num_encoded, self.outputs.seconds)

    def counters(self) -> dict:
        cache = self.encoder_cache
        return {"encoder_hits": ("images whose encoder output a request found in the cache", cache.num_hits),
                "encoder_calls": ("images encoded", cache.num_encoded)}

    def progress(self) -> str:
        cache = self.encoder_cache
        return f"img {cache.num_encoded}+{cache.num_hits}hit" if cache.num_encoded else ""
