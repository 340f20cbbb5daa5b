"""Extensions that can be left out: features beside the engine, each reaching it through one hook.

    beam_search.py       a token-selection rule for LLMEngine.step, forking beams (Scheduler.fork)
    tensor_parallel/     LLM(model, tensor_parallel_size=N): N ranks behind the runner (`make_runner`)
    pipeline_parallel/   LLM(model, pipeline_parallel_size=N): the layers in N stages, micro-batches in flight
    ray_data/            Ray Data: one dataset through many engine replicas (`build_processor`)

nanopaged/llm.py wires the first three into `LLM`; Ray Data's replicas hold engines of their own.
Nothing under core/, engine/ or worker/ imports them.
"""
