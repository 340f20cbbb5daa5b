"""LLMEngine: requests in, one step at a time, RequestOutputs out.

    add_request()  tokenize and validate, make a Request, queue it (WAITING)
    step()         Scheduler.schedule() -> ModelRunner.execute() -> Scheduler.update(),
                   then detokenize the new tokens and report every request that advanced

All validation happens in add_request, before a request touches the scheduler: a request
that can never run raises ValueError there and the engine goes on serving the others.
`LLM.generate` (llm.py) is a thin loop over this class; use it directly to stream.
"""
from __future__ import annotations

import time
from dataclasses import dataclass, replace

from transformers import AutoTokenizer

from nanopaged.block_pool import BlockPool, cdiv
from nanopaged.config import EngineConfig
from nanopaged.detokenizer import IncrementalDetokenizer, find_stop_string
from nanopaged.models import ModelConfig
from nanopaged.model_runner import ModelRunner
from nanopaged.outputs import CompletionOutput, Logprob, RequestOutput
from nanopaged.request import Request, RequestStatus
from nanopaged.sampling_params import SamplingParams
from nanopaged.scheduler import Scheduler

PromptType = str | dict


@dataclass
class EngineStats:
    num_steps: int = 0
    num_prompt_tokens_computed: int = 0   # prefill work actually done (incl. recompute)
    num_generated_tokens: int = 0
    peak_kv_cache_usage: float = 0.0
    peak_kv_blocks_used: int = 0
    kv_blocks_in_use: int = 0             # summed over steps: blocks taken from the pool
    num_memory_samples: int = 0           # steps (model steps and beam-search steps) sampled
    kv_tokens_stored: int = 0             # summed over steps: tokens with K/V in the cache
    kv_slots_held: int = 0                # summed over steps: slots of the blocks held
    max_num_running: int = 0              # most requests running in one step
    model_time_s: float = 0.0             # time in the model runner
    schedule_time_s: float = 0.0          # time in scheduler + block pool


