"""Pipeline parallelism: the decoder layers in P stages of consecutive layers, one rank each, micro-batches
in flight; one scheduler, one block table (vLLM's pipeline_parallel_size).

    stages.py         which layers each stage holds; a stage's model cut from the plain one; its checkpoint names
    stage_group.py    a rank's stage, its groups, and the point-to-point sends between stages
    stage_runner.py   what every rank runs: its stage's layers, the KV cache of those layers; a worker's loop
    runner.py         the driver's runner (global rank 0 = stage 0): submit and collect batches
    extension.py      its refusals (checked before any process starts) and get_stats()["pipeline_parallel"]

Start, failure and shutdown are tensor parallelism's (extras/tensor_parallel/), and T > 1 splits each
stage across T ranks with its layers. `LLM(model, pipeline_parallel_size=P)` uses it (nanopaged/llm.py:
`LLM.make_runner`); the engine keeps P batches in flight (engine/batch_queue.py).
docs/09_tensor_parallel.md, "Pipeline parallelism".
"""
