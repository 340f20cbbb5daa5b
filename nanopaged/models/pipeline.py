"""The model pipeline: every rewrite of a built model, in one fixed order (docs/00_how_to_extend.md).

The model a reader studies (models/llama.py) is built and loaded first; then each chosen stage
takes the model and returns it, in the order of `MODEL_STAGES`:

    tensor_parallel   each rank's layers swapped for parallel ones (extras/tensor_parallel/): runs
                      before the weights load, since the parallel layers decide which slices load
    quantize          linears replaced by quantized ones (cpu/quantized_linear.py)
    pack              the linears left dense packed for the CPU's matrix units (cpu/linear.py)
    adapters          LoRA linears wrapped around the packed or quantized ones (lora/layers.py)
    fuse              every layer described to the C++ layer loop (cpu/fused.py), wrappers included
    head              the output head replaced (pooling/: hidden states in place of logits)

The fast path (cpu/choose.py: FastPath.stages) supplies quantize, pack and fuse; an extension its own
(Extension.model_stages). No stage copies tags from one wrapper to the next: a layer that the C++ loop
can run says so itself (cpu/linear.py: CppLinear).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

from torch import nn

MODEL_STAGES = ("tensor_parallel", "quantize", "pack", "adapters", "fuse", "head")


@dataclass
class ModelStage:
    """One rewrite of the built model: `apply` takes the model and returns it (or a new one)."""
    name: str                                   # one of MODEL_STAGES: where in the pipeline it runs
    apply: Callable[[nn.Module], nn.Module]


def run_pipeline(model: nn.Module, stages: list[ModelStage]) -> nn.Module:
    """Apply the stages in the pipeline's order (two of one name: in the order given)."""
    for stage in sorted(stages, key=lambda s: stage_index(s.name)):
        model = stage.apply(model)
    return model


def stage_index(name: str) -> int:
    if name not in MODEL_STAGES:
        raise ValueError(f"model stage {name!r} is not one of {MODEL_STAGES}")
    return MODEL_STAGES.index(name)
