"""The scheduler's rules: two counters, one token budget, chunked prefill, recompute preemption.

These tests run the scheduler alone with a fake model (a token per sampling request),
so they are plain Python and take milliseconds. Whether a request stops is decided outside
the scheduler (engine/output_processor.py: check_stop); `run_step` plays the engine's part.
"""
import random

import pytest

from nanopaged.core.block_pool import BlockPool, cdiv
from nanopaged.core.request import Request, RequestStatus, SampledToken
from nanopaged.core.scheduler import Scheduler
from nanopaged.engine.output_processor import check_stop
from nanopaged.sampling_params import SamplingParams

EOS = 2


def make_request(rid, prompt_len, max_tokens=8, ignore_eos=True):
    return Request(request_id=str(rid), prompt_token_ids=list(range(10, 10 + prompt_len)),
                   sampling_params=SamplingParams(max_tokens=max_tokens, ignore_eos=ignore_eos),
                   max_tokens=max_tokens, eos_token_ids=frozenset({EOS}))


def make_scheduler(num_blocks=100, block_size=4, max_num_seqs=8, budget=64, enable_caching=False):
    pool = BlockPool(num_blocks, block_size, enable_caching=enable_caching)
    return Scheduler(pool, max_num_seqs, budget), pool


def update_and_stop(sched, out, tokens):
    """What the engine does after the forward pass: update, then finish the requests that stop."""
    sched.update(out, {r: [SampledToken(t)] for r, t in tokens.items()})
    finished = []
    for r in tokens:
        stop = check_stop(r)
        if stop is not None:
            sched.finish_request(r, stop[0])
            finished.append(r)
    return finished


def run_step(sched, token=7):
    """schedule + update, sampling `token` for every request that reached its end."""
    out = sched.schedule()
    tokens = {r: token for r, n in out.scheduled if r.num_computed_tokens + n == r.num_tokens}
    return out, update_and_stop(sched, out, tokens)


def test_prefill_and_decode_share_one_batch():
    sched, _ = make_scheduler()
    a = make_request("a", 5)
    sched.add_request(a)
    run_step(sched)                                  # a prefilled, sampled its first token
    b = make_request("b", 9)
    sched.add_request(b)
    out = sched.schedule()
    assert [(r.request_id, n) for r, n in out.scheduled] == [("a", 1), ("b", 9)]


def test_long_prompt_is_chunked_by_the_token_budget():
    sched, _ = make_scheduler(budget=8)
    a = make_request("a", 20)
    sched.add_request(a)
    chunks = []
    while not a.output_token_ids:
        out, _ = run_step(sched)
        chunks.append(out.scheduled[0][1])
    assert chunks == [8, 8, 4]
    assert a.num_computed_tokens == 20 and a.num_tokens == 21


def test_no_token_is_sampled_mid_prompt():
    sched, _ = make_scheduler(budget=8)
    a = make_request("a", 20)
    sched.add_request(a)
    out = sched.schedule()
    (r, n), = out.scheduled
    assert r.num_computed_tokens + n < r.num_tokens   # the runner would sample nothing


def test_budget_is_shared_running_first():
    sched, _ = make_scheduler(budget=10)
    a = make_request("a", 4)
    sched.add_request(a)
    run_step(sched)
    sched.add_request(make_request("b", 30))
    out = sched.schedule()
    assert [(r.request_id, n) for r, n in out.scheduled] == [("a", 1), ("b", 9)]
    assert out.num_batched_tokens == 10


def test_at_most_max_num_seqs_run():
    sched, _ = make_scheduler(max_num_seqs=3)
    for i in range(5):
        sched.add_request(make_request(i, 3))
    out = sched.schedule()
    assert len(out.scheduled) == 3 and len(sched.waiting) == 2


