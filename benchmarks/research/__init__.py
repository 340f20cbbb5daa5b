"""Research tools: what one run of bench.py cannot say, measured on its own (docs/07_benchmarks.md).

    profile_step.py    one decode step under the torch profiler: its op count and where its time goes;
                       --without times it with each piece of the layer replaced by a pass-through
    skinny_matmul.py   one pass of the model's matmuls at a few row and thread counts, against a copy
                       of the same bytes (why a CPU decode step costs what it does)
    tensor_parallel.py per-rank weight and KV memory, the step message's bytes, tok/s at N = 1 and 2

bench.py imports none of these.
"""
