"""Every extension the engine can install: one registration line each (docs/00_how_to_extend.md).

The order is the order of their hooks within a step: images are read before anything else sees a request
(a vision-language model's input processor); pooling takes the token-selection seat before
anything could wrap it; adapters join before the others see requests; a grammar masks logits and
ends outputs before the drafter, which asks it for forced drafts, wraps token selection. The disk tier
comes last: it supplies blocks at admission and writes the step's full blocks after every other observer.
(What runs across ranks is not here: extras/ comes in through LLM.make_runner, nanopaged/llm.py.)
"""
from nanopaged.kv_disk.extension import KVDisk
from nanopaged.lora.extension import LoRA
from nanopaged.multimodal.extension import MultiModal
from nanopaged.pooling.extension import Pooling
from nanopaged.spec_decode.extension import SpeculativeDecoding
from nanopaged.structured_output.extension import StructuredOutputs

EXTENSIONS = (MultiModal, Pooling, LoRA, StructuredOutputs, SpeculativeDecoding, KVDisk)
