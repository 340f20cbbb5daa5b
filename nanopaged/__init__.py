"""nanopaged: a small, readable LLM inference engine built on PagedAttention.

The package (each folder's __init__.py indexes its own files):

    llm.py               LLM: vLLM's offline API, a loop over the engine
    config.py            EngineConfig: every engine setting, checked once
    extensions.py        the registry: every extension the engine can install, in the order their hooks run
    sampling_params.py   SamplingParams: how one request picks its tokens
    pooling_params.py    PoolingParams: what one embedding request asks for
    inputs.py            vLLM's prompt dicts (TokensPrompt, TextPrompt)
    outputs.py           what generate returns: RequestOutput, CompletionOutput
    validation.py        the one range check every settings object uses
    reasoning.py         reasoning parsers: a thinking model's reasoning told apart from its answer
    vllm_compat.py       vLLM's engine arguments and fields by vLLM's names, none dropped silently
    logger.py            the `nanopaged` logger
    core/                the block pool, a request's counters and block table, the scheduler (no torch)
    engine/              LLMEngine: requests in, one step at a time, RequestOutputs out
    worker/              the model runner: slot mapping, block tables, the forward pass
    attention/           the step's attention metadata and the backends
    models/              the Llama-family model, its config and its weights
    sample/              token selection: from a step's logits to each request's tokens
    cpu/                 the CPU fast path and its C++ kernels
    structured_output/   outputs held to a JSON schema, a regex, choices or a grammar
    spec_decode/         speculative decoding: drafts, verified in one pass
    lora/                LoRA adapters, many in one step
    pooling/             embeddings, classification, rewards and scores: LLM(model, runner="pooling")
    multimodal/          images for vision-language models: checked, processed, encoded once, cached
    kv_disk/             the prefix cache's disk tier: full blocks in files named by their chained hash
    extras/              beam search, tensor parallelism, Ray Data
    entrypoints/         `nanopaged serve` and its processes

In use:

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
from nanopaged.pooling.outputs import (ClassificationRequestOutput, EmbeddingRequestOutput,  # noqa: E402
                                       PoolingRequestOutput, ScoringRequestOutput)
from nanopaged.pooling_params import PoolingParams  # noqa: E402
from nanopaged.sampling_params import RequestOutputKind, SamplingParams  # noqa: E402
from nanopaged.structured_output.params import StructuredOutputsParams  # noqa: E402

__all__ = ["LLM", "LLMEngine", "EngineConfig", "SamplingParams", "RequestOutputKind", "RequestOutput",
           "CompletionOutput", "BeamSearchParams", "BeamSearchOutput", "BeamSearchSequence", "DEMO_MODEL",
           "TextPrompt", "TokensPrompt", "StructuredOutputsParams", "LoRARequest", "PoolingParams",
           "EmbeddingRequestOutput", "ClassificationRequestOutput", "PoolingRequestOutput", "ScoringRequestOutput"]
__version__ = "0.1.0"