def test_blocks_are_allocated_on_demand():
    sched, pool = make_scheduler(block_size=4)
    a = make_request("a", 5, max_tokens=10)
    sched.add_request(a)
    run_step(sched)                                  # 5 prompt tokens -> 2 blocks
    assert len(a.block_ids) == 2
    run_step(sched); run_step(sched); run_step(sched)  # 8 computed: still 2 blocks
    assert a.num_computed_tokens == 8 and len(a.block_ids) == 2
    run_step(sched)                                  # the 9th token needs a 3rd block
    assert len(a.block_ids) == 3


def test_out_of_blocks_preempts_the_newest_running_request():
    # 4 blocks of 4 tokens; a and b both hold 2 blocks after their prompts (8 tokens each).
    sched, pool = make_scheduler(num_blocks=4, block_size=4)
    a, b = make_request("a", 8, max_tokens=20), make_request("b", 8, max_tokens=20)
    sched.add_request(a)
    sched.add_request(b)
    run_step(sched)
    assert pool.num_free_blocks == 0
    out, _ = run_step(sched)                         # a needs a 3rd block: b is preempted
    assert out.preempted == [b]
    assert b.status == RequestStatus.PREEMPTED and b.block_ids == [] and b.num_computed_tokens == 0
    assert b.output_token_ids == [7]                 # generated tokens are kept, recomputed later
    assert sched.waiting[0] is b and sched.running == [a]
    assert b.num_preemptions == 1
    assert [r for r, _ in out.scheduled] == [a]


def test_a_step_that_preempts_admits_no_waiting_request():
    sched, _ = make_scheduler(num_blocks=4, block_size=4)
    a, b = make_request("a", 8, max_tokens=20), make_request("b", 8, max_tokens=20)
    sched.add_request(a); sched.add_request(b)
    run_step(sched)
    out = sched.schedule()
    assert out.preempted == [b] and [r for r, _ in out.scheduled] == [a]


def test_the_newest_request_short_of_blocks_preempts_itself():
    sched, pool = make_scheduler(num_blocks=3, block_size=4)
    a = make_request("a", 3, max_tokens=20)
    b = make_request("b", 8, max_tokens=20)
    sched.add_request(a); sched.add_request(b)
    run_step(sched)                     # a: 3 tokens in 1 block, b: 8 tokens in 2; pool empty
    out, _ = run_step(sched)            # a's 4th token fits its block; b's 9th needs a 3rd
    assert out.preempted == [b] and [r for r, _ in out.scheduled] == [a]
    assert sched.running == [a] and sched.waiting[0] is b


def test_finished_request_frees_its_blocks():
    sched, pool = make_scheduler()
    a = make_request("a", 6, max_tokens=2)
    sched.add_request(a)
    run_step(sched)
    _, finished = run_step(sched)
    assert finished == [a] and a.status == RequestStatus.FINISHED_LENGTH
    assert pool.num_free_blocks == pool.num_blocks and sched.running == []


def test_eos_stops_unless_ignore_eos():
    sched, _ = make_scheduler()
    a = make_request("a", 3, max_tokens=10, ignore_eos=False)
    b = make_request("b", 3, max_tokens=10, ignore_eos=True)
    sched.add_request(a); sched.add_request(b)
    _, finished = run_step(sched, token=EOS)
    assert finished == [a] and a.status == RequestStatus.FINISHED_STOPPED
    assert check_stop(a) == (RequestStatus.FINISHED_STOPPED, None)   # vLLM's stop_reason for EOS: None
    assert b.status == RequestStatus.RUNNING


def test_max_tokens_finishes_with_length():
    # (a context limit reaches the scheduler as max_tokens: the input processor clips it)
    sched, _ = make_scheduler()
    a = make_request("a", 4, max_tokens=2)
    sched.add_request(a)
    run_step(sched); _, finished = run_step(sched)
    assert finished == [a] and a.num_tokens == 6 and a.status == RequestStatus.FINISHED_LENGTH


