"""Parallel sampling (n > 1): the prompt is computed once, then the samples fork (paper section 4.4).

`SamplingParams(n=4)` makes four sequences (input_processor.py). Only sample 0 is queued;
samples 1..3 wait here. When sample 0's step reaches the end of its prompt, each of the four
draws its first token from that one logits row (with its own seed), and the three tokens
of the others carry `parent=sample 0`: the scheduler then forks them off it
(`nanopaged/core/scheduler.py: Scheduler.fork`), sharing every prompt block instead of
computing and storing the prompt four times. docs/06_sharing.md does the block arithmetic.

This is the engine's default token-selection rule (`LLMEngine.token_selection`); with no
pending samples it is just the sampler.
"""
from __future__ import annotations

from nanopaged.core.request import Request, SampledToken
from nanopaged.sample.sampler import Sampler
from nanopaged.worker.model_runner import ModelRunnerOutput


class ParallelSampler:
    def __init__(self, sampler: Sampler) -> None:
        self.sampler = sampler
        self.unforked: dict[Request, list[Request]] = {}   # sample 0 -> the samples to fork off it

    def add(self, samples: list[Request]) -> None:
        """Sample 0 is queued by the caller; it holds a seat in max_num_seqs for each sample."""
        first, *others = samples
        if others:
            self.unforked[first] = others
            first.num_seqs = len(samples)

    def __call__(self, runner_output: ModelRunnerOutput) -> dict[Request, list[SampledToken]]:
        rows, requests, parents = [], [], []
        for row, request in enumerate(runner_output.requests):
            others = self.unforked.pop(request, [])
            request.num_seqs = 1                      # the seats pass to the forked samples
            for seq in [request] + others:
                rows.append(row)
                requests.append(seq)
                parents.append(None if seq is request else request)
        if not requests:
            return {}
        logits = runner_output.logits
        if len(rows) > len(runner_output.requests):   # a forking row, repeated for each sample
            logits = logits[rows]                     # (a copy of every row: only when one forks)
        out = self.sampler(logits, requests)
        return {seq: [SampledToken(token, logprob, top, parent)] for seq, token, logprob, top, parent
                in zip(requests, out.token_ids, out.logprobs, out.top_logprobs, parents)}

    def forget(self, request: Request) -> None:
        """The request is finished or aborted: its generator, and samples never forked off it, go."""
        self.unforked.pop(request, None)
        self.sampler.forget(request)
