"""The scheduler: each step, let `num_computed_tokens` chase `num_tokens` for as many requests as fit.

There is no prefill phase and no decode phase (vLLM: v1/core/sched/scheduler.py). Each
step has one token budget, `max_num_batched_tokens`. Running requests are served first,
oldest first: one that is decoding asks for 1 token, one in the middle of a long prompt
for the rest of it, and gets what is left of the budget (a chunk). Then waiting requests
are admitted, oldest first, while the budget, `max_num_seqs` and the free blocks allow.

When a running request needs a block and none is free, the newest running request is
preempted by *recompute*: its blocks are freed, its `num_computed_tokens` drops to 0 and
it goes back to the front of the waiting queue, keeping the tokens it generated.

Draft tokens change one number: a running request chases `num_tokens_with_spec`, its tokens plus
the drafts guessed ahead (vLLM's spec_token_ids); `update` rolls rejected drafts back.

Admission looks the request's prefix up in the prefix cache, then in the block sources (tiers beyond
it), and its prefill starts where they end; after every step new full blocks are named in it. `fork` lets a
request share every block of another (n > 1 samples); a write into a shared block first copies
it (copy-on-write, `_allocate_slots`). A hybrid model's state pages ride along with the blocks
(core/state_pages.py), and a prompt's images with the encoder cache (core/encoder_cache.py): a step
encodes the images its tokens reach, within its encoder budget. docs/04_scheduler.md explains it;
docs/03 and docs/06 the prefix cache and sharing. No torch.
"""
from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from nanopaged.core.block_pool import BlockPool, cdiv
from nanopaged.core.encoder_cache import EncoderCache
from nanopaged.core.request import Request, RequestStatus, SampledToken
from nanopaged.core.state_pages import StatePages


@dataclass
class SchedulerOutput:
    """What one step computes, and what the scheduler did to make room for it."""
    scheduled: list[tuple[Request, int]] = field(default_factory=list)   # (request, num_new_tokens)
    admitted: list[tuple[Request, int]] = field(default_factory=list)    # (request, tokens it found cached)
    preempted: list[Request] = field(default_factory=list)
    blocks_to_copy: list[tuple[int, int]] = field(default_factory=list)  # pages copied before the forward (src, dst)
    encoder_inputs: list[tuple[Request, int]] = field(default_factory=list)   # images to encode: (request, index)
    encoder_frees: list[str] = field(default_factory=list)    # encoder outputs given up: the runner drops them
    sampling: list[Request] = field(default_factory=list)     # set by advance: each counts a placeholder until append
    blocks_to_fill: list[tuple[int, object]] = field(default_factory=list)   # (new block, K/V a block source supplied)

    @property
    def num_batched_tokens(self) -> int:
        return sum(n for _, n in self.scheduled)


