"""Shared prefixes read once: rows whose block tables begin with the same blocks attend in one job
(csrc/attention_jobs.h), which takes the shared blocks a span at a time for all of its rows.

Which rows go together (`shared_prefix_groups`): many requests on one system prompt, n > 1 samples
whose last blocks were copied on write, a prompt's own rows, and not rows that share too little. What
they compute: the same bits as the plain kernel (each row alone), on the VDPBF16PS path over every
query-heads grouping, over bfloat16 and 8-bit caches, at 1 to 3 threads, for decode rows, prompt
chunks after prefix-cache hits and odd lengths; and each row the same bits as alone in a step (batch
invariance). Engines end to end: tests/engine/test_cascade_attention.py.
"""
import pytest
import torch
from conftest import torch_threads

from nanopaged.attention.torch_backend import to_cache_dtype
from nanopaged.cpu.build import available, from_kernel_layout, to_kernel_layout

pytestmark = pytest.mark.skipif(available() is not None, reason=f"{available()}")

BLOCK, POOL = 16, 1000


def tables_on_prefixes(prefixes: list[int], own: list[int], seed: int = 0) -> torch.Tensor:
    """Request i's table: the blocks of shared prefix prefixes[i] (its id; -1: none), then own[i]
    blocks of its own; every block id drawn at random from the pool, so no two runs lie in order."""
    g = torch.Generator().manual_seed(seed)
    pool = iter(torch.randperm(POOL, generator=g).tolist())
    shared = {p: [next(pool) for _ in range(6)] for p in set(prefixes) if p >= 0}
    rows = [(shared[p] if p >= 0 else []) + [next(pool) for _ in range(k)] for p, k in zip(prefixes, own)]
    width = max(len(r) for r in rows)
    return torch.tensor([r + [0] * (width - len(r)) for r in rows])


def step(seq_lens: list[int], query_lens: list[int]):
    return torch.tensor(seq_lens), torch.tensor([0] + query_lens).cumsum(0)


def groups(ops, tables, seq_lens, query_lens, num_threads):
    lens, starts = step(seq_lens, query_lens)
    return [(sorted(rows), shared) for rows, shared in
            ops.shared_prefix_groups(tables, lens, starts, BLOCK, num_threads)]


# ---- which rows read their shared blocks together --------------------------------------------
def test_requests_on_one_system_prompt_form_one_group_per_thread(ops):
    """32 decode rows behind one 6-block prompt: two threads, two groups of 16 that share all 6."""
    tables = tables_on_prefixes([0] * 32, [2] * 32)
    lens = [6 * BLOCK + 1 + r for r in range(32)]
    got = groups(ops, tables, lens, [1] * 32, num_threads=2)
    assert sorted(len(rows) for rows, _ in got) == [16, 16]
    assert all(shared == 6 for _, shared in got)
    assert sorted(r for rows, _ in got for r in rows) == list(range(32))


def test_two_prompts_and_a_loner_make_two_groups_and_a_row_alone(ops):
    prefixes = [0, 1, 0, -1, 1, 0, 1, 0]          # interleaved in the step: the groups gather them
    tables = tables_on_prefixes(prefixes, [1, 1, 1, 2, 1, 1, 1, 1], seed=1)
    lens = [6 * BLOCK + 5] * 8
    lens[3] = BLOCK + 3                             # the loner: 2 blocks of its own
    got = groups(ops, tables, lens, [1] * 8, num_threads=1)
    assert sorted(got) == [([0, 2, 5, 7], 6), ([1, 4, 6], 6), ([3], 0)]


def test_samples_forked_from_one_prompt_share_all_but_their_copied_last_block(ops):
    """n = 4 samples: the prompt's 6 full blocks shared, each sample's partial last block its own
    (copy-on-write); 7 blocks each, 6 in common."""
    tables = tables_on_prefixes([0] * 4, [1] * 4, seed=2)
    got = groups(ops, tables, [6 * BLOCK + 9] * 4, [1] * 4, num_threads=1)
    assert got == [([0, 1, 2, 3], 6)]


def test_a_prompt_chunks_rows_share_their_requests_blocks(ops):
    """One request's 40 new rows after 60 cached tokens: its rows share every block the shortest of
    them reads; at most 16 rows to a group, at least as many groups as threads."""
    tables = tables_on_prefixes([-1], [7], seed=3)
    got = groups(ops, tables, [100], [40], num_threads=2)
    assert [len(rows) for rows, _ in got] == [16, 16, 8]
    assert [shared for _, shared in got] == [4, 5, 6]      # rows 0-15 see 61-76 keys: 4 blocks at least
    assert [r for rows, _ in got for r in rows] == list(range(40))


def test_rows_that_share_one_block_are_not_worth_a_group(ops):
    tables = torch.tensor([[5, 6, 7], [5, 8, 9], [5, 10, 11]])
    got = groups(ops, tables, [40, 40, 40], [1, 1, 1], num_threads=1)
    assert sorted(got) == [([0], 0), ([1], 0), ([2], 0)]


def test_with_sharing_off_every_row_is_its_own_job(ops):
    tables = tables_on_prefixes([0] * 8, [1] * 8)
    lens, starts = step([6 * BLOCK + 3] * 8, [1] * 8)
    q = torch.randn(8, 4, 64).bfloat16()
    k, v = torch.randn(2, POOL, BLOCK, 2, 64).bfloat16()       # noise: any order will do
    on = ops.paged_attention(q, k, v, tables, lens, starts, 0.125)              # share_prefixes=True by default
    off = ops.paged_attention(q, k, v, tables, lens, starts, 0.125, share_prefixes=False)
    assert torch.equal(on, off)


