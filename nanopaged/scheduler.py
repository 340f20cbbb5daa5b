"""The scheduler: one loop that makes `num_computed_tokens` chase `num_tokens`.

There is no prefill phase and no decode phase (vLLM: v1/core/sched/scheduler.py).
Each step has one token budget, `max_num_batched_tokens`. Running requests are served
first, oldest first: a request that is decoding asks for 1 token, one in the middle of
a long prompt asks for the rest of it, and gets what is left of the budget (a chunk).
Then waiting requests are admitted, oldest first, while the budget, `max_num_seqs` and
the free blocks allow; the last one admitted may also get only a chunk of its prompt.

When a running request needs a block and none is free, the most recently admitted
running request is preempted by *recompute*: its blocks are freed, its
`num_computed_tokens` drops to 0 and it goes back to the front of the waiting queue,
keeping the tokens it generated (they are prefilled again with the prompt later).
The oldest running request is never the victim while another is running, and every
admitted request fits the pool on its own (the engine checks that), so the oldest one
always finishes: no deadlock, and no request waits forever.

With prefix caching, admission first looks the request's block hashes up in the block
pool: the cached blocks join its block table and its `num_computed_tokens` starts after
them, so prefill starts where the cache ends. At most `num_tokens - 1` tokens can hit: the
last token is always computed, because its logits are needed to sample (vLLM:
kv_cache_manager.py, `max_cache_hit_length`). After every step, blocks that became full
are named in the cache, prompt and generated tokens alike.

No torch here: the scheduler decides, the model runner computes.
"""
from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from nanopaged.block_pool import BlockPool
from nanopaged.prefix_cache import extend_block_hashes
from nanopaged.request import Request, RequestStatus


@dataclass
class SchedulerOutput:
    """What one step computes: (request, num_new_tokens) pairs, in batch order."""
    scheduled: list[tuple[Request, int]] = field(default_factory=list)
    preempted: list[Request] = field(default_factory=list)

    @property
    def num_batched_tokens(self) -> int:
        return sum(n for _, n in self.scheduled)


