"""CUDA graphs for decode steps: launch a whole forward pass with one call.

A decode step of a small model is hundreds of tiny kernel launches, and on a GPU the
launch overhead, not the math, sets the pace. A CUDA graph records the launches once and
replays them (vLLM: CUDAGraphWrapper). It replays the same kernels on the same memory, so
it is captured once per batch size (`capture_sizes`), every input is copied into a static
buffer before the replay, and a batch of n requests runs in the next captured size, padded
with rows that do nothing (`pad_decode_batch`). Only decode-only batches of the `triton`
backend are captured; every other batch runs the model eagerly. The Triton backend installs
`CUDAGraphModel` around the model on CUDA (its `wrap_model`); `enforce_eager=True` turns it
off. docs/05_model_runner_and_kernels.md explains it.
"""
from __future__ import annotations

import torch

from nanopaged.attention.metadata import AttentionMetadata


def capture_sizes(max_num_seqs: int) -> list[int]:
    """1, 2, 4, 8, 16, 32, ... and max_num_seqs itself."""
    sizes, s = [], 1
    while s < max_num_seqs:
        sizes.append(s)
        s *= 2
    return sizes + [max_num_seqs]


def pad_decode_batch(ids: torch.Tensor, pos: torch.Tensor, meta: AttentionMetadata, size: int,
                     max_blocks: int) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata]:
    """A decode batch of n requests as a batch of `size` rows whose extra rows do nothing."""
    n, dev = ids.shape[0], ids.device
    pad = size - n
    padded_ids = torch.cat([ids, ids.new_zeros(pad)])
    padded_pos = torch.cat([pos, pos.new_zeros(pad)])
    slots = torch.cat([meta.slot_mapping, meta.slot_mapping.new_full((pad,), -1)])
    # query_start_loc keeps rising by 1 for real rows and stays at n for padding (query_len 0)
    qsl = torch.cat([meta.query_start_loc, meta.query_start_loc.new_full((pad,), n)])
    seq_lens = torch.cat([meta.seq_lens, meta.seq_lens.new_zeros(pad)])
    tables = meta.block_tables.new_zeros((size, max_blocks))
    tables[:n, :meta.block_tables.shape[1]] = meta.block_tables
    padded = AttentionMetadata(slot_mapping=slots, query_start_loc=qsl, seq_lens=seq_lens,
                               block_tables=tables, query_lens_list=[1] * n + [0] * pad,
                               seq_lens_list=meta.seq_lens_list + [0] * pad,
                               block_size=meta.block_size)
    return padded_ids.to(dev), padded_pos.to(dev), padded


class CUDAGraphModel:
    """The model, replayed from CUDA graphs for decode batches (vLLM: CUDAGraphWrapper)."""

    def __init__(self, model, kv_cache: torch.Tensor, block_size: int, max_num_seqs: int,
                 max_blocks: int) -> None:
        self.model, self.kv_cache, self.block_size = model, kv_cache, block_size
        self.max_blocks = max_blocks
        self.sizes = capture_sizes(max_num_seqs)
        self.graphs: dict[int, tuple[torch.cuda.CUDAGraph, dict, torch.Tensor]] = {}
        self._capture()

    @torch.inference_mode()
    def _capture(self) -> None:
        """One graph per size. Under inference_mode, as every step runs: with autograd on, each
        graph's output would keep a grad_fn and, through it, its activations alive."""
        pool = None
        for size in reversed(self.sizes):          # largest first: the others reuse its memory pool
            static = self._static_inputs(size)
            self._forward(static)                  # warm-up: autotuning, lazy allocations
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool):
                hidden = self._forward(static)
            pool = graph.pool()
            self.graphs[size] = (graph, static, hidden)

    def _static_inputs(self, size: int) -> dict:
        dev = self.kv_cache.device
        return {"ids": torch.zeros(size, dtype=torch.long, device=dev),
                "pos": torch.zeros(size, dtype=torch.long, device=dev),
                "slots": torch.full((size,), -1, dtype=torch.long, device=dev),
                "qsl": torch.zeros(size + 1, dtype=torch.long, device=dev),
                "seq_lens": torch.zeros(size, dtype=torch.long, device=dev),
                "tables": torch.zeros(size, self.max_blocks, dtype=torch.long, device=dev)}

    def _forward(self, s: dict) -> torch.Tensor:
        # The Python lists only size the kernels' grids, which a graph fixes at capture:
        # sized for one query token per row, as every replayed decode batch has.
        size = s["ids"].shape[0]
        meta = AttentionMetadata(slot_mapping=s["slots"], query_start_loc=s["qsl"], seq_lens=s["seq_lens"],
                                 block_tables=s["tables"], query_lens_list=[1] * size,
                                 seq_lens_list=[0] * size, block_size=self.block_size)
        return self.model(s["ids"], s["pos"], self.kv_cache, meta)

    def __call__(self, ids: torch.Tensor, pos: torch.Tensor, kv_cache: torch.Tensor,
                 meta: AttentionMetadata) -> torch.Tensor:
        """The model's forward: a graph replay when one was captured for this batch."""
        if self.can_run(meta):
            return self.run(ids, pos, meta)
        return self.model(ids, pos, kv_cache, meta)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.model.compute_logits(hidden)

    def can_run(self, meta: AttentionMetadata) -> bool:
        return (all(q == 1 for q in meta.query_lens_list) and meta.num_reqs <= self.sizes[-1]
                and meta.block_tables.shape[1] <= self.max_blocks)

    def run(self, ids: torch.Tensor, pos: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        n = ids.shape[0]
        size = next(s for s in self.sizes if s >= n)
        graph, static, hidden = self.graphs[size]
        p_ids, p_pos, p_meta = pad_decode_batch(ids, pos, meta, size, self.max_blocks)
        static["ids"].copy_(p_ids)
        static["pos"].copy_(p_pos)
        static["slots"].copy_(p_meta.slot_mapping)
        static["qsl"].copy_(p_meta.query_start_loc)
        static["seq_lens"].copy_(p_meta.seq_lens)
        static["tables"].copy_(p_meta.block_tables)
        graph.replay()
        return hidden[:n]
