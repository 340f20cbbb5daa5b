"""nanopaged: a small, readable LLM inference engine built on PagedAttention.

    from nanopaged import LLM, SamplingParams
    llm = LLM()                       # the demo model, SmolLM2-135M-Instruct
    outs = llm.generate(["Hello"], SamplingParams(temperature=0, max_tokens=20))

Reading order: nanopaged/core/ (its __init__ lists the files), then docs/README.md.
"""
from nanopaged.config import EngineConfig
from nanopaged.core.engine import LLMEngine
from nanopaged.extras.beam_search import BeamSearchOutput, BeamSearchParams, BeamSearchSequence
from nanopaged.extras.demo_model import DEMO_MODEL
from nanopaged.llm import LLM
from nanopaged.outputs import CompletionOutput, RequestOutput
from nanopaged.sampling_params import SamplingParams

__all__ = ["LLM", "LLMEngine", "EngineConfig", "SamplingParams", "RequestOutput",
           "CompletionOutput", "BeamSearchParams", "BeamSearchOutput", "BeamSearchSequence", "DEMO_MODEL"]
__version__ = "0.1.0"
