"""The block pool's rules, each test named after the rule it proves."""
import random

import pytest

from nanopaged.core.block_pool import BlockPool, cdiv


def test_allocate_takes_from_the_head_and_sets_ref_count_one():
    pool = BlockPool(num_blocks=4, block_size=16)
    assert pool.allocate(2) == [0, 1]
    assert [b.ref_count for b in pool.blocks] == [1, 1, 0, 0]
    assert pool.num_free_blocks == 2


def test_free_appends_to_the_tail_in_reverse_order():
    pool = BlockPool(num_blocks=4, block_size=16)
    ids = pool.allocate(3)                       # [0, 1, 2]; queue [3]
    pool.free(ids)
    # the request's tail block (2) is queued first, so it is evicted first
    assert list(pool.free_block_queue) == [3, 2, 1, 0]


def test_block_is_free_only_when_its_ref_count_reaches_zero():
    pool = BlockPool(num_blocks=2, block_size=16)
    [b] = pool.allocate(1)
    pool.blocks[b].ref_count += 1                # a second block table holds it
    pool.free([b])
    assert b not in pool.free_block_queue
    pool.free([b])
    assert b in pool.free_block_queue


def test_new_block_only_when_the_last_one_is_full():
    pool = BlockPool(num_blocks=8, block_size=16)
    assert pool.blocks_needed(0, 1) == 1
    assert pool.blocks_needed(1, 16) == 0        # 16 tokens fill exactly one block
    assert pool.blocks_needed(1, 17) == 1
    assert pool.blocks_needed(2, 17) == 0


@pytest.mark.parametrize("block_size", [1, 8, 16, 32])
def test_waste_is_below_one_block_per_request(block_size):
    """Grow many requests token by token; each holds < 1 block of empty slots."""
    rng = random.Random(block_size)
    pool = BlockPool(num_blocks=10_000, block_size=block_size)
    tables = {}
    lengths = {}
    for r in range(50):
        tables[r], lengths[r] = [], 0
    for _ in range(3000):
        r = rng.randrange(50)
        lengths[r] += 1
        tables[r] += pool.allocate(pool.blocks_needed(len(tables[r]), lengths[r]))
        for rid in tables:
            slots = len(tables[rid]) * block_size
            assert 0 <= slots - lengths[rid] < block_size
            assert len(tables[rid]) == cdiv(lengths[rid], block_size)


def test_usage_is_one_minus_free_over_total():
    pool = BlockPool(num_blocks=10, block_size=16)
    pool.allocate(4)
    assert pool.usage() == pytest.approx(0.4)


def test_allocating_more_than_free_is_an_error():
    pool = BlockPool(num_blocks=2, block_size=16)
    with pytest.raises(RuntimeError, match=r"asked for 3 blocks, only 2 free"):
        pool.allocate(3)
    assert pool.num_free_blocks == 2


def test_bad_pool_size_is_a_value_error():
    with pytest.raises(ValueError, match="num_blocks"):
        BlockPool(num_blocks=0, block_size=16)


def test_freeing_a_free_block_is_caught():
    pool = BlockPool(num_blocks=2, block_size=16)
    [b] = pool.allocate(1)
    pool.free([b])
    with pytest.raises(AssertionError, match=f"freeing block {b} that is already free"):
        pool.free([b])


@pytest.mark.parametrize("corrupt, message", [
    (lambda pool: pool.free_block_queue.append(3), "a block is in the free queue twice"),
    (lambda pool: pool.free_block_queue.remove(3), "block 3 is neither free nor held"),
    (lambda pool: setattr(pool.blocks[3], "ref_count", 1), "free block 3 has ref_count 1"),
    (lambda pool: pool.cached_block_hash_to_block.update({b"h": []}), "a hash with no block left is still in the map"),
    (lambda pool: pool.cached_block_hash_to_block.update({b"h": [0]}), "hash map points at block 0, which holds another prefix"),
])
def test_check_invariants_names_each_kind_of_broken_book(corrupt, message):
    """The randomized scheduler test relies on these checks: each must fire on its corruption."""
    pool = BlockPool(num_blocks=4, block_size=16, enable_caching=True)
    pool.allocate(2)
    pool.check_invariants()
    corrupt(pool)
    with pytest.raises(AssertionError, match=f"^{message}$"):     # the whole message, exactly
        pool.check_invariants()
