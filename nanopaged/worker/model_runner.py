"""The model runner: turns a SchedulerOutput into tensors, runs the model, returns logits.

It owns the device side of PagedAttention: the weights, the one KV cache tensor that
holds every layer's blocks, and the per-step inputs that tell attention where each
token's K/V lives. It knows nothing of scheduling policy and chooses no tokens; it is told
which requests compute how many new tokens, and returns the logits of the rows that sample.

Per step (vLLM: v1/worker/gpu_model_runner.py, `_prepare_inputs`):
  input_ids, positions   the new tokens of all requests, flattened into one batch
  slot_mapping           for each new token, its slot in the pool:
                         block_ids[pos // block_size] * block_size + pos % block_size
  block_tables           each request's block ids, padded into a (num_reqs, max_blocks) tensor
  query_start_loc        cu_seqlens_q: where each request's rows start in the flat batch
  seq_lens               each request's context length after this step
Only requests whose step reaches the end of their known tokens sample (a request in the
middle of a chunked prompt has nothing to sample yet); one with k draft tokens (vLLM's
spec_token_ids, verified this step) samples from its last k + 1 rows. docs/05_model_runner_and_kernels.md.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import nn

from nanopaged.attention.backends import load_attention_backend
from nanopaged.attention.metadata import AttentionMetadata
from nanopaged.config import KV_CACHE_DTYPES, EngineConfig, check_memory_fits
from nanopaged.core.block_pool import cdiv
from nanopaged.core.request import Request
from nanopaged.core.scheduler import SchedulerOutput
from nanopaged.cpu.choose import FastPath, choose
from nanopaged.models.config import ModelConfig
from nanopaged.models.llama import LlamaForCausalLM
from nanopaged.models.loader import load_weights, weight_bytes
from nanopaged.sampling_params import SamplingParams
from nanopaged.models.pipeline import ModelStage, run_pipeline


@dataclass
class ModelInput:
    """One step's batch, as tensors, and which of its rows sample."""
    input_ids: torch.Tensor        # (num_tokens,)
    positions: torch.Tensor        # (num_tokens,)
    meta: AttentionMetadata
    sample_rows: list[int]         # the last row (with k drafts: k + 1 rows) of each request whose step reaches its end
    sample_requests: list[Request]  # the request of each sample row
    prompt_rows: list[tuple[Request, int, list[int]]]   # prompt_logprobs: (request, first position, rows)
    inputs_embeds: torch.Tensor | None = None   # set by an extension: the rows' embeddings, images' rows in place


@dataclass
class ModelRunnerOutput:
    requests: list[Request]        # the request of each logits row: one row each, k + 1 in a row with k drafts
    logits: torch.Tensor           # (len(requests), vocab_size)
    prompt_logits: list[tuple[Request, int, torch.Tensor]]   # (request, first position, its rows' logits)