class Scheduler:
    def __init__(self, block_pool: BlockPool, max_num_seqs: int, max_num_batched_tokens: int,
                 encoder_cache: EncoderCache | None = None) -> None:
        self.block_pool = block_pool
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []   # in admission order: the last is the newest
        self.admission_rules: list = []    # rule(request, running) -> bool: may it join them now?
        self.schedule_unsampled = True     # may a request whose token is computing run again? (batch_queue.py: no)
        self.block_sources: list = []      # source(request, block hashes) -> K/V of the first of them it holds
        self.states = StatePages(block_pool)
        self.encoder = encoder_cache or EncoderCache(0, 0)

    def add_request(self, request: Request) -> None:
        self.waiting.append(request)

    def has_unfinished_requests(self) -> bool:
        return bool(self.waiting or self.running)

    # ---- one step -----------------------------------------------------------------------
    def schedule(self, max_seqs: int | None = None) -> SchedulerOutput:
        """`max_seqs`: at most this many sequences (a micro-batch's share: engine/batch_queue.py); None: any."""
        out = SchedulerOutput()
        token_budget = self.max_num_batched_tokens
        self.states.copies_for_step(out.blocks_to_copy)
        self.encoder.new_step()

        # 1. Running requests, oldest first. Preemption takes the newest, so a request that
        #    is no longer RUNNING here was preempted in this pass, and so are all after it.
        for request in list(self.running):
            if token_budget == 0 or request.status != RequestStatus.RUNNING or len(out.scheduled) == max_seqs:
                break
            unsampled = request.num_output_placeholders and not self.schedule_unsampled   # a batch in flight samples it
            if unsampled or request.num_output_tokens + request.num_output_placeholders >= request.max_tokens:
                continue      # a step computing now samples its (last) token
            num_new = self.states.align(request, min(request.num_tokens_with_spec - request.num_computed_tokens,
                                                     token_budget))
            # drafts past the budget are dropped, not chunked: they are guesses (vLLM does the same)
            del request.spec_token_ids[max(0, request.num_computed_tokens + num_new - request.num_tokens):]
            if num_new == 0:      # a request that computed its last token got the next one, or was finished
                raise RuntimeError(f"running request {request.request_id!r} has no new token: a "
                                   "token-selection rule gave it none and it was not aborted")
            num_new, to_encode = self.encoder.fit(request, num_new)
            if num_new == 0:
                continue      # its next image waits for the step's encoder budget or the cache's room
            if not self._make_room(request, num_new, out):
                break         # it was the newest running request itself
            self.encoder.take(request, num_new, to_encode, out)
            out.scheduled.append((request, num_new))
            token_budget -= num_new

        # 2. Waiting requests, oldest first; none while this step had to preempt, since
        #    memory is short (vLLM does the same). One an admission rule holds back waits; the next are tried.
        for request in list(self.waiting):
            if out.preempted or token_budget == 0 or len(out.scheduled) == max_seqs:
                break
            if request.num_output_placeholders or not all(rule(request, self.running) for rule in self.admission_rules):
                continue      # preempted while a batch in flight samples its token; or a rule holds it back
            if sum(r.num_seqs for r in self.running) + request.num_seqs > self.max_num_seqs:
                break
            num_new = self._admit(request, token_budget, out)
            if num_new == 0:
                break         # wait for running requests to free blocks
            self.waiting.remove(request)
            self.running.append(request)
            out.scheduled.append((request, num_new))
            token_budget -= num_new
        self.states.plan_snapshots(out.scheduled)
        return out

    def _make_room(self, request: Request, num_new: int, out: SchedulerOutput) -> bool:
        """Give the request slots for num_new tokens, preempting the newest running requests
        until they fit; False if the request had to preempt itself."""
        while not self._allocate_slots(request, num_new, out.blocks_to_copy):
            victim = self.running.pop()
            self._preempt(victim)
            out.preempted.append(victim)
            if victim is request:
                return False
        return True

    def _admit(self, request: Request, token_budget: int, out: SchedulerOutput) -> int:
        """Give a waiting request its cached prefix and new blocks; its num_new_tokens, or 0."""
        pool = self.block_pool
        hits = self.states.usable_hits(pool.find_cached_prefix(request))
        if self._next_block_in_flight(request, len(hits)):
            return 0          # a running request is computing that very block: wait, then hit it
        wanted = pool.block_hashes(request)[len(hits):pool.max_cache_hit_blocks(request)]
        # where the pool's hits end, a block source (a tier beyond it) may hold the next blocks' K/V: new blocks, filled
        supplied = next((kv for source in self.block_sources if wanted and (kv := source(request, wanted))), [])
        num_cached = (len(hits) + len(supplied)) * pool.block_size
        request.num_computed_tokens = num_cached
        num_new = self.states.align(request, min(request.num_tokens - num_cached, token_budget))
        num_new, to_encode = self.encoder.fit(request, num_new)
        # Cached blocks that sit in the free queue leave it (with a hybrid's snapshots): not free for others.
        num_free = pool.num_free_blocks - sum(1 + len(pool.blocks[b].state_snapshot) for b in hits
                                              if pool.blocks[b].ref_count == 0)
        if num_new == 0 or pool.blocks_needed(len(hits), num_cached + num_new) + self.states.per_request > num_free:
            request.num_computed_tokens = 0
            return 0
        pool.touch(hits)
        request.block_ids = list(hits)
        request.num_cached_blocks = len(hits)
        allocated = self._allocate_slots(request, num_new, [])
        assert allocated, "checked above: the free blocks suffice"
        out.blocks_to_fill += zip(request.block_ids[len(hits):], supplied)
        self.states.take(request, hits, out.blocks_to_copy)
        self.encoder.take(request, num_new, to_encode, out)
        if request.status == RequestStatus.WAITING:   # first admission, not a re-admission
            request.num_cached_tokens = num_cached
        request.status = RequestStatus.RUNNING
        out.admitted.append((request, num_cached))
        return num_new

    def _next_block_in_flight(self, request: Request, num_hits: int) -> bool:
        """Is the next block this request needs being computed by a running request right now?

        If so, waiting a step (or a few, while a long prompt is chunked) and then hitting
        it saves computing the same K/V twice: requests admitted together would otherwise
        all miss on a shared system prompt. (vLLM does not do this; it is an offline-throughput
        choice, docs/03_prefix_caching.md.)
        """
        pool, bs = self.block_pool, self.block_pool.block_size
        if num_hits >= pool.max_cache_hit_blocks(request):
            return False
        needed = pool.block_hashes(request)[num_hits]
        # not named in the cache yet: computed now, or later, or by a step computing now (async scheduling)
        return any(needed in pool.block_hashes(r)[r.num_cached_blocks:r.num_prompt_tokens // bs]
                   for r in self.running)

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

    def _preempt(self, request: Request) -> None:
        """Recompute preemption: drop the K/V, keep the tokens, go to the front of the queue."""
        self.block_pool.free(request.block_ids)
        self.states.give_back(request)
        self.encoder.release(request)         # the article's rule: all blocks and the encoder cache
        request.block_ids = []
        request.num_cached_blocks = 0
        request.num_computed_tokens = 0
        request.spec_token_ids = []       # guessed for K/V that is gone
        request.status = RequestStatus.PREEMPTED
        request.num_preemptions += 1
        self.waiting.appendleft(request)

    # ---- sharing ----------------------------------------------------------------------------
    def fork(self, parent: Request, child: Request) -> None:
        """The child shares every block of the parent: a copy of its table, each ref_count + 1.

        Full blocks are never written again, so they stay shared; the partly filled last
        one is copied by `_allocate_slots` when one of its holders writes into it. A parent
        that holds no blocks (preempted) cannot share: the child then waits to be computed.
        """
        if parent.status != RequestStatus.RUNNING or not self.states.fork(parent, child):
            child.status = RequestStatus.WAITING
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

    # ---- after the forward pass -------------------------------------------------------------
    def update(self, out: SchedulerOutput, sampled: dict[Request, list[SampledToken]]) -> None:
        """Advance the counters, append the sampled tokens, name the blocks that became full.

        `sampled` holds the tokens of each request whose step reached the end of its known
        tokens (one in the middle of a prompt samples nothing): one, or with drafts the ones
        accepted and one more. Whether a request stops is not decided here but where its text
        is known (engine/output_processor.py: check_stop).
        """
        self.advance(out)
        self.append(out, sampled)

    def advance(self, out: SchedulerOutput) -> None:
        """The step's K/V is computed, or being computed: async scheduling schedules the next step now. Each
        request it samples for counts a placeholder token until `append` (vLLM: num_output_placeholders)."""
        for request, num_new in out.scheduled:
            if request.num_computed_tokens + num_new == request.num_tokens_with_spec:
                request.num_output_placeholders += 1
                out.sampling.append(request)
            request.num_computed_tokens += num_new
            self.encoder.done_with(request)

    def append(self, out: SchedulerOutput, sampled: dict[Request, list[SampledToken]]) -> None:
        for request in out.sampling:      # its placeholder is a token now; one a later batch in flight counted stays
            request.num_output_placeholders -= 1
        # Fork first, append after: a child shares its parent's blocks as they were computed.
        forked = [r for r, tokens in sampled.items() if tokens[0].parent is not None]
        for request in forked:            # n > 1 samples, or a rule's new sequences: drawn from the parent's row
            self.fork(sampled[request][0].parent, request)
        for request, tokens in sampled.items():
            self._append(request, tokens)
        for request in [r for r, _ in out.scheduled] + forked:
            if request.status == RequestStatus.RUNNING:     # not preempted while its step ran (async)
                self.block_pool.cache_full_blocks(request)   # before a finish frees them
                self.states.keep_snapshots(request)

    def _append(self, request: Request, tokens: list[SampledToken]) -> None:
        """Append the step's tokens. With k drafts the step computed k + 1 positions and the
        sampler accepted len(tokens) - 1 drafts: the rejected ones roll back off the counter (their
        slots are overwritten later), and a block that holds none of the request's tokens goes back."""
        request.num_computed_tokens -= len(request.spec_token_ids) - (len(tokens) - 1)
        request.spec_token_ids = []
        request.output_token_ids += [t.token_id for t in tokens]
        keep = cdiv(request.num_tokens, self.block_pool.block_size)
        if len(request.block_ids) > keep:
            self.block_pool.free(request.block_ids[keep:])
            del request.block_ids[keep:]

    def finish_request(self, request: Request, status: RequestStatus) -> None:
        """Take a request out of the queues and give its blocks back."""
        if request in self.running:
            self.running.remove(request)
        elif request in self.waiting:
            self.waiting.remove(request)
        self.block_pool.free(request.block_ids)
        self.states.give_back(request)
        self.encoder.release(request)
        request.block_ids = []
        request.status = status
