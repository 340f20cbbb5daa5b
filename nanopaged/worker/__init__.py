"""The device side (docs/05): the model runner, which owns the weights and the KV cache tensor
and turns a SchedulerOutput into logits, and the sampler, which turns logits into tokens.

    model_runner.py   slot mapping, block tables, one forward pass, copy-on-write copies
    sampler.py        penalties, temperature, top-k/top-p/min-p, seeds, logprobs, vectorised
    cpu_linear.py     CPU: bfloat16 weights packed once for oneDNN's matrix-unit kernel
    cpu_fused.py      CPU: a decoder layer's small ops in C++ kernels (nanopaged/kernels/)
    quant_linear.py   CPU: 4- and 8-bit weight-only linears (quantization=)
"""
