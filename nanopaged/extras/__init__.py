"""Extensions that can be left out: features beside the engine, each reaching it through one hook.

    beam_search.py       a token-selection rule for LLMEngine.step, forking beams (Scheduler.fork)
    tensor_parallel/     LLM(model, tensor_parallel_size=N): N ranks behind the runner (`make_runner`)

nanopaged/llm.py wires them into `LLM`; nothing under core/, engine/ or worker/ imports them.
"""