@pytest.mark.parametrize("enable_caching", [False, True], ids=["no_cache", "prefix_cache"])
@pytest.mark.parametrize("seed", range(6))
def test_random_operations_keep_every_invariant_and_finish_everything(seed, enable_caching):
    """Thousands of random adds, steps (with EOS), aborts; check the books after each one.

    Every prompt starts with the same tokens (make_request), so with the prefix cache on,
    requests share blocks, hit freed blocks and evict them all the time.
    """
    rng = random.Random(seed)
    block_size = rng.choice([1, 2, 4, 16])
    num_blocks = rng.randint(8, 40)
    sched, pool = make_scheduler(num_blocks=num_blocks, block_size=block_size,
                                 max_num_seqs=rng.randint(1, 6), budget=rng.randint(1, 40),
                                 enable_caching=enable_caching)
    all_requests, next_id, ops, hits, preemptions = [], 0, 0, 0, {}
    while ops < 3000 or sched.has_unfinished_requests():
        ops += 1
        assert ops < 100_000, "the scheduler stopped making progress"
        op = rng.random() if ops < 3000 else 1.0
        if op < 0.15:
            max_tokens = rng.randint(1, 12)
            # only requests that fit the whole pool alone are admitted (the engine checks this)
            max_prompt = num_blocks * block_size - max_tokens + 1
            if max_prompt >= 1:
                r = make_request(next_id, rng.randint(1, min(max_prompt, 60)), max_tokens,
                                 ignore_eos=rng.random() < 0.5)
                next_id += 1
                all_requests.append(r)
                sched.add_request(r)
        elif op < 0.18 and all_requests:
            r = rng.choice(all_requests)
            if not r.is_finished:
                sched.finish_request(r, RequestStatus.FINISHED_ABORTED)
        else:
            out = sched.schedule()
            assert out.num_batched_tokens <= sched.max_num_batched_tokens
            assert len(sched.running) <= sched.max_num_seqs
            if sched.has_unfinished_requests() and not out.preempted:
                assert out.scheduled, "nothing scheduled although requests wait: deadlock"
            for r, n in out.scheduled:
                assert n >= 1 and len(r.block_ids) == cdiv(r.num_computed_tokens + n, block_size)
            hits += sum(num_cached for _, num_cached in out.admitted)
            for r in out.preempted:
                preemptions[r] = preemptions.get(r, 0) + 1
            tokens = {r: rng.choice([EOS, 5, 6])
                      for r, n in out.scheduled if r.num_computed_tokens + n == r.num_tokens}
            update_and_stop(sched, out, tokens)
        check_books(sched, pool, all_requests)
    assert all(r.is_finished for r in all_requests)
    assert all(r.num_preemptions == preemptions.get(r, 0) for r in all_requests)
    assert pool.num_free_blocks == pool.num_blocks
    if enable_caching:
        assert hits > 0


def check_books(sched, pool, all_requests):
    pool.check_invariants()
    refs = {}
    for r in sched.running:
        assert r.status == RequestStatus.RUNNING
        assert len(r.block_ids) == cdiv(r.num_computed_tokens, pool.block_size)
        assert len(set(r.block_ids)) == len(r.block_ids), "a block twice in one table"
        assert r.num_cached_blocks <= len(r.block_ids)
        for b in r.block_ids:
            refs[b] = refs.get(b, 0) + 1
    for r in sched.waiting:
        assert r.block_ids == [] and r.num_computed_tokens == 0 and r.num_cached_blocks == 0
    for r in all_requests:
        if r.is_finished:
            assert r.block_ids == []
    # ref counts add up: a block's count is the number of block tables holding it
    for block in pool.blocks:
        assert block.ref_count == refs.get(block.block_id, 0)
    if not pool.enable_caching:
        assert all(n == 1 for n in refs.values()), "blocks are shared only through the prefix cache"
    assert pool.num_free_blocks + len(refs) == pool.num_blocks


