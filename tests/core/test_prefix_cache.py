"""Prefix caching: chained block hashes, block-by-block lookup, LRU reuse through the free queue."""
import random

import pytest

from conftest import make_prompts
from nanopaged import LLM, SamplingParams
from nanopaged.core.block_pool import HASH_FUNCTIONS, ROOT_HASH, BlockPool, hash_block
from nanopaged.core.request import Request
from nanopaged.core.scheduler import Scheduler
from test_scheduler import update_and_stop

GREEDY = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)


# ---- the hash chain -------------------------------------------------------------------
def hashes_of(tokens, block_size=4, algo="sha256", salt=None):
    pool = BlockPool(1, block_size, enable_caching=True, prefix_hash=algo)
    return pool.block_hashes(Request("r", list(tokens), SamplingParams(), 1, cache_salt=salt))


def test_same_block_tokens_after_different_prefixes_hash_differently():
    a = hashes_of([1, 2, 3, 4, 9, 9, 9, 9])
    b = hashes_of([5, 6, 7, 8, 9, 9, 9, 9])
    assert a[1] != b[1]                       # block 1 holds the same tokens in both


def test_only_full_blocks_are_hashed():
    assert len(hashes_of(list(range(11)))) == 2


def test_hash_is_a_stable_byte_encoding_not_python_hash():
    h = hash_block(HASH_FUNCTIONS["sha256"], ROOT_HASH, [1, 2, 3])
    assert h == hash_block(HASH_FUNCTIONS["sha256"], ROOT_HASH, [1, 2, 3])
    assert len(h) == 32
    import hashlib, struct
    assert h == hashlib.sha256(ROOT_HASH + struct.pack("<I3q", 3, 1, 2, 3)).digest()


@pytest.mark.parametrize("algo", ["sha256", "xxhash"])
def test_salt_changes_every_block_hash(algo):
    plain, salted = hashes_of(list(range(12)), algo=algo), hashes_of(list(range(12)), algo=algo, salt="t1")
    assert all(p != s for p, s in zip(plain, salted))
    assert hashes_of(list(range(12)), algo=algo, salt="t1") == salted


# ---- the pool: LRU eviction through the free queue -------------------------------------
def test_freed_cached_blocks_are_reused_least_recently_used_first():
    pool = BlockPool(num_blocks=6, block_size=4, enable_caching=True)
    a = pool.allocate(2); b = pool.allocate(2)
    for i, blk in enumerate(a + b):
        pool.cache_block(blk, bytes([i]))
    pool.free(a)                   # a freed first: least recently used
    pool.free(b)
    # queue: [4, 5] never used, then a's blocks (tail first), then b's
    assert list(pool.free_block_queue) == [4, 5, a[1], a[0], b[1], b[0]]
    got = pool.allocate(3)
    assert got == [4, 5, a[1]]
    assert pool.blocks[a[1]].block_hash is None               # evicted: its hash is dropped
    assert bytes([1]) not in pool.cached_block_hash_to_block
    assert pool.cached_block_hash_to_block[bytes([0])] == [a[0]]  # the rest still cached
    assert pool.num_evicted_blocks == 1
    pool.allocate(2)                                           # evicts a[0] and b[1]: the count adds up
    assert pool.num_evicted_blocks == 3
    pool.check_invariants()


def test_a_block_in_use_is_never_evicted():
    pool = BlockPool(num_blocks=3, block_size=4, enable_caching=True)
    held = pool.allocate(1)
    pool.cache_block(held[0], b"h")
    pool.allocate(2)
    with pytest.raises(RuntimeError, match=r"asked for 1 blocks, only 0 free"):
        pool.allocate(1)
    assert pool.cached_block_hash_to_block[b"h"] == [held[0]]


