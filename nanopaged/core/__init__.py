"""The memory manager and the scheduler: plain Python, no torch (chapters 2, 3, 4 and 6 in docs/).

    block_pool.py   the KV cache in fixed-size blocks: the free deque, ref counts, the prefix cache
    request.py      one sequence: the two counters and its block table
    scheduler.py    one token budget per step, chunked prefill, preemption by recompute, fork
    state_pages.py  a hybrid model's state: pages beside the block table, kept at block boundaries
    encoder_cache.py  a prompt's images: which a step encodes, within its budget, and which stay cached
"""