def test_a_preempted_request_goes_to_the_front_of_a_queue_that_holds_others():
    """It was admitted before every request still waiting, so it is readmitted before them."""
    sched, pool = make_scheduler(num_blocks=4, block_size=4, max_num_seqs=2)
    a, b = make_request("a", 8, max_tokens=20), make_request("b", 8, max_tokens=20)
    c, d = make_request("c", 2, max_tokens=2), make_request("d", 2, max_tokens=2)
    for r in (a, b, c, d):
        sched.add_request(r)
    run_step(sched)                                  # a and b run (max_num_seqs 2); c, d wait
    assert list(sched.waiting) == [c, d]
    out, _ = run_step(sched)                         # a needs a block: b is preempted
    assert out.preempted == [b]
    assert list(sched.waiting) == [b, c, d]


def test_the_last_token_of_the_budget_is_used():
    """A budget of 2 serves two decoding requests, or one and a 1-token chunk of a new prompt."""
    sched, _ = make_scheduler(budget=2)
    a, b, c = make_request("a", 1), make_request("b", 1), make_request("c", 5)
    sched.add_request(a)
    sched.add_request(b)
    run_step(sched)                                  # a and b prefilled (1 token each)
    out = sched.schedule()
    assert [(r.request_id, n) for r, n in out.scheduled] == [("a", 1), ("b", 1)]
    update_and_stop(sched, out, {a: 7, b: 7})
    sched.finish_request(b, RequestStatus.FINISHED_ABORTED)
    sched.add_request(c)
    out = sched.schedule()
    assert [(r.request_id, n) for r, n in out.scheduled] == [("a", 1), ("c", 1)]


def test_a_running_request_left_without_a_token_must_be_finished_before_the_next_step():
    """Every step ends with a token for each request that reached its end; a token-selection
    rule that gives one none (beam search dropping a beam) finishes it before the next step.
    Left running without a token, it is an error that names it, not a silent stall."""
    sched, _ = make_scheduler()
    a, b = make_request("a", 3), make_request("b", 3)
    sched.add_request(a)
    sched.add_request(b)
    out = sched.schedule()
    sched.update(out, {b: [SampledToken(7)]})          # a gets no token this step
    with pytest.raises(RuntimeError, match="running request 'a' has no new token"):
        sched.schedule()
    sched.finish_request(a, RequestStatus.FINISHED_ABORTED)
    out = sched.schedule()
    assert [(r.request_id, n) for r, n in out.scheduled] == [("b", 1)]


def test_fork_shares_the_parents_blocks_and_counters():
    sched, pool = make_scheduler(enable_caching=True)
    parent = make_request("p", 10)
    sched.add_request(parent)
    run_step(sched)
    parent.num_cached_tokens = 8                     # as if its prompt had hit the cache
    child = make_request("c", 10)
    child.output_token_ids = list(parent.output_token_ids)
    sched.fork(parent, child)
    assert child.block_ids == parent.block_ids and child.block_ids is not parent.block_ids
    assert all(pool.blocks[b].ref_count == 2 for b in parent.block_ids)
    assert (child.num_computed_tokens, child.num_cached_blocks, child.num_cached_tokens) == \
           (parent.num_computed_tokens, parent.num_cached_blocks, 8)
    assert child.block_hashes == parent.block_hashes
    assert child.status == RequestStatus.RUNNING and sched.running[-1] is child


def test_fork_of_a_preempted_parent_queues_the_child_to_be_computed():
    sched, pool = make_scheduler()
    parent = make_request("p", 6)
    sched.add_request(parent)
    run_step(sched)
    sched._preempt(sched.running.pop())
    child = make_request("c", 6)
    sched.fork(parent, child)
    assert child.status == RequestStatus.WAITING and list(sched.waiting) == [parent, child]
    assert child.block_ids == [] and pool.num_free_blocks == pool.num_blocks


def test_copy_on_write_with_no_free_block_preempts_instead_of_failing():
    """Writing into a shared last block needs one new block for the copy, like any allocation."""
    sched, pool = make_scheduler(num_blocks=2, block_size=4)
    parent = make_request("p", 2, max_tokens=4)
    sched.add_request(parent)
    run_step(sched)                                  # 3 tokens in block 0, 2 of them computed
    child = make_request("c", 2, max_tokens=4)
    child.output_token_ids = list(parent.output_token_ids)
    sched.fork(parent, child)                        # block 0 shared (ref 2)
    pool.allocate(1)                                 # someone else holds the last free block
    out = sched.schedule()                           # parent must copy block 0: no block for it
    assert out.preempted == [child]                  # the newest gives way, dropping its reference
    assert out.scheduled == [(parent, 1)] and out.blocks_to_copy == []


