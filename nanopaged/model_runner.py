"""The model runner: turns a SchedulerOutput into tensors, runs the model, samples.

It owns the device side of PagedAttention: the weights, the one KV cache tensor that
holds every layer's blocks, and the per-step inputs that tell attention where each
token's K/V lives. It knows nothing of scheduling policy; it is told which requests
compute how many new tokens this step, and it reports the sampled tokens back.

Per step (vLLM: v1/worker/gpu_model_runner.py, `_prepare_inputs`):
  input_ids, positions   the new tokens of all requests, flattened into one batch
  slot_mapping           for each new token, its slot in the pool:
                         block_ids[pos // block_size] * block_size + pos % block_size
  block_tables           each request's block ids, padded into a (num_reqs, max_blocks) tensor
  query_start_loc        cu_seqlens_q: where each request's rows start in the flat batch
  seq_lens               each request's context length after this step
Only requests whose step reaches the end of their known tokens sample a token (a request
in the middle of a chunked prompt has nothing to sample yet). A request whose other samples
(n > 1) are about to fork off it samples once for each of them, from the same logits row.
Copy-on-write block copies ordered by the scheduler are done before the forward pass.
"""
from __future__ import annotations

import torch

from nanopaged.attention import AttentionMetadata, get_backend
from nanopaged.block_pool import cdiv
from nanopaged.config import CPU_KV_CACHE_BYTES, EngineConfig
from nanopaged.cuda_graphs import CudaGraphRunner
from nanopaged.models import LlamaForCausalLM, ModelConfig, load_weights
from nanopaged.sampler import SampleResult, Sampler
from nanopaged.scheduler import SchedulerOutput

TORCH_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if name == "cuda" and not torch.cuda.is_available():
        raise ValueError("device='cuda' but CUDA is not available (torch.cuda.is_available() is False)")
    return torch.device(name)


def resolve_dtype(name: str, device: torch.device) -> torch.dtype:
    if name == "auto":
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    return TORCH_DTYPES[name]