def test_a_hit_takes_a_free_cached_block_out_of_the_queue():
    pool = BlockPool(num_blocks=4, block_size=4, enable_caching=True)
    [blk] = pool.allocate(1)
    pool.cache_block(blk, b"h")
    pool.free([blk])
    hits = pool.find_cached_blocks([b"h"])
    pool.touch(hits)
    assert hits == [blk] and blk not in pool.free_block_queue and pool.blocks[blk].ref_count == 1
    pool.check_invariants()


def test_lookup_stops_at_the_first_miss():
    pool = BlockPool(num_blocks=4, block_size=4, enable_caching=True)
    a, b, c = pool.allocate(3)
    pool.cache_block(a, b"h0")
    pool.cache_block(c, b"h2")
    assert pool.find_cached_blocks([b"h0", b"h1", b"h2"]) == [a]     # h2 is cached, but after a miss


# ---- the scheduler: lookup on admission ---------------------------------------------
def scheduler(num_blocks=32, block_size=4):
    pool = BlockPool(num_blocks, block_size, enable_caching=True)
    return Scheduler(pool, max_num_seqs=8, max_num_batched_tokens=256), pool


def request(rid, prompt, max_tokens=2):
    return Request(request_id=rid, prompt_token_ids=list(prompt), max_tokens=max_tokens,
                   sampling_params=SamplingParams(max_tokens=max_tokens, ignore_eos=True))


def step(sched):
    """One step with a fake model that samples token 7; the (request, num_cached) admitted."""
    out = sched.schedule()
    update_and_stop(sched, out, {r: 7 for r, n in out.scheduled if r.num_computed_tokens + n == r.num_tokens})
    return out


def run_to_end(sched):
    while sched.has_unfinished_requests():
        step(sched)


def test_prefill_starts_after_the_hit():
    sched, _ = scheduler()
    sched.add_request(request("a", range(10, 22)))            # 12 tokens = 3 blocks of 4
    run_to_end(sched)
    b = request("b", range(10, 22))
    sched.add_request(b)
    out = sched.schedule()
    # 3 full blocks cached, but at most 11 tokens may hit: 2 blocks, 8 tokens; 4 left to compute
    assert out.scheduled == [(b, 4)] and b.num_computed_tokens == 8 and b.num_cached_tokens == 8


def test_preempted_request_hits_its_own_blocks_when_readmitted():
    sched, pool = scheduler(num_blocks=6, block_size=4)
    # each fits the pool alone (8 + 8 - 1 tokens = 4 blocks of 6), both together do not
    a = request("a", range(10, 18), max_tokens=8)
    b = request("b", range(30, 38), max_tokens=8)
    sched.add_request(a); sched.add_request(b)
    preempted = []
    while b.num_preemptions == 0:
        preempted += step(sched).preempted
    assert preempted == [b]
    readmitted = []
    while sched.has_unfinished_requests():
        readmitted += [num_cached for r, num_cached in step(sched).admitted if r is b]
    assert readmitted and readmitted[0] > 0             # b found (some of) its own blocks again


# ---- end to end: exact num_cached_tokens ---------------------------------------------
@pytest.fixture(scope="module")
def llm(tiny_model_dirs):
    return LLM(tiny_model_dirs["llama"], dtype="float32", num_kv_blocks=64)


def cached(llm, prompt_ids, salt=None):
    prompt = {"prompt_token_ids": prompt_ids}
    if salt is not None:
        prompt["cache_salt"] = salt
    return llm.generate(prompt, GREEDY, use_tqdm=False)[0].num_cached_tokens


def fresh_prompt(n, seed):
    return [random.Random(seed).randrange(3, 512) for _ in range(n)]


def test_same_prompt_twice(llm):
    p = fresh_prompt(40, 1)
    assert cached(llm, p) == 0
    assert cached(llm, p) == 32          # 2 full blocks of 16; the 3rd is partly filled


def test_prompt_of_exactly_whole_blocks_still_computes_its_last_token(llm):
    p = fresh_prompt(48, 2)
    assert cached(llm, p) == 0
    assert cached(llm, p) == 32          # not 48: the last prompt token is always computed


