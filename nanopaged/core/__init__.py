"""The core: what a student reads to understand PagedAttention end to end, in this order.

    block_pool.py     the KV cache in fixed-size blocks, ref counts, the prefix cache (chapters 2, 3)
    request.py        one sequence: the two counters and its block table (chapter 4)
    scheduler.py      one token budget per step, chunked prefill, preemption, fork (chapters 4, 6)
    attention.py      AttentionMetadata and the torch reference backend (chapter 5)
    model_runner.py   the KV cache tensor, slot mapping, block tables, one forward (chapter 5)
    engine.py         LLMEngine.step: schedule -> execute -> update -> outputs (chapter 0)
    llm.py            LLM.generate: validate, queue, step until done (chapter 0)

Together at most 1,200 lines (tests/test_reading_path.py counts them). Everything else is
either a part the core uses (nanopaged/*.py, nanopaged/models/) or an extension that
reaches the core through its hooks (nanopaged/extras/); the core never imports an extension.
"""
