"""The device side (docs/05): the model runner, which owns the weights and the KV cache tensor
and turns a SchedulerOutput into logits (tokens are chosen in nanopaged/sample/).

    model_runner.py   slot mapping, block tables, one forward pass, copy-on-write copies
    hybrid_runner.py  a hybrid model's runner: one memory of pages, seen as K/V or as state per layer
    vision_runner.py  a vision-language model's runner: the model class of its architecture, the rest as is
"""
