"""nanopaged: a small, readable LLM inference engine built on PagedAttention.

    from nanopaged import LLM, SamplingParams
    llm = LLM()                       # the demo model, SmolLM2-135M-Instruct
    outs = llm.generate(["Hello"], SamplingParams(temperature=0, max_tokens=20))

Reading order: docs/00_how_to_read.md lists the reading path file by file.
"""
from nanopaged.logger import configure_logging

configure_logging()

from nanopaged.config import EngineConfig  # noqa: E402  (the log is set up before anything logs)
from nanopaged.engine.llm_engine import LLMEngine  # noqa: E402
from nanopaged.llm import LLM  # noqa: E402
from nanopaged.outputs import CompletionOutput, RequestOutput  # noqa: E402
from nanopaged.sampling_params import RequestOutputKind, SamplingParams  # noqa: E402

# Names of code that `LLM.generate` never runs, imported when first used, so `import
# nanopaged` loads the reading path and nothing else (PEP 562: a module's __getattr__).
_ON_FIRST_USE = {"BeamSearchParams": "nanopaged.extras.beam_search", "BeamSearchOutput": "nanopaged.extras.beam_search",
                 "BeamSearchSequence": "nanopaged.extras.beam_search", "DEMO_MODEL": "nanopaged.models.demo_model",
                 "TextPrompt": "nanopaged.inputs", "TokensPrompt": "nanopaged.inputs",
                 "StructuredOutputsParams": "nanopaged.structured_output.params", "LoRARequest": "nanopaged.lora.request",
                 "PoolingParams": "nanopaged.pooling_params", "EmbeddingRequestOutput": "nanopaged.pooling.outputs"}


def __getattr__(name: str):
    if name not in _ON_FIRST_USE:
        raise AttributeError(f"module 'nanopaged' has no attribute {name!r}")
    import importlib
    return getattr(importlib.import_module(_ON_FIRST_USE[name]), name)


__all__ = ["LLM", "LLMEngine", "EngineConfig", "SamplingParams", "RequestOutputKind", "RequestOutput",
           "CompletionOutput", *_ON_FIRST_USE]
__version__ = "0.1.0"
