"""The CPU fast path, in one annex beside the readable reference (docs/05, docs/00 "The fast path
beside the reference"). The reference path reads three of its files (the flags, the choice, the
thread governor); `choose.py` decides what else of it runs, once, for the runner.

    features.py          the CPU's flags: whether its matrix units multiply bfloat16 (dtype="auto")
    choose.py            the settings and the flags -> FastPath: which kernels replace which reference
    build.py             the C++ in csrc/ compiled on first use, for this CPU (cpu_ops: what it binds)
    csrc/                the kernels, one file per concern (csrc/ops.h lists them)
    linear.py            bfloat16 linears on weights packed once: oneDNN's (packed), nanopaged's (dpbf16, amx)
    quantized_linear.py  4- and 8-bit linears (quantization=), W8A8 among them
    rotation.py          W8A8's rotation of the hidden states, folded into the weights at load
    fused.py             the decoder layer loop in C++, over the model's own weights
    moe.py               a mixture of experts: the step's tokens grouped by expert, each expert run once
    attention.py         the `cpu` attention backend: every row of a step through the block tables
    recurrent.py         a hybrid's decode token in C++: the gated delta rule and Mamba-2, in place on the pages
    thread_governor.py   torch's threads follow the cores other processes leave free (cpu_threads="auto")
"""