class LLMEngine:
    def __init__(self, config: EngineConfig) -> None:
        self.config = config
        self.model_config = ModelConfig.from_folder(config.model)
        self._resolve_limits()
        self.tokenizer = AutoTokenizer.from_pretrained(config.model)
        self.runner = ModelRunner(config, self.model_config, config.max_model_len)
        self.block_pool = BlockPool(self.runner.num_kv_blocks, config.block_size,
                                    enable_caching=config.enable_prefix_caching,
                                    prefix_hash=config.prefix_hash)
        self.scheduler = Scheduler(self.block_pool, config.max_num_seqs,
                                   config.max_num_batched_tokens, config.max_model_len)
        self.stats = EngineStats()
        self.requests: dict[str, list[Request]] = {}   # user request id -> its samples (n of them)
        self.samples: dict[str, Request] = {}          # sample request id -> sample
        self.detokenizers: dict[str, IncrementalDetokenizer] = {}   # per sample

    def _resolve_limits(self) -> None:
        cfg, limit = self.config, self.model_config.max_position_embeddings
        if cfg.max_model_len is None:
            cfg.max_model_len = limit
        elif cfg.max_model_len > limit:
            raise ValueError(f"max_model_len={cfg.max_model_len} is larger than the model's "
                             f"max_position_embeddings={limit}")
        if cfg.max_num_batched_tokens is None:
            on_cuda = cfg.device == "cuda" or (cfg.device == "auto" and _cuda_available())
            cfg.max_num_batched_tokens = 8192 if on_cuda else 2048

    # ---- requests in ----------------------------------------------------------------
    def add_request(self, request_id: str, prompt: PromptType,
                    params: SamplingParams | None = None) -> Request:
        request = self.make_request(request_id, prompt, params)
        self.submit(request)
        return request

    def make_request(self, request_id: str, prompt: PromptType,
                     params: SamplingParams | None = None) -> Request:
        """Tokenize and validate one request without queueing it (ValueError if it can never run)."""
        params = params if params is not None else SamplingParams()
        if not isinstance(params, SamplingParams):
            raise ValueError(f"sampling params must be a SamplingParams, got {type(params).__name__}")
        if request_id in self.requests or request_id in self.samples:
            raise ValueError(f"request_id {request_id!r} is already in use")
        if params.n > self.config.max_num_seqs:
            raise ValueError(f"n={params.n} samples cannot run at once with max_num_seqs="
                             f"{self.config.max_num_seqs}")
        text, ids = self._tokenize(prompt)
        self._check_prompt(ids)
        cache_salt = prompt.get("cache_salt") if isinstance(prompt, dict) else None
        if cache_salt is not None and not isinstance(cache_salt, str):
            raise ValueError(f"cache_salt must be a string, got {type(cache_salt).__name__}")
        cfg = self.config
        room = cfg.max_model_len - len(ids)
        # max_tokens beyond the context is clipped (vLLM does the same): the request then
        # finishes with finish_reason "length" when the context is full.
        max_tokens = room if params.max_tokens is None else min(params.max_tokens, room)
        # The last sampled token never needs K/V, so a request stores at most
        # prompt + max_tokens - 1 tokens.
        need = cdiv(len(ids) + max_tokens - 1, cfg.block_size)
        if need > self.runner.num_kv_blocks:
            raise ValueError(
                f"request {request_id!r} needs {need} KV blocks (prompt {len(ids)} + max_tokens "
                f"{max_tokens} tokens, block_size {cfg.block_size}) but the whole cache has "
                f"{self.runner.num_kv_blocks} blocks; lower max_tokens or raise num_kv_blocks")
        samples = [Request(request_id=request_id if i == 0 else f"{request_id}#{i}",
                           prompt_token_ids=ids, sampling_params=_sample_params(params, i),
                           max_tokens=max_tokens, prompt=text, cache_salt=cache_salt,
                           eos_token_ids=frozenset(self.model_config.eos_token_ids),
                           index=i, group_id=request_id)
                   for i in range(params.n)]
        if any(seq.request_id in self.samples for seq in samples):
            raise ValueError(f"request_id {request_id!r} clashes with the samples of another request")
        # Sample 0 prefills the prompt; the others fork off it when it is done (Scheduler.fork).
        samples[0].pending_children = samples[1:]
        return samples[0]

    def submit(self, request: Request) -> None:
        samples = [request] + request.pending_children
        self.requests[request.group_id] = samples
        for seq in samples:
            self.samples[seq.request_id] = seq
            self.detokenizers[seq.request_id] = IncrementalDetokenizer(
                self.tokenizer, seq.prompt_token_ids, seq.sampling_params.skip_special_tokens)
        self.scheduler.add_request(request)

    def _tokenize(self, prompt: PromptType) -> tuple[str | None, list[int]]:
        if isinstance(prompt, str):
            return prompt, self.tokenizer.encode(prompt)
        if isinstance(prompt, dict) and "prompt_token_ids" in prompt:
            ids = prompt["prompt_token_ids"]
            if not isinstance(ids, (list, tuple)) or not all(
                    isinstance(t, int) and not isinstance(t, bool) for t in ids):
                raise ValueError("prompt_token_ids must be a list of integers")
            return prompt.get("prompt"), list(ids)
        if isinstance(prompt, dict) and "prompt" in prompt:
            return self._tokenize(prompt["prompt"])
        raise ValueError(f"a prompt is a string or a dict with 'prompt_token_ids', got {type(prompt).__name__}")

    def _check_prompt(self, ids: list[int]) -> None:
        if not ids:
            raise ValueError("the prompt is empty (0 tokens); give at least one token")
        if len(ids) >= self.config.max_model_len:
            raise ValueError(f"the prompt has {len(ids)} tokens; max_model_len={self.config.max_model_len} "
                             "leaves no room for a generated token (a prompt may be at most "
                             f"{self.config.max_model_len - 1} tokens)")
        vocab = self.model_config.vocab_size
        bad = [t for t in ids if not 0 <= t < vocab]
        if bad:
            raise ValueError(f"token id {bad[0]} is outside the vocabulary [0, {vocab})")

    def abort_request(self, request_id: str) -> None:
        for seq in self.requests.get(request_id, []):
            if not seq.is_finished:
                self.scheduler.finish_request(seq, RequestStatus.FINISHED_ABORTED)
        self._forget(request_id)

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished_requests()

    # ---- one step -------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        """Schedule, run the model once, update; the outputs of the requests that advanced."""
        t0 = time.perf_counter()
        out = self.scheduler.schedule()
        if not out.scheduled:
            return []
        self.record_memory(out)
        t1 = time.perf_counter()
        sampled = self.runner.execute(out)
        t2 = time.perf_counter()
        self.scheduler.update(out, {rid: tok for rid, (tok, _, _) in sampled.items()})
        t3 = time.perf_counter()
        self._record(out, sampled, model_time=t2 - t1, schedule_time=(t1 - t0) + (t3 - t2))

        advanced = {}
        for rid, (_, logprob, top) in sampled.items():
            seq = self.samples[rid]
            self._process_token(seq, logprob, top)
            advanced[seq.group_id] = True
        outputs = [self._make_output(gid) for gid in advanced]
        for o in outputs:
            if o.finished:
                self._forget(o.request_id)
        return outputs

    def _process_token(self, seq: Request, logprob: float, top: list | None) -> None:
        """Logprobs, incremental text, stop strings for the token a sample just got."""
        params, token, detok = seq.sampling_params, seq.output_token_ids[-1], self.detokenizers[seq.request_id]
        seq.cumulative_logprob += logprob
        if top is not None:
            seq.output_logprobs.append({t: Logprob(lp, rank, self.tokenizer.decode([t]))
                                        for t, lp, rank in top})
        # vLLM leaves a stop token (EOS or stop_token_ids) out of the text, unless asked.
        stopped_by_token = seq.status == RequestStatus.FINISHED_STOPPED
        if not stopped_by_token or params.include_stop_str_in_output:
            new_chars = len(detok.add(token))
            if params.stop and seq.num_output_tokens >= params.min_tokens:
                hit = find_stop_string(detok.text, new_chars, params.stop, params.include_stop_str_in_output)
                if hit is not None:
                    seq.stop_reason = hit[0]
                    detok.text = detok.text[:hit[1]]
                    if seq.is_finished:      # the last token (max_tokens) completed the stop string
                        seq.status = RequestStatus.FINISHED_STOPPED
                    else:
                        self.scheduler.finish_request(seq, RequestStatus.FINISHED_STOPPED)
                    return
        if seq.is_finished:
            detok.flush()

    def _record(self, out, sampled, model_time: float, schedule_time: float) -> None:
        s = self.stats
        s.num_steps += 1
        s.num_generated_tokens += len(sampled)
        # prompt tokens among this step's [computed - n, computed): prefill work, recompute included
        s.num_prompt_tokens_computed += sum(
            max(0, min(r.num_computed_tokens, r.num_prompt_tokens) - (r.num_computed_tokens - n))
            for r, n in out.scheduled)
        s.model_time_s += model_time
        s.schedule_time_s += schedule_time

    def record_memory(self, out) -> None:
        """KV figures of this step, taken while its blocks are held (update() frees some).

        Utilization = tokens whose K/V the cache holds after this step / slots in the blocks
        held: the paper's measure of how much reserved KV memory holds real tokens (Fig. 2).
        """
        s = self.stats
        s.peak_kv_cache_usage = max(s.peak_kv_cache_usage, self.block_pool.usage())
        in_use = self.block_pool.num_blocks - self.block_pool.num_free_blocks
        s.peak_kv_blocks_used = max(s.peak_kv_blocks_used, in_use)
        s.kv_blocks_in_use += in_use
        s.num_memory_samples += 1
        new = {r.request_id: n for r, n in out.scheduled}
        running = self.scheduler.running        # every scheduled request is running now
        s.kv_tokens_stored += sum(r.num_computed_tokens + new.get(r.request_id, 0) for r in running)
        s.kv_slots_held += sum(len(r.block_ids) for r in running) * self.config.block_size
        s.max_num_running = max(s.max_num_running, len(self.scheduler.running))

    def _make_output(self, group_id: str) -> RequestOutput:
        samples = self.requests[group_id]
        completions = [self._completion(seq) for seq in samples]
        first = samples[0]
        return RequestOutput(request_id=group_id, prompt=first.prompt,
                             prompt_token_ids=first.prompt_token_ids, outputs=completions,
                             finished=all(seq.is_finished for seq in samples),
                             num_cached_tokens=first.num_cached_tokens)

    def _completion(self, seq: Request) -> CompletionOutput:
        finish_reason = {RequestStatus.FINISHED_STOPPED: "stop", RequestStatus.FINISHED_LENGTH: "length",
                         RequestStatus.FINISHED_ABORTED: "abort"}.get(seq.status)
        return CompletionOutput(
            index=seq.index, text=self.detokenizers[seq.request_id].text,
            token_ids=list(seq.output_token_ids), cumulative_logprob=seq.cumulative_logprob,
            logprobs=list(seq.output_logprobs) if seq.sampling_params.logprobs is not None else None,
            finish_reason=finish_reason, stop_reason=seq.stop_reason)

    def _forget(self, group_id: str) -> None:
        for seq in self.requests.pop(group_id, []):
            self.samples.pop(seq.request_id, None)
            self.detokenizers.pop(seq.request_id, None)
            self.runner.free_request(seq.request_id)

    # ---- figures --------------------------------------------------------------------
    def get_stats(self) -> dict:
        s = self.stats
        return {
            "num_steps": s.num_steps,
            "num_preemptions": self.scheduler.num_preemptions,
            "kv_cache_usage": self.block_pool.usage(),
            "peak_kv_cache_usage": s.peak_kv_cache_usage,
            "peak_kv_blocks_used": s.peak_kv_blocks_used,
            "num_kv_blocks": self.block_pool.num_blocks,
            "block_size": self.config.block_size,
            "num_running": len(self.scheduler.running),
            "num_waiting": len(self.scheduler.waiting),
            "prefix_cache_queries": self.scheduler.prefix_cache_queries,
            "prefix_cache_hits": self.scheduler.prefix_cache_hits,
            "num_evicted_blocks": self.block_pool.num_evicted_blocks,
            "kv_utilization": s.kv_tokens_stored / s.kv_slots_held if s.kv_slots_held else 0.0,
            "mean_kv_blocks_used": s.kv_blocks_in_use / s.num_memory_samples if s.num_memory_samples else 0.0,
            # Blocks saved by sharing (fork, beams, prefix hits) / blocks the same block tables
            # would hold without it: the paper's measure of sharing (section 6.3).
            "kv_sharing_saving": (1 - s.kv_blocks_in_use * self.config.block_size / s.kv_slots_held
                                  if s.kv_slots_held else 0.0),
            "max_num_running": s.max_num_running,
            "num_prompt_tokens_computed": s.num_prompt_tokens_computed,
            "num_generated_tokens": s.num_generated_tokens,
            "model_time_s": s.model_time_s,
            "schedule_time_s": s.schedule_time_s,
        }


def _sample_params(params: SamplingParams, index: int) -> SamplingParams:
    """Sample i of n: one sequence, with its own seed (seed + i) so the n samples differ."""
    if params.n == 1:
        return params
    return replace(params, n=1, seed=None if params.seed is None else params.seed + index)


def _cuda_available() -> bool:
    import torch
    return torch.cuda.is_available()