def test_token_ids_is_a_slice_of_prompt_plus_output():
    r = make_request("r", 3)
    r.output_token_ids = [1, 2, 3, 4]
    everything = r.prompt_token_ids + r.output_token_ids
    for start in range(len(everything) + 1):
        for end in range(start, len(everything) + 1):
            assert r.token_ids(start, end) == everything[start:end], (start, end)


# ---- speculative decoding: the drafts raise the target, the rejected ones roll back -----------------

def test_drafts_are_new_tokens_and_rejections_roll_back():
    sched, pool = make_scheduler(block_size=4)
    a = make_request("a", 6, max_tokens=20)
    sched.add_request(a)
    run_step(sched)                                  # prompt: 6 computed, 7 tokens, 2 blocks
    a.spec_token_ids = [1, 2, 3]                     # a proposer's guesses
    assert a.num_tokens_with_spec == 10
    out = sched.schedule()
    assert out.scheduled == [(a, 4)] and len(a.block_ids) == 3   # positions 6..9: a third block
    assert a.token_ids(6, 10) == [7, 1, 2, 3]
    sched.update(out, {a: [SampledToken(1), SampledToken(9)]})  # draft 1 kept, then the model's 9
    # 2 of the 3 drafts rejected: computed = 6 + 4 - 2 = 8 = num_tokens - 1; block 2 holds the 9: kept
    assert (a.num_tokens, a.num_computed_tokens, a.spec_token_ids, a.output_token_ids) == (9, 8, [], [7, 1, 9])
    assert len(a.block_ids) == 3 and pool.num_free_blocks == 97
    a.spec_token_ids = [4, 5, 6]
    out = sched.schedule()
    assert out.scheduled == [(a, 4)]
    sched.update(out, {a: [SampledToken(4), SampledToken(5), SampledToken(6), SampledToken(8)]})  # all + bonus
    assert (a.num_tokens, a.num_computed_tokens) == (13, 12)
    a.spec_token_ids = [1, 1]
    out = sched.schedule()
    sched.update(out, {a: [SampledToken(3)]})        # nothing kept
    assert (a.num_tokens, a.num_computed_tokens, len(a.block_ids)) == (14, 13, 4)   # the 5th block went back
    pool.check_invariants()
    assert pool.num_free_blocks == 96


def test_drafts_past_the_budget_are_dropped_and_preemption_clears_them():
    sched, pool = make_scheduler(block_size=4, budget=3)
    a = make_request("a", 2, max_tokens=20)
    sched.add_request(a)
    run_step(sched)
    a.spec_token_ids = [1, 2, 3, 4]
    out = sched.schedule()
    assert out.scheduled == [(a, 3)] and a.spec_token_ids == [1, 2]     # a budget of 3: two drafts fit
    sched.update(out, {a: [SampledToken(5)]})
    a.spec_token_ids = [6]
    sched._preempt(sched.running.pop())
    assert a.spec_token_ids == [] and a.num_computed_tokens == 0


def test_prefix_hashes_cover_accepted_tokens_only():
    sched, pool = make_scheduler(block_size=4, enable_caching=True)
    a = make_request("a", 3, max_tokens=20)
    sched.add_request(a)
    run_step(sched)                                  # 3 computed, 4 tokens
    a.spec_token_ids = [1, 2, 3, 4, 5]               # positions 3..8 computed this step
    out = sched.schedule()
    sched.update(out, {a: [SampledToken(9)]})        # every draft rejected
    assert a.num_computed_tokens == 4 and len(pool.cached_block_hash_to_block) == 1   # block 0 only
    assert a.block_hashes == pool.block_hashes(a)[:1] and a.token_ids(0, 5) == [10, 11, 12, 7, 9]
