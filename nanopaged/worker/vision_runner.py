"""The model runner of a vision-language model: ModelRunner building the architecture's own class
(its images are the engine's to encode and place: nanopaged/multimodal/)."""
from __future__ import annotations

from torch import nn

from nanopaged.models.qwen2_5_vl import Qwen2_5_VLForConditionalGeneration
from nanopaged.worker.model_runner import ModelRunner

# architecture -> the vision-language model's class
VISION_LANGUAGE_MODELS = {
    "Qwen2_5_VLForConditionalGeneration": Qwen2_5_VLForConditionalGeneration,
}


class VisionLanguageModelRunner(ModelRunner):
    def build_model(self) -> nn.Module:
        model_class = VISION_LANGUAGE_MODELS[self.model_config.architecture]
        return model_class.build(self.model_config, self.backend, self.config.max_model_len, self.device, self.dtype)
