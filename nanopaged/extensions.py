"""Every extension the engine can install: one registration line each (docs/00_how_to_extend.md).

The order is the order of their hooks within a step: images are read before anything else sees a request
(a vision-language model's input processor); pooling takes the token-selection seat before
anything could wrap it; adapters join before the others see requests; a grammar masks logits and
ends outputs before the drafter, which asks it for forced drafts, wraps token selection. Pipeline
parallelism only checks the settings and reports its figures (its runner comes through make_runner). The
disk tier comes last: it supplies blocks at admission and writes the step's full blocks after every other observer.
"""
from nanopaged.extras.pipeline_parallel.extension import PipelineParallel
from nanopaged.kv_disk.extension import KVDisk
from nanopaged.lora.extension import LoRA
from nanopaged.multimodal.extension import MultiModal
from nanopaged.pooling.extension import Pooling
from nanopaged.spec_decode.extension import SpeculativeDecoding
from nanopaged.structured_output.extension import StructuredOutputs

EXTENSIONS = (MultiModal, Pooling, LoRA, StructuredOutputs, SpeculativeDecoding, PipelineParallel, KVDisk)