class ModelRunner:
    def __init__(self, config: EngineConfig, model_config: ModelConfig, max_model_len: int) -> None:
        self.config = config
        self.model_config = model_config
        self.block_size = config.block_size
        self.device = resolve_device(config.device)
        self.dtype = resolve_dtype(config.dtype, self.device)
        backend = get_backend(config.attention_backend, self.device.type)
        with torch.device(self.device):
            self.model = LlamaForCausalLM(model_config, backend, max_model_len).to(self.dtype)
        load_weights(self.model, config.model)
        self.model.eval()
        self.sampler = Sampler(self.device, config.seed)
        self.num_kv_blocks = self._num_kv_blocks(max_model_len)
        self.kv_cache = self._allocate_kv_cache(self.num_kv_blocks)
        self.cuda_graphs = None
        if self.device.type == "cuda" and not config.enforce_eager and backend.name == "triton":
            self.cuda_graphs = CudaGraphRunner(self.model, self.kv_cache, self.block_size,
                                               config.max_num_seqs, cdiv(max_model_len, self.block_size))

    # ---- the KV cache ---------------------------------------------------------------
    def _allocate_kv_cache(self, num_blocks: int) -> torch.Tensor:
        """One tensor for all layers: (layers, K/V, blocks, block_size, kv_heads, head_dim).

        Zeroed, not empty: padded decode batches read slots past a request's end (masked
        to probability 0), and 0 * NaN from uninitialised memory would still be NaN.
        """
        m = self.model_config
        return torch.zeros(m.num_hidden_layers, 2, num_blocks, self.block_size,
                           m.num_key_value_heads, m.head_dim, dtype=self.dtype, device=self.device)

    def _num_kv_blocks(self, max_model_len: int) -> int:
        cfg = self.config
        if cfg.num_kv_blocks is not None:
            return cfg.num_kv_blocks
        bytes_per_block = self.model_config.kv_bytes_per_token(self.dtype.itemsize) * self.block_size
        if cfg.kv_cache_memory_bytes is not None:
            budget = cfg.kv_cache_memory_bytes
        elif self.device.type == "cuda":
            budget = self._profile_cuda_budget()
        else:
            budget = CPU_KV_CACHE_BYTES
        num_blocks = budget // bytes_per_block
        if num_blocks < 1:
            raise ValueError(f"KV cache budget of {budget} bytes holds no block of "
                             f"{bytes_per_block} bytes (block_size={self.block_size})")
        # More blocks than max_num_seqs full-length requests can use would be wasted memory.
        return min(num_blocks, cfg.max_num_seqs * cdiv(max_model_len, self.block_size))

    def _profile_cuda_budget(self) -> int:
        """Free memory x gpu_memory_utilization after one forward of the largest batch.

        The peak of that forward (weights + activations) is what the model needs besides the
        KV cache; everything up to `total * gpu_memory_utilization` beyond it becomes blocks.
        """
        n = self.config.max_num_batched_tokens
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
        scratch = self._allocate_kv_cache(cdiv(n, self.block_size))
        ids = torch.zeros(n, dtype=torch.long, device=self.device)
        meta = AttentionMetadata(
            slot_mapping=torch.arange(n, device=self.device),
            query_start_loc=torch.tensor([0, n], dtype=torch.long, device=self.device),
            seq_lens=torch.tensor([n], dtype=torch.long, device=self.device),
            block_tables=torch.arange(cdiv(n, self.block_size), dtype=torch.long,
                                      device=self.device)[None],
            query_lens_list=[n], seq_lens_list=[n], block_size=self.block_size)
        with torch.inference_mode():
            self.model.compute_logits(self.model(ids, torch.arange(n, device=self.device), scratch, meta)[-1:])
        torch.cuda.synchronize()
        peak = torch.cuda.max_memory_allocated() - scratch.numel() * scratch.element_size()
        del scratch
        torch.cuda.empty_cache()
        _, total = torch.cuda.mem_get_info()
        return int(total * self.config.gpu_memory_utilization) - peak

    # ---- one step -------------------------------------------------------------------
    def prepare_inputs(self, out: SchedulerOutput):
        """Flatten the scheduled requests into one varlen batch (see the module docstring)."""
        bs = self.block_size
        input_ids, positions, slots = [], [], []
        query_lens, seq_lens, sample_rows, sample_reqs = [], [], [], []
        for request, num_new in out.scheduled:
            start, end = request.num_computed_tokens, request.num_computed_tokens + num_new
            table = request.block_ids
            input_ids += request.token_ids(start, end)
            positions += range(start, end)
            slots += [table[p // bs] * bs + p % bs for p in range(start, end)]
            query_lens.append(num_new)
            seq_lens.append(end)
            if end == request.num_tokens:
                for seq in [request] + request.pending_children:
                    sample_rows.append(len(input_ids) - 1)
                    sample_reqs.append(seq)
        max_blocks = max(len(r.block_ids) for r, _ in out.scheduled)
        tables = [r.block_ids + [0] * (max_blocks - len(r.block_ids)) for r, _ in out.scheduled]
        cu = [0]
        for q in query_lens:
            cu.append(cu[-1] + q)
        dev = self.device
        meta = AttentionMetadata(
            slot_mapping=torch.tensor(slots, dtype=torch.long, device=dev),
            query_start_loc=torch.tensor(cu, dtype=torch.long, device=dev),
            seq_lens=torch.tensor(seq_lens, dtype=torch.long, device=dev),
            block_tables=torch.tensor(tables, dtype=torch.long, device=dev),
            query_lens_list=query_lens, seq_lens_list=seq_lens, block_size=bs)
        ids = torch.tensor(input_ids, dtype=torch.long, device=dev)
        pos = torch.tensor(positions, dtype=torch.long, device=dev)
        return ids, pos, meta, sample_rows, sample_reqs

    @torch.inference_mode()
    def execute(self, out: SchedulerOutput) -> dict[str, tuple[int, float, list | None]]:
        """Run one step; request_id -> (token, its logprob, top logprobs) for every sampling row."""
        hidden, sample_reqs = self._run_model(out)
        if not sample_reqs:
            return {}
        logits = self.model.compute_logits(hidden)
        res: SampleResult = self.sampler(logits, sample_reqs)
        return {r.request_id: (t, lp, top) for r, t, lp, top in
                zip(sample_reqs, res.token_ids, res.logprobs, res.top_logprobs)}

    @torch.inference_mode()
    def execute_top_logprobs(self, out: SchedulerOutput, k: int) -> dict[str, tuple[list[float], list[int]]]:
        """Run one step without sampling: the k best (logprob, token) of every row at its end.

        Beam search (beam_search.py) chooses the next tokens itself from these.
        """
        hidden, sample_reqs = self._run_model(out)
        if not sample_reqs:
            return {}
        logprobs = torch.log_softmax(self.model.compute_logits(hidden).float(), dim=-1)
        values, tokens = logprobs.topk(k, dim=-1)
        return {r.request_id: (v, t) for r, v, t in zip(sample_reqs, values.tolist(), tokens.tolist())}

    def _run_model(self, out: SchedulerOutput) -> tuple[torch.Tensor, list]:
        """Block copies, inputs, forward pass: the hidden states of the sampling rows."""
        self.copy_blocks(out.blocks_to_copy)
        ids, pos, meta, sample_rows, sample_reqs = self.prepare_inputs(out)
        return self.forward(ids, pos, meta)[sample_rows], sample_reqs

    def forward(self, ids: torch.Tensor, pos: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        """Hidden states of the new tokens: a CUDA graph replay for decode steps when captured."""
        if self.cuda_graphs is not None and self.cuda_graphs.can_run(meta):
            return self.cuda_graphs.run(ids, pos, meta)
        return self.model(ids, pos, self.kv_cache, meta)

    def copy_blocks(self, pairs: list[tuple[int, int]]) -> None:
        """Copy-on-write: block src's K/V, every layer, into block dst."""
        if not pairs:
            return
        src = torch.tensor([s for s, _ in pairs], device=self.device)
        dst = torch.tensor([d for _, d in pairs], device=self.device)
        self.kv_cache.index_copy_(2, dst, self.kv_cache.index_select(2, src))

    def free_request(self, request_id: str) -> None:
        self.sampler.free_request(request_id)
