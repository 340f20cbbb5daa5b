"""The device side (docs/05): the model runner, which owns the weights and the KV cache tensor
and turns a SchedulerOutput into logits, and the sampler, which turns logits into tokens.

    model_runner.py   slot mapping, block tables, one forward pass, copy-on-write copies
    sampler.py        penalties, temperature, top-k/top-p/min-p, seeds, logprobs, vectorised
"""
