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

Parallel sampling (n > 1) shares blocks inside a request (paper section 4.4): the prompt
is prefilled once, then the samples fork (`fork`): each child gets a copy of the block
table, and every shared block's `ref_count` rises. A request about to write into a block
whose `ref_count > 1` (the partly filled last prompt block) first gets a private copy
(`_allocate_slots`, copy-on-write); the runner copies the block's K/V before the forward
pass. Full shared blocks are never written, so never copied.

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
    blocks_to_copy: list[tuple[int, int]] = field(default_factory=list)  # copy-on-write (src, dst)

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
            if num_new == 0:        # a beam waiting for its siblings (beam_search.py): nothing to do
                i += 1
                continue
            while not self._allocate_slots(request, num_new, out.blocks_to_copy):
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
        while not out.preempted and self.waiting and token_budget > 0:
            request = self.waiting[0]
            if self._num_seqs() + 1 + len(request.pending_children) > self.max_num_seqs:
                break
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
            max_hit_blocks = (request.num_tokens - 1) // pool.block_size
            hits = pool.find_cached_blocks(request.block_hashes, max_hit_blocks, request.token_ids)
            if len(hits) < max_hit_blocks and request.block_hashes[len(hits)] in self._blocks_in_flight():
                return 0     # a running request is computing this very block: wait, then hit it
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
        allocated = self._allocate_slots(request, num_new, [])
        assert allocated, "checked above: the free blocks suffice"
        if request.status == RequestStatus.WAITING:   # first admission, not a re-admission
            request.num_cached_tokens = num_cached
        if pool.enable_caching:
            self.prefix_cache_queries += request.num_tokens
            self.prefix_cache_hits += num_cached
        request.status = RequestStatus.RUNNING
        return num_new

    def _blocks_in_flight(self) -> set[bytes]:
        """Hashes of full prompt blocks that running requests have not computed yet.

        A waiting request whose next block is among them would compute the same K/V a
        second time; waiting until the block is cached (a step or a few) saves that work.
        Requests admitted together in one step would otherwise all miss on a shared
        system prompt. (vLLM does not do this; it is an offline-throughput choice.)
        """
        bs = self.block_pool.block_size
        return {h for r in self.running
                for h in r.block_hashes[r.num_computed_tokens // bs:r.num_prompt_tokens // bs]}

    def _num_seqs(self) -> int:
        """Running sequences, counting the samples that will fork off them."""
        return sum(1 + len(r.pending_children) for r in self.running)

    def _allocate_slots(self, request: Request, num_new_tokens: int,
                        blocks_to_copy: list[tuple[int, int]]) -> bool:
        """Make the block table hold num_computed + num_new tokens; False if blocks run out.

        The first new token goes into block num_computed // block_size. If that block is
        already in the table and shared (ref_count > 1), writing into it would change the
        other holders' K/V: copy-on-write gives this request a private copy first.
        """
        pool = self.block_pool
        table = request.block_ids
        i = request.num_computed_tokens // pool.block_size
        cow = i < len(table) and pool.blocks[table[i]].ref_count > 1
        n = pool.blocks_needed(len(table), request.num_computed_tokens + num_new_tokens)
        if n + cow > pool.num_free_blocks:
            return False
        if cow:
            [copy] = pool.allocate(1)
            blocks_to_copy.append((table[i], copy))
            pool.free([table[i]])          # drops this request's reference only
            table[i] = copy
        table.extend(pool.allocate(n))
        return True

    def fork(self, parent: Request, child: Request) -> None:
        """The child shares every block of the parent: a copy of the table, ref_count + 1 each.

        A parent that was preempted has no blocks: the child then waits to be prefilled too.
        """
        if parent.status != RequestStatus.RUNNING:
            child.status = RequestStatus.WAITING
            child.block_hashes = list(parent.block_hashes)
            self.waiting.append(child)
            return
        self.block_pool.touch(parent.block_ids)
        child.block_ids = list(parent.block_ids)
        child.num_computed_tokens = parent.num_computed_tokens
        child.block_hashes = list(parent.block_hashes)
        child.num_cached_blocks = parent.num_cached_blocks
        child.num_cached_tokens = parent.num_cached_tokens
        child.status = RequestStatus.RUNNING
        self.running.append(child)

    def preempt_idle(self) -> bool:
        """Free the newest running request that has nothing to compute; False if there is none.

        Only beam search leaves such requests (a beam waiting for a sibling that is being
        recomputed). If they hold every block, the sibling can never be admitted: freeing
        them breaks the stall. They go to the *back* of the queue, so the sibling comes first.
        """
        for request in reversed(self.running):
            if request.num_computed_tokens == request.num_tokens:
                self.running.remove(request)
                self._preempt(request, front=False)
                return True
        return False

    def _preempt(self, request: Request, front: bool = True) -> None:
        """Recompute preemption: drop the K/V, keep the tokens, go to the front of the queue."""
        self.block_pool.free(request.block_ids)
        request.block_ids = []
        request.num_cached_blocks = 0
        request.num_computed_tokens = 0
        request.status = RequestStatus.PREEMPTED
        request.num_preemptions += 1
        self.num_preemptions += 1
        if front:
            self.waiting.appendleft(request)
        else:
            self.waiting.append(request)

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
            if token is None:
                self._hash_new_blocks(request)
                self._cache_full_blocks(request)
                continue
            # The prompt is done: the other samples fork off it before it moves on.
            children, request.pending_children = request.pending_children, []
            for child in children:
                self.fork(request, child)
            for seq in [request] + children:
                seq.output_token_ids.append(sampled[seq.request_id])
                self._hash_new_blocks(seq)
                self._cache_full_blocks(seq)     # before a finish frees them
                status = self._check_stop(seq, seq.output_token_ids[-1])
                if status is not None:
                    self.finish_request(seq, status)
                    finished.append(seq)
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
        """vLLM's rules: EOS (stop_reason None), a stop token (stop_reason = its id), length."""
        params = request.sampling_params
        if request.num_output_tokens >= params.min_tokens:   # before that the sampler blocks them
            if not params.ignore_eos and token in request.eos_token_ids:
                return RequestStatus.FINISHED_STOPPED
            if token in params.stop_token_ids:
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
        for child in request.pending_children:     # an aborted parent takes its unforked samples along
            child.status = status
        request.pending_children = []
        self.block_pool.free(request.block_ids)
        request.block_ids = []
        request.status = status
