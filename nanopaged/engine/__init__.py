"""The engine: requests in, one step at a time, RequestOutputs out (docs/00, 04).

    llm_engine.py         LLMEngine.step: schedule -> execute -> select tokens -> update -> outputs
    overlap.py            async scheduling: the step pipelined, step N+1 scheduled while N computes on a model thread
    batch_queue.py        batches in flight: micro-batches of other requests while earlier ones compute (pipeline ranks)
    extension.py          Extension: the one way a feature attaches to the engine (docs/00_how_to_extend.md)
    input_processor.py    a prompt and SamplingParams -> validated Requests
    output_processor.py   tokens -> text, logprobs, RequestOutputs; `check_stop`, the one stop rule
    detokenizer.py        incremental detokenization and stop strings
    stats.py              an extension that observes: get_stats() and the progress bar's live figures
    chat_tools.py         a conversation's tools as chat templates read them, checked
"""
