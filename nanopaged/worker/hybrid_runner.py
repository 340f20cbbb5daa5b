"""The model runner of a hybrid model: one memory of equal pages, seen as K/V by attention layers and as
state by linear layers (models/hybrid.py explains the layout; docs/15_hybrid_models.md).

It changes four things of ModelRunner and nothing else: the model it builds, the memory (one byte tensor
per position in a layer group, each cut into the pool's pages), the per-layer views the model reads
(an attention layer's (K, V) blocks, a linear layer's (conv, recurrent) states), and the copies: a page is
copied the same way whatever it holds (copy-on-write, a fork's state, a restored snapshot).
"""
from __future__ import annotations

import math

import torch
from torch import nn

from nanopaged.config import check_memory_fits
from nanopaged.core.scheduler import SchedulerOutput
from nanopaged.models.granite_hybrid import GraniteHybridForCausalLM
from nanopaged.models.qwen3_5 import Qwen3_5ForCausalLM
from nanopaged.worker.model_runner import ModelInput, ModelRunner


# architecture -> the hybrid's model class
HYBRID_MODELS = {"Qwen3_5ForCausalLM": Qwen3_5ForCausalLM, "GraniteMoeHybridForCausalLM": GraniteHybridForCausalLM}


class HybridModelRunner(ModelRunner):
    def build_model(self) -> nn.Module:
        model_class = HYBRID_MODELS[self.model_config.architecture]
        return model_class.build(self.model_config, self.backend, self.config.max_model_len, self.device, self.dtype,
                                 steps=self.fast_path.steps())

    def kv_cache_shape(self, num_blocks: int) -> tuple[int, ...]:
        """One attention layer's pages per position in a group: the memory is sized by them."""
        m = self.model_config
        return (m.hybrid.group_size, 2, num_blocks, self.block_size, m.num_key_value_heads, m.head_dim)

    def allocate_kv_cache(self, num_blocks: int) -> list:
        """The pages as bytes, (positions, pages, page bytes), zeroed; returns the views each layer reads."""
        positions, _, _, *page = self.kv_cache_shape(num_blocks)
        page_bytes = 2 * math.prod(page) * self.kv_cache_dtype.itemsize
        check_memory_fits(positions * num_blocks * page_bytes, self.device.type, f"a cache of {num_blocks} pages")
        self.pages = torch.zeros((positions, num_blocks, page_bytes), dtype=torch.uint8, device=self.device)
        return [self.layer_view(i) for i in range(self.model_config.num_hidden_layers)]

    def layer_view(self, layer: int):
        """Attention: (K, V), each (pages, block_size, kv_heads, head_dim). Linear: each state tensor of
        models/hybrid.py's `state_shapes`, (pages, *shape) float32, laid one after the other in the page."""
        m = self.model_config
        position, group = m.hybrid.place(layer)
        pages = self.pages[position]
        if group < 0:
            kv = pages.view(self.kv_cache_dtype).view(pages.shape[0], 2, self.block_size, m.num_key_value_heads,
                                                        m.head_dim)
            return kv[:, 0], kv[:, 1]
        values, views, start = pages.view(torch.float32), [], 0
        for shape in m.hybrid.state_shapes:
            views.append(values[:, start:start + math.prod(shape)].view(pages.shape[0], *shape))
            start += math.prod(shape)
        return tuple(views)

    def prepare_inputs(self, out: SchedulerOutput) -> ModelInput:
        inputs = super().prepare_inputs(out)
        meta, bs = inputs.meta, self.block_size
        meta.state_pages = [request.state_pages for request, _ in out.scheduled]
        meta.has_state = [request.num_computed_tokens > 0 for request, _ in out.scheduled]
        # the states a step keeps for the prefix cache: (rows into the request's step, pages), core/state_pages.py
        meta.snapshots = [[((index + 1) * bs - request.num_computed_tokens, pages)
                           for index, pages in request.pending_snapshots] for request, _ in out.scheduled]
        return inputs

    def copy_blocks(self, pairs: list[tuple[int, int]]) -> None:
        """A page's bytes in every position: a block of K/V or a group's state alike."""
        if not pairs:
            return
        src = torch.tensor([s for s, _ in pairs], device=self.device)
        dst = torch.tensor([d for _, d in pairs], device=self.device)
        self.pages[:, dst] = self.pages[:, src]
