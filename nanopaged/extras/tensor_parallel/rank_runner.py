"""What every rank runs: its share of the model, and the KV cache of its own KV heads.

The driver (rank 0) and each worker build the same object. It is a ModelRunner whose model
has 1/N of the heads (layers.py), loaded from this rank's slices (shard_loader.py), and whose
KV cache holds the same number of blocks as every other rank's, each block holding only this
rank's KV heads: (layers, K/V, blocks, block_size, kv_heads / N, head_dim). Block b is the
same tokens on every rank, so the driver's one block table addresses all of them (the
paper's section 4.6). The KV sizing and copy-on-write copies are ModelRunner's own; the
budget (`kv_cache_memory_bytes`, `gpu_memory_utilization`) is per rank, as in vLLM.
"""
from __future__ import annotations

import torch

from nanopaged.config import EngineConfig, load_attention_backend
from nanopaged.core.model_runner import ModelRunner
from nanopaged.extras.tensor_parallel.layers import parallelize, rank_config
from nanopaged.extras.tensor_parallel.parallel_state import RankGroup
from nanopaged.extras.tensor_parallel.shard_loader import load_shard
from nanopaged.extras.tensor_parallel.step_message import StepInputs
from nanopaged.models.llama import LlamaForCausalLM


class RankRunner(ModelRunner):
    def __init__(self, config: EngineConfig, group: RankGroup) -> None:
        # ModelRunner's attributes (its KV sizing, prepare_inputs and copy_blocks read them),
        # set here because its __init__ would build and load the whole model.
        self.config, self.group = config, group
        self.model_config = rank_config(config.model_config, group.world_size)
        self.block_size = config.block_size
        self.device = group.device
        self.dtype = getattr(torch, config.dtype)
        self.backend = load_attention_backend(config.attention_backend)
        with torch.device(self.device):
            model = LlamaForCausalLM(self.model_config, self.backend, config.max_model_len)
            parallelize(model, config.model_config, group)
        self.model = model.to(self.dtype)
        load_shard(self.model, config.model, group.rank)
        self.model.eval()
        # Every rank must hold the same blocks: the smallest count any rank can afford.
        self.num_kv_blocks = group.agree_on_min(self._num_kv_blocks())
        self.kv_cache = self._allocate_kv_cache(self.num_kv_blocks)
        # Run eagerly: no backend.wrap_model, since CUDA graphs would have to capture the collectives.
        self.memory = group.gather_ints([self.weight_bytes(), self.kv_cache.nbytes])   # rank 0: per rank

    def weight_bytes(self) -> int:
        return sum(p.nbytes for p in self.model.parameters())   # a tied lm_head counts once

    @torch.inference_mode()
    def run(self, step: StepInputs) -> torch.Tensor | None:
        """One step: copy-on-write copies, the forward (its all-reduces), then the logits of
        `step.logit_rows`, gathered on rank 0 (None on the other ranks, and when no row samples)."""
        self.copy_blocks(step.blocks_to_copy)
        hidden = self.model(step.input_ids, step.positions, self.kv_cache, step.meta)
        if not step.logit_rows:
            return None
        return self.model.compute_logits(hidden[step.logit_rows])
