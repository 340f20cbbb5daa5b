"""A hybrid's state pages in the scheduler: taken with the blocks, freed with them, copied on a fork, kept at
block boundaries for the prefix cache. Plain Python with a fake model, like test_scheduler.py; the tokens a
real hybrid computes this way are held to transformers in tests/models/test_hybrid_models.py."""
from nanopaged.core.block_pool import BlockPool
from nanopaged.core.request import Request, SampledToken
from nanopaged.core.scheduler import Scheduler
from nanopaged.models.hybrid import HybridConfig
from nanopaged.sampling_params import SamplingParams

GROUPS = 2          # pages a request's state takes


def make(num_blocks=40, block_size=4, budget=64, caching=True):
    pool = BlockPool(num_blocks, block_size, enable_caching=caching, state_pages_per_request=GROUPS)
    return Scheduler(pool, 8, budget), pool


def request(rid, prompt, max_tokens=4):
    return Request(str(rid), list(prompt), SamplingParams(max_tokens=max_tokens), max_tokens=max_tokens)


def step(sched, tokens=7):
    """Schedule, pretend to compute, sample `tokens` for every request that reached its end."""
    out = sched.schedule()
    sampled = {r: [SampledToken(tokens)] for r, n in out.scheduled if r.num_computed_tokens + n == r.num_tokens}
    sched.advance(out)
    sched.append(out, sampled)
    for r in [r for r in sampled if r.num_output_tokens >= r.max_tokens]:
        sched.finish_request(r, r.status.FINISHED_LENGTH)
    return out


def held_by_requests(pool):
    return pool.num_blocks - pool.num_free_blocks - sum(len(b.state_snapshot) for b in pool.blocks)


def test_admission_takes_the_state_pages_beside_the_blocks_and_finish_gives_them_back():
    sched, pool = make(caching=False)
    r = request(0, range(10, 20))
    sched.add_request(r)
    step(sched)
    assert len(r.state_pages) == GROUPS and not set(r.state_pages) & set(r.block_ids)
    assert held_by_requests(pool) == 3 + GROUPS               # 10 tokens in 3 blocks of 4, and the state
    sched.finish_request(r, r.status.FINISHED_LENGTH)
    assert r.state_pages == [] and pool.num_free_blocks == pool.num_blocks
    pool.check_invariants()


def test_a_request_waits_while_its_state_pages_do_not_fit():
    sched, pool = make(num_blocks=4, caching=False)           # 3 blocks of prompt + 2 state pages > 4
    sched.add_request(request(0, range(10, 20)))
    assert sched.schedule().scheduled == []


def test_preemption_frees_the_state_pages_and_recomputation_starts_from_zero():
    sched, pool = make(num_blocks=12, caching=False)
    a, b = request(0, range(10, 18), max_tokens=20), request(1, range(30, 38), max_tokens=20)
    for r in (a, b):
        sched.add_request(r)
    for _ in range(12):
        out = step(sched)
        if out.preempted:
            break
    assert out.preempted == [b] and b.state_pages == [] and b.num_computed_tokens == 0
    pool.check_invariants()


def test_a_fork_gets_pages_of_its_own_filled_from_its_parents_before_the_next_step():
    sched, pool = make(caching=False)
    parent, child = request(0, range(10, 16)), request(1, range(10, 16))
    sched.add_request(parent)
    out = sched.schedule()
    sched.advance(out)
    sched.append(out, {parent: [SampledToken(7)], child: [SampledToken(8, parent=parent)]})
    assert child.block_ids == parent.block_ids[:len(child.block_ids)]
    assert len(child.state_pages) == GROUPS and not set(child.state_pages) & set(parent.state_pages)
    nxt = sched.schedule()
    assert nxt.blocks_to_copy[:GROUPS] == list(zip(parent.state_pages, child.state_pages))


def test_a_fork_with_no_free_page_waits_to_be_computed_from_its_prompt():
    sched, pool = make(num_blocks=4, caching=False)           # 2 blocks of prompt + 2 state pages: full
    parent, child = request(0, range(10, 16)), request(1, range(10, 16))
    sched.add_request(parent)
    out = sched.schedule()
    sched.advance(out)
    sched.append(out, {parent: [SampledToken(7)], child: [SampledToken(8, parent=parent)]})
    assert child in sched.waiting and child.state_pages == [] and child.block_ids == []


def test_a_prompts_chunks_end_on_block_boundaries_and_keep_the_state_there():
    sched, pool = make(block_size=4)
    r = request(0, range(10, 23))                             # 13 tokens: boundaries at 4, 8, 12
    sched.add_request(r)
    out = step(sched)
    assert out.scheduled == [(r, 12)]                         # cut to the last boundary; 1 token left
    kept = [b for b in r.block_ids if pool.blocks[b].state_snapshot]
    assert kept == r.block_ids[:3] and all(len(pool.blocks[b].state_snapshot) == GROUPS for b in kept)
    assert step(sched).scheduled == [(r, 1)]


def test_a_hit_stops_at_the_last_block_that_keeps_a_snapshot_and_restores_it():
    sched, pool = make(block_size=4, budget=6)                # a 6-token budget: the first step ends at 4 only
    first = request(0, range(10, 23))
    sched.add_request(first)
    first.max_tokens = 1
    while not first.output_token_ids:
        step(sched)
    snapshot_blocks = [b.block_id for b in pool.blocks if b.state_snapshot]
    second = request(1, list(range(10, 22)) + [99])           # the same 12 tokens, then another
    sched.add_request(second)
    out = sched.schedule()
    assert out.admitted == [(second, 4 * len(snapshot_blocks))]
    last = pool.blocks[second.block_ids[len(snapshot_blocks) - 1]]
    assert out.blocks_to_copy == list(zip(last.state_snapshot, second.state_pages))


def test_an_evicted_block_frees_its_snapshot_and_snapshots_never_preempt():
    sched, pool = make(num_blocks=10, block_size=4)
    r = request(0, range(10, 23), max_tokens=1)               # 4 blocks + 2 pages; 3 snapshots of 2 need 6
    sched.add_request(r)
    while not r.output_token_ids:
        assert not step(sched).preempted
    assert sum(len(b.state_snapshot) for b in pool.blocks) == 2 * len([b for b in pool.blocks if b.state_snapshot])
    assert pool.usage() == 0.0                                # snapshots of free blocks count as free
    other = request(1, range(50, 82), max_tokens=1)           # 8 blocks + 2 pages: the whole pool
    sched.add_request(other)
    assert sched.schedule().scheduled == [(other, 32)]        # the snapshots were given up for it
    assert not any(b.state_snapshot for b in pool.blocks) and pool.num_evicted_blocks > 0
    assert pool.num_free_blocks == 0
    pool.check_invariants()


def test_the_block_size_grows_to_hold_a_state_and_to_the_layers_chunk():
    h = HybridConfig(("linear", "attention"), ((10, 3), (2, 8, 8)), {}, chunk=64)
    assert h.state_bytes() == (30 + 128) * 4
    assert h.block_size_for(16, 16) == 64                     # 632 bytes need 40 tokens: one chunk
    assert h.block_size_for(16, 4) == 192                     # 158 tokens: three chunks
    assert h.block_size_for(128, 16) == 128                   # what was asked, when it is a multiple
    assert h.place(0) == (0, 0) and h.place(1) == (0, -1)
