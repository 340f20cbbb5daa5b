"""nanopaged: a small, readable LLM inference engine built on PagedAttention.

    from nanopaged import LLM, SamplingParams
    llm = LLM()                       # the demo model, SmolLM2-135M-Instruct
    outs = llm.generate(["Hello"], SamplingParams(temperature=0, max_tokens=20))

Reading order: docs/00_how_to_read.md lists the reading path file by file; how to extend the
engine: docs/00_how_to_extend.md.
"""
from nanopaged.logger import configure_logging

configure_logging()

from nanopaged.config import EngineConfig  # noqa: E402  (the log is set up before anything logs)
from nanopaged.engine.llm_engine import LLMEngine  # noqa: E402
from nanopaged.extras.beam_search import BeamSearchOutput, BeamSearchParams, BeamSearchSequence  # noqa: E402
from nanopaged.inputs import TextPrompt, TokensPrompt  # noqa: E402
from nanopaged.llm import LLM  # noqa: E402
from nanopaged.lora.request import LoRARequest  # noqa: E402
from nanopaged.models.demo_model import DEMO_MODEL  # noqa: E402
from nanopaged.outputs import CompletionOutput, RequestOutput  # noqa: E402
from nanopaged.pooling.outputs import EmbeddingRequestOutput  # noqa: E402
from nanopaged.pooling_params import PoolingParams  # noqa: E402
from nanopaged.sampling_params import RequestOutputKind, SamplingParams  # noqa: E402
from nanopaged.structured_output.params import StructuredOutputsParams  # noqa: E402

__all__ = ["LLM", "LLMEngine", "EngineConfig", "SamplingParams", "RequestOutputKind", "RequestOutput",
           "CompletionOutput", "BeamSearchParams", "BeamSearchOutput", "BeamSearchSequence", "DEMO_MODEL",
           "TextPrompt", "TokensPrompt", "StructuredOutputsParams", "LoRARequest", "PoolingParams",
           "EmbeddingRequestOutput"]
__version__ = "0.1.0"