# ---- what they compute: the plain kernel's bits --------------------------------------------------
# (prefix ids, own blocks, seq_lens, query_lens): decode rows on two prompts and a loner, odd and even
# lengths; n = 8 samples; a prompt chunk after a prefix-cache hit beside decode rows on the same prompt.
STEPS = {
    "system prompts": ([0] * 12 + [1] * 6 + [-1], [3] * 19,
                       [6 * BLOCK + 1 + 2 * r for r in range(18)] + [37], [1] * 19),
    "n samples": ([0] * 8, [1] * 8, [6 * BLOCK + 7] * 8, [1] * 8),
    "chunk and decode": ([0] * 5, [4] * 5, [150, 6 * BLOCK + 2, 6 * BLOCK + 17, 6 * BLOCK + 30, 155],
                         [52, 1, 1, 1, 3]),
}


def case(name, cache_dtype, heads, kv_heads, dim, seed=0):
    prefixes, own, seq_lens, query_lens = STEPS[name]
    torch.manual_seed(seed)
    tables = tables_on_prefixes(prefixes, own, seed=seed)
    k, v = to_cache_dtype(2 * torch.randn(2, POOL, BLOCK, kv_heads, dim).bfloat16(), cache_dtype)
    q = torch.randn(sum(query_lens), heads + kv_heads, dim).bfloat16()[:, :heads]      # strided, as the model's
    return q, *to_kernel_layout(k, v), tables, *step(seq_lens, query_lens)


@pytest.mark.parametrize("name", sorted(STEPS))
@pytest.mark.parametrize("heads, kv_heads, dim", [(9, 3, 64), (12, 3, 64), (8, 4, 128), (10, 2, 128),
                                                  (4, 4, 256)])
@pytest.mark.parametrize("num_threads", [1, 2])
def test_rows_read_together_give_the_plain_kernels_bits(ops, name, heads, kv_heads, dim, num_threads):
    """3, 4, 2, 5 and 1 query heads per KV head (units of 3, 4, 2, 1 heads); whole rows per job and
    one KV head per job (a step of few rows)."""
    args = case(name, torch.bfloat16, heads, kv_heads, dim, seed=heads + dim)
    with torch_threads(num_threads):
        together = ops.shared_prefix_groups(*args[3:6], BLOCK, num_threads)
        assert any(len(rows) > 1 and shared >= 2 for rows, shared in together)
        shared = ops.paged_attention(*args, dim ** -0.5, share_prefixes=True)
        plain = ops.paged_attention(*args, dim ** -0.5, share_prefixes=False)
    assert torch.isfinite(shared).all()
    assert torch.equal(shared, plain)


@pytest.mark.parametrize("cache_dtype", [torch.float8_e4m3fn, torch.float8_e5m2, torch.int8])
@pytest.mark.parametrize("name", sorted(STEPS))
def test_rows_read_together_over_an_8_bit_cache_give_the_plain_kernels_bits(ops, cache_dtype, name):
    args = case(name, cache_dtype, 9, 3, 64, seed=7)
    with torch_threads(2):
        shared = ops.paged_attention(*args, 0.125, share_prefixes=True)
        plain = ops.paged_attention(*args, 0.125, share_prefixes=False)
    assert torch.isfinite(shared).all()
    assert torch.equal(shared, plain)


def test_a_row_read_with_others_on_its_prefix_gives_its_bits_alone(ops):
    """Batch invariance: each decode row of a step on two shared prompts, alone in a step of its own
    (no one to share with), gives the same bits."""
    q, k, v, tables, lens, starts = case("system prompts", torch.bfloat16, 9, 3, 64, seed=11)
    with torch_threads(2):
        together = ops.paged_attention(q, k, v, tables, lens, starts, 0.125)
        for r in range(q.shape[0]):
            alone = ops.paged_attention(q[r:r + 1], k, v, tables[r:r + 1], lens[r:r + 1], torch.tensor([0, 1]), 0.125)
            assert torch.equal(alone[0], together[r]), r


def test_rows_read_together_attend_as_float32_attention_does(ops):
    """Within bfloat16's rounding of float32 attention over the same keys, gathered by hand."""
    q, k, v, tables, lens, starts = case("chunk and decode", torch.bfloat16, 9, 3, 64, seed=5)
    got = ops.paged_attention(q, k, v, tables, lens, starts, 0.125).float()
    k, v = (x.view(-1, 3, 64) for x in from_kernel_layout(k, v))
    row = 0
    for i, (n, q_len) in enumerate(zip(lens.tolist(), (starts[1:] - starts[:-1]).tolist())):
        slots = torch.cat([tables[i, b] * BLOCK + torch.arange(BLOCK) for b in range(-(-n // BLOCK))])[:n]
        keys, values = k[slots].float().repeat_interleave(3, 1), v[slots].float().repeat_interleave(3, 1)
        for j in range(q_len):
            seen = n - q_len + j + 1
            w = (torch.einsum("hd,thd->ht", q[row].float(), keys[:seen]) * 0.125).softmax(-1)
            want = torch.einsum("ht,thd->hd", w, values[:seen])
            torch.testing.assert_close(got[row], want, atol=1e-2, rtol=1e-2)
            row += 1

