"""The engine: requests in, one step at a time, RequestOutputs out (docs/00, 04).

    llm_engine.py         LLMEngine.step: schedule -> execute -> select tokens -> update -> outputs
    input_processor.py    a prompt and SamplingParams -> validated Requests
    parallel_sampling.py  n > 1: the samples that fork off one prompt (the default token-selection rule)
    output_processor.py   tokens -> text, logprobs, RequestOutputs; `check_stop`, the one stop rule
    detokenizer.py        incremental detokenization and stop strings
"""
