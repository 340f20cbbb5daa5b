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
from torch import nn

from nanopaged.config import EngineConfig, check_memory_fits
from nanopaged.models.config import ModelConfig
from nanopaged.models.llama import LlamaForCausalLM
from nanopaged.models.pipeline import ModelStage, run_pipeline
from nanopaged.worker.model_runner import ModelRunner
from nanopaged.extras.tensor_parallel.layers import parallelize, rank_config
from nanopaged.extras.tensor_parallel.parallel_state import Address, RankGroup, join
from nanopaged.extras.tensor_parallel.shard_loader import load_shard
from nanopaged.extras.tensor_parallel.step_message import HEADER_LEN, STOP, StepInputs, body_len, unpack


class RankRunner(ModelRunner):
    kind = "tensor-parallel"             # how errors name its workers

    def __init__(self, config: EngineConfig, group: RankGroup) -> None:
        self.group = group
        super().__init__(config, device=group.device, model_config=self.rank_model_config(config))
        self.memory = group.gather_ints([self.weight_bytes(), self.kv_cache.nbytes])   # rank 0: per rank

    # ---- the job: how many ranks, how one joins, what a worker serves -------------------------------
    @staticmethod
    def num_ranks(config: EngineConfig) -> int:
        return config.tensor_parallel_size

    @classmethod
    def join_group(cls, config: EngineConfig, rank: int, address: Address | None, store=None) -> RankGroup:
        return join(rank, cls.num_ranks(config), config.device, address, store)

    def serve(self) -> None:
        """A worker's loop: receive a step (the driver's broadcast), run it, repeat; return on STOP."""
        header = torch.empty(HEADER_LEN, dtype=torch.long)
        while True:
            self.group.broadcast_from_driver(header)
            if header[0].item() == STOP:
                return
            body = self.group.broadcast_from_driver(torch.empty(body_len(header), dtype=torch.long))
            self.run(unpack(header, body, self.block_size, self.device))

    def rank_model_config(self, config: EngineConfig) -> ModelConfig:
        """The model this rank builds: 1/N of the heads, MLP width, experts or vocabulary (layers.py)."""
        return rank_config(config.model_config, self.group.world_size, config.enable_expert_parallel)

    def load_model(self) -> nn.Module:
        """This rank's share of the model: the pipeline's tensor_parallel stage runs before its slices
        load (the parallel layers decide which); the fast path packs and fuses nothing under tensor
        parallelism (cpu/choose.py), so the rest of the pipeline is the extensions' own, if any."""
        check_memory_fits(self.share_bytes(), self.device.type, f"rank {self.group.rank}'s share of the weights",
                          "load a smaller model or dtype, or use more ranks")    # before a tensor is made or read
        model = run_pipeline(self.build_model(), [ModelStage("tensor_parallel", self._parallelize)]).to(self.dtype)
        load_shard(model, self.config.model, self.group.rank, self.checkpoint_rename())
        return run_pipeline(model, self.fast_path.stages() + self.stages).eval()

    def checkpoint_rename(self):
        """The checkpoint's names as this rank's model knows them (a pipeline stage's layers); None: as they are."""
        return None

    def _parallelize(self, model: nn.Module) -> nn.Module:
        if self.group.world_size > 1:         # a pipeline stage of one rank is not split
            parallelize(model, self.config.model_config, self.group, self.config.enable_expert_parallel)
        return model

    def share_bytes(self) -> int:
        """The bytes this rank's weights will take: its model built on the meta device (no memory) and
        parallelized, so 1/N of the split layers, the replicated ones whole, E/N whole experts under
        expert parallelism."""
        return sum(p.nbytes for p in self._parallelize(self.build_on(torch.device("meta"))).parameters())

    def build_on(self, device: torch.device) -> nn.Module:
        """This rank's model on `device`, weights not loaded (`build_model` on the rank's device)."""
        return LlamaForCausalLM.build(self.model_config, self.backend, self.config.max_model_len, device, self.dtype)

    def build_model(self) -> nn.Module:
        return self.build_on(self.device)

    def determine_num_kv_blocks(self) -> int:
        """Every rank must hold the same blocks: the smallest count any rank can afford."""
        return self.group.agree_on_min(super().determine_num_kv_blocks())

    def wrap_model(self, model: nn.Module) -> nn.Module:
        return model      # eagerly: CUDA graphs would have to capture the collectives

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
