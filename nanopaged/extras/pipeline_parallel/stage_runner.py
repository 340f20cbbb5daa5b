"""What every rank of a pipeline runs: its stage's layers, the KV cache of those layers only.

A StageRunner is a RankRunner (tensor_parallel/rank_runner.py) whose model holds one stage's layers
(stages.py), split again across the stage's tensor-parallel ranks when there are several, and whose
KV cache is (its layers, K/V, blocks, block_size, kv_heads / T, head_dim). Every rank holds the same
number of blocks (the smallest any rank can afford, agreed over the whole job), so the driver's one
block table addresses all of them. A worker's loop (`serve`): receive a batch from the stage before
(or the driver's broadcast, on the first stage), run its layers, hand the hidden states on; the last
stage ends with the final norm and sends the hidden states of the rows that sample back to the driver,
whose stage holds the head. On the first stage's other tensor-parallel ranks the loop also takes a HEAD
message: those rows, for their share of the vocabulary-parallel head (the logits gather on the driver).
"""
from __future__ import annotations

import time

import torch
from torch import nn

from nanopaged.config import EngineConfig
from nanopaged.extras.pipeline_parallel.stage_group import PipelineGroup, join_pipeline
from nanopaged.extras.pipeline_parallel.stages import keep_stage, materialize, split_model, stage_config, stage_rename
from nanopaged.extras.tensor_parallel.parallel_state import Address
from nanopaged.extras.tensor_parallel.rank_runner import RankRunner
from nanopaged.extras.tensor_parallel.step_message import HEAD, HEADER_LEN, STOP, StepInputs, body_len, unpack
from nanopaged.models.config import ModelConfig
from nanopaged.models.llama import LlamaForCausalLM


class StageRunner(RankRunner):
    kind = "pipeline-parallel"
    group: PipelineGroup

    def __init__(self, config: EngineConfig, group: PipelineGroup) -> None:
        self.layers_per_stage = split_model(config.model_config, group.num_stages)
        self.layers = self.layers_per_stage[group.stage]
        self.busy_s = 0.0            # seconds this rank spent computing its stage (the rest: waiting)
        super().__init__(config, group)

    # ---- the job ------------------------------------------------------------------------------------------
    @staticmethod
    def num_ranks(config: EngineConfig) -> int:
        return config.tensor_parallel_size * config.pipeline_parallel_size

    @classmethod
    def join_group(cls, config: EngineConfig, rank: int, address: Address | None, store=None) -> PipelineGroup:
        return join_pipeline(config, rank, address, store)

    # ---- the stage's model ---------------------------------------------------------------------------------
    def rank_model_config(self, config: EngineConfig) -> ModelConfig:
        return stage_config(super().rank_model_config(config), self.layers)

    def build_on(self, device: torch.device) -> nn.Module:
        """Built on the meta device (no memory), cut to the stage, then given memory on `device`."""
        model = LlamaForCausalLM.build(self.model_config, self.backend, self.config.max_model_len,
                                       torch.device("meta"), self.dtype)
        model = keep_stage(model, self.group.is_first, self.group.is_last)
        return model if device.type == "meta" else materialize(model, self.model_config, self.config.max_model_len,
                                                               device)

    def checkpoint_rename(self):
        g = self.group
        return stage_rename(self.layers, g.is_first, g.is_last)

    def profile_model(self, inputs, kv_cache: torch.Tensor) -> None:
        """CUDA's memory profile: the stage's layers on hidden states of the batch's size; the first
        stage's head on its sampling rows."""
        out = self.run_stage(StepInputs(inputs.input_ids, inputs.positions, inputs.meta, inputs.sample_rows, []),
                             self._zeros(inputs.input_ids.numel()), kv_cache)
        if self.group.is_first and inputs.sample_rows:
            self.model.compute_logits(out[inputs.sample_rows])

    # ---- one batch -----------------------------------------------------------------------------------------
    @torch.inference_mode()
    def run_stage(self, step: StepInputs, hidden: torch.Tensor | None, kv_cache: torch.Tensor | None = None):
        """Copy-on-write copies, this stage's layers; the hidden states out, or on the last stage (after the
        final norm) only the rows of `step.logit_rows` (None when no row samples)."""
        start = time.perf_counter()
        self.copy_blocks(step.blocks_to_copy)
        embeds = {} if self.group.is_first else {"inputs_embeds": hidden}
        out = self.model(step.input_ids, step.positions, self.kv_cache if kv_cache is None else kv_cache,
                         step.meta, **embeds)
        if self.group.is_last:
            out = out[step.logit_rows] if step.logit_rows else None      # (rows, hidden): the head is stage 0's
        self._count_busy(start)
        return out

    @torch.inference_mode()
    def run_head(self, rows: torch.Tensor) -> torch.Tensor | None:
        """The first stage: the logits of the last stage's normed rows, gathered on its rank 0 (None elsewhere)."""
        start = time.perf_counter()
        logits = self.model.compute_logits(rows)
        self._count_busy(start)
        return logits

    def _count_busy(self, start: float) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)     # busy means computed, not queued
        self.busy_s += time.perf_counter() - start

    def serve(self) -> None:
        """A worker's loop: a batch from the stage before (the first stage: the driver's broadcast), its
        layers, the result on to the next stage or back to the driver; STOP passed on, then return."""
        g = self.group
        while True:
            received = self._receive()
            if received is None:
                g.send_stop_forward()
                return
            header, body, busy, hidden = received
            if header[0].item() == HEAD:            # the first stage's rank t > 0: its share of the head
                self.run_head(hidden)
                continue
            out = self.run_stage(unpack(header, body, self.block_size, self.device), hidden)
            busy[g.stage] = self.busy_s
            if not g.is_last:
                g.send_forward(header, body, busy, out)
            elif g.is_driver:
                g.send_back(busy, out)

    def _receive(self):
        g = self.group
        if not g.is_first:
            return g.receive_forward(self.config.model_config.hidden_size, self.dtype)
        header = g.broadcast_from_driver(torch.empty(HEADER_LEN, dtype=torch.long))
        if header[0].item() == STOP:
            return None
        if header[0].item() == HEAD:               # the rows the last stage sent the driver
            rows = torch.empty((header[1].item(), self.config.model_config.hidden_size), dtype=self.dtype,
                               device=self.device)
            return header, None, None, g.broadcast_rows(rows)
        body = g.broadcast_from_driver(torch.empty(body_len(header), dtype=torch.long))
        return header, body, g.busy_seconds(), None

    def _zeros(self, num_tokens: int) -> torch.Tensor | None:
        if self.group.is_first:
            return None
        return torch.zeros((num_tokens, self.config.model_config.hidden_size), dtype=self.dtype, device=self.device)
