"""State pages: what the scheduler does for a hybrid model's linear layers, whose memory is a fixed state.

A hybrid (models/hybrid.py) keeps, per request, one page per group of linear layers beside its block
table, from the same free queue. This file keeps their books (no torch; the runner moves the bytes):

- a request admitted takes its pages; preempted or finished, it gives them back with its blocks, and a
  recomputation starts from zero, as the article's V1 recomputes K/V;
- a fork (n > 1) takes pages of its own, filled with a copy of its parent's before the next step;
- the prefix cache, vLLM's "align" mode: a prompt's chunks end on block boundaries, and the linear layers
  write the state at each boundary a step reaches into fresh pages that the block then keeps (its
  snapshot). A later prompt with the same prefix hits only up to a block that keeps a snapshot,
  restores it into its own pages and computes the rest. A snapshot is freed when its block is evicted.

With no linear layers (`pages_per_request` 0) every method does nothing. docs/15_hybrid_models.md.
"""
from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from nanopaged.core.block_pool import BlockPool
    from nanopaged.core.request import Request


class StatePages:
    def __init__(self, pool: BlockPool) -> None:
        self.pool = pool
        self.per_request = pool.state_pages_per_request
        self.pending_copies: list[tuple[int, int]] = []    # forks' (parent page, child page), for the next step
        self.snapshots_taken = 0
        self.snapshots_restored = 0

    def cached(self) -> bool:
        return bool(self.per_request) and self.pool.enable_caching

    # ---- a request's own pages --------------------------------------------------------------
    def take(self, request: Request, hits: list[int], copies: list[tuple[int, int]]) -> None:
        """Admission: the request's pages; after a hit, the snapshot of its last hit block copied in (`copies`:
        the step's pages to copy before its forward pass)."""
        if not self.per_request:
            return
        request.state_pages = self.pool.allocate(self.per_request)
        if hits:
            copies += zip(self.pool.blocks[hits[-1]].state_snapshot, request.state_pages)
            self.snapshots_restored += 1

    def give_back(self, request: Request) -> None:
        """Preemption or finish: the pages, and snapshots not yet handed to their blocks."""
        if request.state_pages:
            self.pool.free(request.state_pages)
            request.state_pages = []
        for _, pages in request.pending_snapshots:
            self.pool.free(pages)
        request.pending_snapshots = []

    def fork(self, parent: Request, child: Request) -> bool:
        """A child sharing its parent's blocks gets pages of its own holding the parent's state; False if
        none are free (the child then waits and is computed from its prompt)."""
        if not self.per_request:
            return True
        if self.pool.num_free_blocks < self.per_request:
            return False
        child.state_pages = self.pool.allocate(self.per_request)
        self.pending_copies += zip(parent.state_pages, child.state_pages)
        return True

    def copies_for_step(self, copies: list[tuple[int, int]]) -> None:
        """The forks' copies run first in the step, before any page given out in it is written."""
        copies[:0] = self.pending_copies
        self.pending_copies = []

    # ---- the prefix cache -------------------------------------------------------------------
    def usable_hits(self, hits: list[int]) -> list[int]:
        """A hit continues from a state: only up to the last hit block that keeps a snapshot."""
        if not self.per_request:
            return hits
        n = len(hits)
        while n and not self.pool.blocks[hits[n - 1]].state_snapshot:
            n -= 1
        return hits[:n]

    def align(self, request: Request, num_new: int) -> int:
        """A prompt's chunk cut to end on its last block boundary inside it, so the state there can be kept."""
        if not self.cached():
            return num_new
        start, bs = request.num_computed_tokens, self.pool.block_size
        boundary = min(start + num_new, request.num_prompt_tokens) // bs * bs
        return boundary - start if start < boundary < start + num_new else num_new

    def plan_snapshots(self, scheduled: list[tuple[Request, int]]) -> None:
        """After scheduling, from the pages left free (never preempting for them): fresh pages for the state at
        each block boundary of a prompt that a step reaches, written by the linear layers during the forward
        pass. Inside a step only where it starts on a boundary (the layers' chunks line up with the blocks)."""
        if not self.cached():
            return
        bs = self.pool.block_size
        for request, num_new in scheduled:
            start, end = request.num_computed_tokens, request.num_computed_tokens + num_new
            first = start + bs if start % bs == 0 else end
            for boundary in range(first, min(end, request.num_prompt_tokens) + 1, bs):
                if boundary % bs or self.pool.num_free_blocks < self.per_request:
                    continue
                request.pending_snapshots.append((boundary // bs - 1, self.pool.allocate(self.per_request)))

    def keep_snapshots(self, request: Request) -> None:
        """After the step: each snapshot goes to the block it ends, now named in the cache (else it is freed)."""
        for index, pages in request.pending_snapshots:
            block = self.pool.blocks[request.block_ids[index]] if index < len(request.block_ids) else None
            if block is None or block.block_hash is None or block.state_snapshot:
                self.pool.free(pages)             # not cached, or the block already keeps one
            else:
                self.pool.keep_snapshot(block.block_id, pages)
                self.snapshots_taken += 1
        request.pending_snapshots = []