class Scheduler:
    def __init__(self, block_pool: BlockPool, max_num_seqs: int,
                 max_num_batched_tokens: int, max_model_len: int) -> None:
        self.block_pool = block_pool
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.max_model_len = max_model_len
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []   # in admission order: the last is the newest
        self.num_preemptions = 0
        self.prefix_cache_queries = 0       # tokens of admitted requests looked up
        self.prefix_cache_hits = 0          # of those, tokens found in the cache

    # ---- queue ----------------------------------------------------------------------
    def add_request(self, request: Request) -> None:
        self._hash_new_blocks(request)
        self.waiting.append(request)

    def has_unfinished_requests(self) -> bool:
        return bool(self.waiting or self.running)

    # ---- one step -------------------------------------------------------------------
    def schedule(self) -> SchedulerOutput:
        out = SchedulerOutput()
        token_budget = self.max_num_batched_tokens

        # 1. Running requests, oldest first. Each has at least one token to compute.
        i = 0
        while i < len(self.running) and token_budget > 0:
            request = self.running[i]
            num_new = min(request.num_tokens - request.num_computed_tokens, token_budget)
            while not self._allocate_slots(request, num_new):
                victim = self.running.pop()          # the newest running request
                self._preempt(victim)
                out.preempted.append(victim)
                if victim is request:                # it was itself the newest: stop here
                    break
            else:
                out.scheduled.append((request, num_new))
                token_budget -= num_new
                i += 1
                continue
            break

        # 2. Waiting requests, oldest first; none while this step had to preempt, since
        #    memory is short (vLLM does the same).
        while (not out.preempted and self.waiting and token_budget > 0
               and len(self.running) < self.max_num_seqs):
            request = self.waiting[0]
            num_new = self._admit(request, token_budget)
            if num_new == 0:
                break                               # wait for running requests to free blocks
            self.waiting.popleft()
            self.running.append(request)
            out.scheduled.append((request, num_new))
            token_budget -= num_new
        return out

    def _admit(self, request: Request, token_budget: int) -> int:
        """Give a waiting request its cached prefix and new blocks; its num_new_tokens, or 0."""
        pool = self.block_pool
        hits = []
        if pool.enable_caching:
            hits = pool.find_cached_blocks(request.block_hashes,
                                           (request.num_tokens - 1) // pool.block_size,
                                           request.token_ids)
        num_cached = len(hits) * pool.block_size
        num_new = min(request.num_tokens - num_cached, token_budget)
        # Cached blocks that sit in the free queue leave it, so they are not free for others.
        num_free = pool.num_free_blocks - sum(1 for b in hits if pool.blocks[b].ref_count == 0)
        if pool.blocks_needed(len(hits), num_cached + num_new) > num_free:
            return 0
        pool.touch(hits)
        request.block_ids = hits
        request.num_cached_blocks = len(hits)
        request.num_computed_tokens = num_cached
        allocated = self._allocate_slots(request, num_new)
        assert allocated, "checked above: the free blocks suffice"
        if request.status == RequestStatus.WAITING:   # first admission, not a re-admission
            request.num_cached_tokens = num_cached
        if pool.enable_caching:
            self.prefix_cache_queries += request.num_tokens
            self.prefix_cache_hits += num_cached
        request.status = RequestStatus.RUNNING
        return num_new

    def _allocate_slots(self, request: Request, num_new_tokens: int) -> bool:
        """Make the block table hold num_computed + num_new tokens; False if blocks run out."""
        n = self.block_pool.blocks_needed(len(request.block_ids),
                                          request.num_computed_tokens + num_new_tokens)
        if n > self.block_pool.num_free_blocks:
            return False
        request.block_ids.extend(self.block_pool.allocate(n))
        return True

    def _preempt(self, request: Request) -> None:
        """Recompute preemption: drop the K/V, keep the tokens, go to the front of the queue."""
        self.block_pool.free(request.block_ids)
        request.block_ids = []
        request.num_cached_blocks = 0
        request.num_computed_tokens = 0
        request.status = RequestStatus.PREEMPTED
        request.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.appendleft(request)

    # ---- after the forward pass -----------------------------------------------------
    def update(self, out: SchedulerOutput, sampled: dict[str, int]) -> list[Request]:
        """Advance the counters, append sampled tokens, finish what hit a stop condition.

        `sampled` maps request_id -> new token for the requests whose step reached the end
        of their known tokens (a request mid-prompt samples nothing). Returns the finished.
        """
        finished = []
        for request, num_new in out.scheduled:
            request.num_computed_tokens += num_new
            token = sampled.get(request.request_id)
            if token is not None:
                request.output_token_ids.append(token)
            self._hash_new_blocks(request)
            self._cache_full_blocks(request)     # before a finish frees them
            if token is None:
                continue
            status = self._check_stop(request, token)
            if status is not None:
                self.finish_request(request, status)
                finished.append(request)
        return finished

    def _hash_new_blocks(self, request: Request) -> None:
        pool = self.block_pool
        if pool.enable_caching:
            extend_block_hashes(request.block_hashes, request.token_ids, request.num_tokens,
                                pool.block_size, pool.hash_fn, request.cache_salt)

    def _cache_full_blocks(self, request: Request) -> None:
        """Name the blocks whose every slot now holds computed K/V."""
        pool = self.block_pool
        if not pool.enable_caching:
            return
        bs = pool.block_size
        num_full = request.num_computed_tokens // bs
        for i in range(request.num_cached_blocks, num_full):
            pool.cache_block(request.block_ids[i], request.block_hashes[i],
                             request.token_ids(i * bs, (i + 1) * bs))
        request.num_cached_blocks = max(request.num_cached_blocks, num_full)

    def _check_stop(self, request: Request, token: int) -> RequestStatus | None:
        if not request.sampling_params.ignore_eos and token in request.eos_token_ids:
            request.stop_reason = token
            return RequestStatus.FINISHED_STOPPED
        if request.num_output_tokens >= request.max_tokens or request.num_tokens >= self.max_model_len:
            return RequestStatus.FINISHED_LENGTH
        return None

    def finish_request(self, request: Request, status: RequestStatus) -> None:
        """Take a request out of the queues and give its blocks back."""
        if request in self.running:
            self.running.remove(request)
        elif request in self.waiting:
            self.waiting.remove(request)
        self.block_pool.free(request.block_ids)
        request.block_ids = []
        request.status = status