class ModelRunner:
    """Built in four steps a subclass may override (a runner of one rank among several does): load_model,
    determine_num_kv_blocks, allocate_kv_cache, wrap_model; `stages`: the extensions' (models/pipeline.py)."""

    def __init__(self, config: EngineConfig, stages: list[ModelStage] = (), device: torch.device | None = None,
                 model_config: ModelConfig | None = None) -> None:
        self.config = config
        self.model_config = model_config or config.model_config   # a rank's share, under tensor parallelism
        self.block_size, self.device = config.block_size, device or torch.device(config.device)
        self.dtype = getattr(torch, config.dtype)
        self.kv_cache_dtype = getattr(torch, KV_CACHE_DTYPES[config.kv_cache_dtype] or config.dtype)
        self.fast_path: FastPath = choose(config)     # what runs in place of the reference, on this machine
        self.stages = list(stages)
        self.before_forward: list = []    # the engine's hooks, called with (SchedulerOutput, ModelInput)
        self.backend = load_attention_backend(self.fast_path.attention_backend)
        self.model = self.load_model()
        self.num_kv_blocks = self.determine_num_kv_blocks()
        self.kv_cache = self.allocate_kv_cache(self.num_kv_blocks)
        self.model = self.wrap_model(self.model)

    # ---- the model ----------------------------------------------------------------------
    def build_model(self) -> LlamaForCausalLM:
        """The model's layers on the device, in its dtype, weights not loaded yet."""
        return LlamaForCausalLM.build(self.model_config, self.backend, self.config.max_model_len, self.device,
                                      self.dtype)

    def load_model(self) -> nn.Module:
        check_memory_fits(weight_bytes(self.config.model, self.dtype), self.device.type, "the model's weights",
                          "load a smaller model or dtype")      # before a tensor is made or read
        model = self.build_model().to(self.dtype)
        load_weights(model, self.config.model)
        # the chosen fast layers (nanopaged/cpu/choose.py) and the extensions' rewrites, in the pipeline's order
        return run_pipeline(model, self.fast_path.stages() + self.stages).eval()

    def wrap_model(self, model: nn.Module):
        """How the backend launches the whole model (e.g. CUDA graphs: attention/cuda_graphs.py)."""
        return self.backend.wrap_model(model, self)

    # ---- the KV cache -------------------------------------------------------------------
    def allocate_kv_cache(self, num_blocks: int) -> torch.Tensor:
        """One tensor for all layers: (layers, K/V, blocks, block_size, kv_heads, head_dim).

        Zeroed, not empty: padded decode batches read slots past a request's end (masked
        to probability 0), and 0 * NaN from uninitialised memory would still be NaN.
        """
        shape = self.kv_cache_shape(num_blocks)
        check_memory_fits(math.prod(shape) * self.kv_cache_dtype.itemsize, self.device.type,
                          f"a KV cache of {num_blocks} blocks")
        return torch.zeros(shape, dtype=self.kv_cache_dtype, device=self.device)

    def kv_cache_shape(self, num_blocks: int) -> tuple[int, ...]:
        """An int8 cache's rows hold head_dim codes and their float32 scale's 4 bytes (attention/torch_backend.py)."""
        m = self.model_config
        row = m.head_dim + 4 * (self.kv_cache_dtype == torch.int8)
        return (m.num_hidden_layers, 2, num_blocks, self.block_size, m.num_key_value_heads, row)

    def determine_num_kv_blocks(self) -> int:
        """The memory budget (docs/01_kv_cache_arithmetic.md) cut into blocks; 8-bit entries: about twice as many."""
        cfg = self.config
        if cfg.num_kv_blocks is not None:
            return cfg.num_kv_blocks
        bytes_per_block = math.prod(self.kv_cache_shape(1)) * self.kv_cache_dtype.itemsize
        budget = cfg.kv_cache_memory_bytes
        if budget is None:
            budget = self._free_gpu_memory()
        else:
            check_memory_fits(budget, self.device.type, "kv_cache_memory_bytes")
        num_blocks = budget // bytes_per_block
        if num_blocks < 1:
            raise ValueError(f"KV cache budget of {budget} bytes holds no block of "
                             f"{bytes_per_block} bytes (block_size={self.block_size})")
        # More blocks than max_num_seqs full-length requests can use would be wasted memory.
        return min(num_blocks, cfg.max_num_seqs * cdiv(cfg.max_model_len, self.block_size))

    def _free_gpu_memory(self) -> int:
        """CUDA: the memory gpu_memory_utilization leaves for the KV cache. From total x
        utilization go what is used outside torch (the CUDA context, other processes) and
        the peak of one forward of the largest batch (weights + activations)."""
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
        scratch_bytes = self.profile_forward()
        torch.cuda.synchronize()
        free, total = torch.cuda.mem_get_info()
        used_outside_torch = total - free - torch.cuda.memory_reserved()
        peak = torch.cuda.max_memory_allocated() - scratch_bytes
        torch.cuda.empty_cache()
        return int(total * self.config.gpu_memory_utilization) - used_outside_torch - peak

    def profile_forward(self) -> int:
        """One forward of the largest batch a step can hold, on a scratch KV cache; its bytes.

        The batch is max_num_batched_tokens tokens cut into sequences of at most max_model_len,
        so no position runs past the rotary tables, each with a logits row as if it sampled.
        """
        cfg, bs = self.config, self.block_size
        n, out, num_blocks = cfg.max_num_batched_tokens, SchedulerOutput(), 0
        for i, start in enumerate(range(0, n, cfg.max_model_len)):
            length = min(cfg.max_model_len, n - start)
            blocks = list(range(num_blocks, num_blocks + cdiv(length, bs)))
            num_blocks += len(blocks)
            seq = Request(f"profile-{i}", [0] * length, SamplingParams(), max_tokens=1, block_ids=blocks)
            out.scheduled.append((seq, length))
        scratch = self.allocate_kv_cache(num_blocks)
        inputs = self.prepare_inputs(out)
        with torch.inference_mode():
            hidden = self.model(inputs.input_ids, inputs.positions, scratch, inputs.meta)
            self.model.compute_logits(hidden[inputs.sample_rows])
        return scratch.numel() * scratch.element_size()

    # ---- one step -----------------------------------------------------------------------
    def prepare_inputs(self, out: SchedulerOutput) -> ModelInput:
        """Flatten the scheduled requests into one varlen batch (see the module docstring)."""
        bs = self.block_size
        input_ids, positions, slots = [], [], []
        query_lens, seq_lens, sample_rows, sample_requests, prompt_rows = [], [], [], [], []
        for request, num_new in out.scheduled:
            start, end = request.num_computed_tokens, request.num_computed_tokens + num_new
            table = request.block_ids
            # The logits at prompt position p score prompt token p + 1 (prompt_logprobs).
            last = min(end, request.num_prompt_tokens - 1)
            if request.sampling_params.prompt_logprobs is not None and start < last:
                prompt_rows.append((request, start, list(range(len(input_ids), len(input_ids) + last - start))))
            input_ids += request.token_ids(start, end)
            positions += range(start, end)
            slots += [table[p // bs] * bs + p % bs for p in range(start, end)]
            query_lens.append(num_new)
            seq_lens.append(end)
            if end == request.num_tokens_with_spec:
                rows = 1 + len(request.spec_token_ids)
                sample_rows += range(len(input_ids) - rows, len(input_ids))
                sample_requests += [request] * rows
        max_blocks = max(len(r.block_ids) for r, _ in out.scheduled)
        tables = [r.block_ids + [0] * (max_blocks - len(r.block_ids)) for r, _ in out.scheduled]
        cu = [0]
        for q in query_lens:
            cu.append(cu[-1] + q)
        as_tensor = lambda x: torch.tensor(x, dtype=torch.long, device=self.device)   # noqa: E731
        meta = AttentionMetadata(
            slot_mapping=as_tensor(slots), query_start_loc=as_tensor(cu), seq_lens=as_tensor(seq_lens),
            block_tables=as_tensor(tables), query_lens_list=query_lens, seq_lens_list=seq_lens,
            block_size=bs, share_prefixes=not self.config.disable_cascade_attn)
        return ModelInput(as_tensor(input_ids), as_tensor(positions), meta, sample_rows, sample_requests,
                          prompt_rows)

    def execute(self, out: SchedulerOutput) -> ModelRunnerOutput:
        return self.forward(out, self.prepare_inputs(out))

    @torch.inference_mode()
    def forward(self, out: SchedulerOutput, inputs: ModelInput) -> ModelRunnerOutput:
        """Copy-on-write copies, then one forward pass; logits only for the rows that sample
        (the lm_head is the largest matmul of a small model). It reads no request's counters: async
        scheduling runs it on a thread of its own while they move on (engine/overlap.py)."""
        self.copy_blocks(out.blocks_to_copy)
        for hook in self.before_forward:      # an extension's per-step inputs (each row's adapter)
            hook(out, inputs)
        embeds = {} if inputs.inputs_embeds is None else {"inputs_embeds": inputs.inputs_embeds}
        hidden = self.model(inputs.input_ids, inputs.positions, self.kv_cache, inputs.meta, **embeds)
        logits = self.model.compute_logits(hidden[inputs.sample_rows])
        return ModelRunnerOutput(inputs.sample_requests, logits, self.prompt_logits(hidden, inputs.prompt_rows))

    def prompt_logits(self, hidden: torch.Tensor, prompt_rows) -> list[tuple[Request, int, torch.Tensor]]:
        """prompt_logprobs: one lm_head call over every such row of the step, then cut per request
        (an evaluation harness sends hundreds of these; a call each cost it 7x the time)."""
        if not prompt_rows:
            return []
        return per_request(self.model.compute_logits(hidden[[row for _, _, rows in prompt_rows for row in rows]]),
                           prompt_rows)

    def copy_blocks(self, pairs: list[tuple[int, int]]) -> None:
        """Copy-on-write: block src's K/V, every layer, into block dst (CPU index_copy_ has no float8)."""
        if not pairs:
            return
        src = torch.tensor([s for s, _ in pairs], device=self.device)
        dst = torch.tensor([d for _, d in pairs], device=self.device)
        self.kv_cache[:, :, dst] = self.kv_cache[:, :, src]


def per_request(logits: torch.Tensor, prompt_rows) -> list[tuple[Request, int, torch.Tensor]]:
    """Consecutive rows of `logits` cut into one run per (request, first position, rows) entry."""
    out, start = [], 0
    for request, first, rows in prompt_rows:
        out.append((request, first, logits[start:start + len(rows)]))
        start += len(rows)
    return out
