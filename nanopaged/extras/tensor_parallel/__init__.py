"""Tensor parallelism: one scheduler, N ranks, one block table (the paper's section 4.6).

    parallel_state.py   the ranks, their two process groups, the rendezvous (torch.distributed)
    layers.py           column-, row- and vocab-parallel layers swapped into a built model
    shard_loader.py     each rank reads only its slices of the safetensors files
    step_message.py     the inputs the driver broadcasts every step, as one int64 tensor
    rank_runner.py      what every rank runs: 1/N of the model, the KV cache of its KV heads
    worker.py           a worker process's loop
    runner.py           the driver's runner (rank 0): starts the workers, sends each step

`LLM(model, tensor_parallel_size=N)` uses it (nanopaged/llm.py: `LLM.make_runner`).
docs/09_tensor_parallel.md explains it.
"""
from nanopaged.extras.tensor_parallel.runner import TensorParallelError, TensorParallelRunner

__all__ = ["TensorParallelError", "TensorParallelRunner"]
