"""The pieces bench.py uses, one idea a module; bench.py reads them in this order.

    models.py          the model folder: --model, the demo model, random weights of a named shape (dense
                       or a mixture of experts); and the spec workload's draft model, cut from it
    trace.py           the trace every engine runs, its warm-up prompt, and Run (one timed generation)
    nanopaged_run.py   nanopaged stepped through the trace, with a look at KV memory every step
    memory.py          KV slots held: paged blocks vs the reservation allocators and HF's padded cache
    peers.py           the engines beside it: HF static batching, transformers' paged CB, vLLM, llama.cpp
                       and CTranslate2
    roofline.py        the matmul FLOP/s ceiling and the FLOPs the trace needs
    single_stream.py   one request at a time: decode tokens/s against HF generate
    decode_speed.py    the rule every engine's single-stream decode tokens/s is timed by
    noise.py           the timed runs again beside a busy process on one core (--noise)
    figures.py         ratios to the peers, where step time goes, the targets, published figures
    workloads.py       the other workloads: prefix caching on vs off, sharing inside a request
    serve.py           --workload serve: streaming clients at Poisson rates against nanopaged serve, its
                       in-process layout, vllm serve and transformers serve (vllm bench serve's figures)
    structured.py      --workload structured: what a JSON schema, a regex or a choice costs per token
    spec.py            --workload spec: speculative decoding where the answer repeats its prompt or earlier
                       answers, and on random tokens; the repeating workload and the targets
    spec_prompts.py    the spec workload's prompts: passages to repeat, or to fix typos in
    agent_prompts.py   the agent-like prompts: one tool call asked again with another city, date and unit
    spec_run.py        the spec runs: an engine per configuration and concurrency, each against off
    spec_agent.py      the agent-like requests one at a time on one engine: off, n-gram, suffix
    spec_json.py       the tool call under its JSON schema, with and without the drafts the grammar forces
    spec_vllm.py       vLLM's CPU engine on the spec prompts: off, its n-gram, its suffix decoding
    lora.py            --workload lora: 1, 4 and 16 adapters mixed in one batch against the base model
    moe.py             --workload moe: a mixture of experts at OLMoE's or Qwen3-30B-A3B's shape against its
                       active-weight floor and vLLM
    quality.py         perplexity of a fixed English text: quantized weights against float32 and llama.cpp
    vllm_peer.py, llamacpp_peer.py, ctranslate2_peer.py   the scripts vLLM, llama.cpp and CTranslate2 run in
                       their own environments (peers.py starts them); besides their engine they import
                       only the standard library, decode_speed.py and trace.py
    machine.py         the machine and the library versions a result was measured with
    hooks.py           every use of the engine's extension hooks (a step observer, the proposers timed)
    report.py          every table printed (every workload's) and the plot drawn
    tokenizer.py       a tiny tokenizer trained in-process, for the random-weight models (and the tests' tiny ones)

research/ holds the tools bench.py does not use: the step profile, the skinny-matmul probe and
the tensor-parallel figures (tests/benchmarks/test_bench.py checks that bench.py uses every module here).
"""