def test_prompt_extending_a_cached_one(llm):
    p = fresh_prompt(40, 3)
    cached(llm, p)
    assert cached(llm, p + fresh_prompt(30, 4)) == 32


def test_prompts_differing_in_their_first_token_share_nothing(llm):
    p = fresh_prompt(40, 5)
    cached(llm, p)
    assert cached(llm, [p[0] + 1] + p[1:]) == 0


def test_different_cache_salt_shares_nothing(llm):
    p = fresh_prompt(40, 6)
    assert cached(llm, p, salt="tenant-a") == 0
    assert cached(llm, p, salt="tenant-b") == 0
    assert cached(llm, p, salt="tenant-a") == 32


def test_stats_count_queries_and_hits_in_tokens(tiny_model_dirs):
    llm = LLM(tiny_model_dirs["llama"], dtype="float32", num_kv_blocks=64)
    p = fresh_prompt(40, 7)
    cached(llm, p); cached(llm, p)
    stats = llm.get_stats()
    assert stats["prefix_cache_queries"] == 80 and stats["prefix_cache_hits"] == 32


def test_caching_off_means_no_hits(tiny_model_dirs):
    llm = LLM(tiny_model_dirs["llama"], dtype="float32", num_kv_blocks=64, enable_prefix_caching=False)
    p = fresh_prompt(40, 8)
    assert cached(llm, p) == 0 and cached(llm, p) == 0
    assert llm.get_stats()["prefix_cache_queries"] == 0


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_outputs_equal_with_caching_on_and_off_under_eviction_and_preemption(tiny_model_dirs, arch):
    """Shared-prefix workload; a pool so small that cached blocks are evicted and requests preempted."""
    system = fresh_prompt(37, 9)
    questions = make_prompts(512, n=12, seed=10, min_len=3, max_len=30)
    prompts = [{"prompt_token_ids": system + q} for q in questions]
    params = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)
    results = {}
    for on in (True, False):
        llm = LLM(tiny_model_dirs[arch], dtype="float32", block_size=8, num_kv_blocks=30, max_num_seqs=6,
                  enable_prefix_caching=on)
        first = llm.generate(prompts[:6], params, use_tqdm=False)
        second = llm.generate(prompts, params, use_tqdm=False)   # repeats hit what survived
        results[on] = [o.outputs[0].token_ids for o in first + second]
        stats = llm.get_stats()
        assert stats["num_preemptions"] > 0
        if on:
            assert stats["prefix_cache_hits"] > 0 and stats["num_evicted_blocks"] > 0
            assert any(o.num_cached_tokens > 0 for o in second)
    assert results[True] == results[False]


def test_requests_arriving_together_wait_for_the_shared_prefix_instead_of_recomputing_it(tiny_model_dirs):
    """8 requests with one 64-token system prompt, all queued at once, a budget that fits them all:
    the first computes the prefix; the others wait a step and hit it."""
    system = fresh_prompt(64, 11)
    questions = make_prompts(512, n=8, seed=12, min_len=5, max_len=20)
    llm = LLM(tiny_model_dirs["llama"], dtype="float32", num_kv_blocks=100, max_num_batched_tokens=2048)
    outs = llm.generate([{"prompt_token_ids": system + q} for q in questions], GREEDY, use_tqdm=False)
    assert [o.num_cached_tokens for o in outs] == [0] + [64] * 7
    stats = llm.get_stats()
    assert stats["num_prompt_tokens_computed"] == 64 + sum(len(q) for q in questions)
    off = LLM(tiny_model_dirs["llama"], dtype="float32", num_kv_blocks=100, enable_prefix_caching=False)
    assert [o.outputs[0].token_ids for o in outs] == [
        o.outputs[0].token_ids for o in off.generate([{"prompt_token_ids": system + q} for q in questions],
                                                     GREEDY, use_tqdm=False)]
