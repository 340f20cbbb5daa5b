"""Token selection (docs/04, 06, 11): from a step's logits to each request's next tokens, in one
place, as vLLM keeps it in v1/sample/.

    sampler.py            the rules of SamplingParams and the draw, vectorised over the rows
    logits_processors.py  what changes the logits first: an extension's processors, SamplingParams' rules
    parallel_sampling.py  n > 1: the samples that fork off one prompt (the default token-selection rule)
    rejection_sampler.py  speculative decoding: which drafts to keep, and the token after them
"""
