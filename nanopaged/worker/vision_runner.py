"""The model runner of a vision-language model: ModelRunner with the model class of its architecture.

The model is a text model with a vision tower beside it (models/idefics3.py, models/qwen2_5_vl.py): the KV
cache, the step's inputs and the logits are the text model's, so only the model it builds changes (its images
are the engine's to encode and place: nanopaged/multimodal/). The fast path's stages (cpu/choose.py) find the
text layers at `model.model`, as in any text model, and fuse only those; the packing stage swaps every plain
linear, the tower's included, which takes its rows as the text model's do.
"""
from __future__ import annotations

from torch import nn

from nanopaged.models.idefics3 import Idefics3ForConditionalGeneration
from nanopaged.models.qwen2_5_vl import Qwen2_5_VLForConditionalGeneration
from nanopaged.worker.model_runner import ModelRunner

# architecture -> the vision-language model's class
VISION_LANGUAGE_MODELS = {
    "Idefics3ForConditionalGeneration": Idefics3ForConditionalGeneration,
    "Qwen2_5_VLForConditionalGeneration": Qwen2_5_VLForConditionalGeneration,
}


class VisionLanguageModelRunner(ModelRunner):
    def build_model(self) -> nn.Module:
        model_class = VISION_LANGUAGE_MODELS[self.model_config.architecture]
        return model_class.build(self.model_config, self.backend, self.config.max_model_len, self.device, self.dtype)
