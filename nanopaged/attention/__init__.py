"""Attention over the paged KV cache (docs/05): the step's metadata and the backends.

    metadata.py        AttentionMetadata: slot mapping, block tables, lengths
    backends.py        the table of backends (the `cpu` one is nanopaged/cpu/attention.py), loading one
    torch_backend.py   the reference: store by slot mapping, gather blocks, SDPA (any device)
    triton_kernels.py  Triton store / gather / paged-attention kernels
    triton_backend.py  the `triton` backend (CUDA; CPU under TRITON_INTERPRET=1 in tests)
    flash_backend.py   the `flash` backend on flash-attn (CUDA)
    cuda_graphs.py     decode steps replayed from CUDA graphs (the Triton backend's wrap_model)
"""
