"""The sampler: the next token of every sampling row, vectorised over the batch.

In order, as vLLM's sampler (v1/sample/sampler.py) does:
  0. an extension's logits processors (structured outputs mask the tokens a grammar forbids),
     as vLLM applies its grammar bitmask before its sampler (logits_processors.py);
  1. logprobs of the raw logits, after step 0 as in vLLM (what `cumulative_logprob` and
     `logprobs=k` report), for the rows that asked for them;
  2-4. SamplingParams' own rules (logits_processors.py): allowed_token_ids, bad_words,
     logit_bias; the penalties; min_tokens;
  5. greedy rows take the argmax; the others divide by temperature, cut by top-k, top-p and
     min-p, and draw with the exponential race argmax(p / q), q ~ Exp(1), which samples
     from p exactly and lets each row use its own generator.
Tensor work is done for all rows at once; Python loops only run over requests to collect
their token ids or generators, never over the vocabulary.

A request with its own `seed` draws from its own torch.Generator, so its tokens do not
depend on which other requests share the batch or on preemption (the generator lives
here, keyed by the request, and is not touched by recomputation).

The engine calls it through a token-selection rule: `parallel_sampling.py: ParallelSampler`
(n > 1 samples fork off a request, docs/06_sharing.md), or with drafts
`rejection_sampler.py: RejectionSampler`.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from nanopaged.core.request import Request
from nanopaged.sample.logits_processors import LogitsProcessor, apply_sampling_rules, indices


@dataclass
class SamplerOutput:
    token_ids: list[int]
    logprobs: list[float]                  # of the chosen token, raw model distribution (0.0 unless asked)
    top_logprobs: list[list[tuple[int, float, int]] | None]  # per row: (token, logprob, rank)


def torch_argmax(x: torch.Tensor) -> torch.Tensor:
    return x.argmax(dim=-1)


class Sampler:
    def __init__(self, device: torch.device, seed: int, argmax=None) -> None:
        self.device = device
        # each row's largest index, as torch.argmax(x, dim=-1); a fast path may name a kernel of its
        # own (cpu/choose.py: FastPath.argmax)
        self.argmax = argmax or torch_argmax
        self.generator = torch.Generator(device=device).manual_seed(seed)
        self.request_generators: dict[Request, torch.Generator] = {}
        # step 0: the extensions' processors (Extension.process_logits), handed over by the engine in its order
        self.logits_processors: list[LogitsProcessor] = []

    @torch.inference_mode()
    def __call__(self, logits: torch.Tensor, requests: list[Request]) -> SamplerOutput:
        raw, logits = self.process_logits(logits, requests)
        params = [r.sampling_params for r in requests]
        tokens = self.argmax(logits)
        random_rows = [i for i, p in enumerate(params) if not p.greedy]
        if random_rows:
            idx = indices(logits, random_rows)
            tokens[idx] = self._sample(logits[idx], [requests[i] for i in random_rows])
        return SamplerOutput(tokens.tolist(), *self.logprobs_of(raw, tokens, params))

    def process_logits(self, logits: torch.Tensor, requests: list[Request]) -> tuple[torch.Tensor, torch.Tensor]:
        """Steps 0-4: (the raw logits the logprobs are taken from, the logits to choose from)."""
        logits = logits.float()
        for process in self.logits_processors:
            logits = process(logits, requests)
        return logits, apply_sampling_rules(logits, requests)

    def logprobs_of(self, raw: torch.Tensor, tokens: torch.Tensor, params) -> tuple[list, list]:
        """The chosen tokens' logprobs and the top-k, in the raw distribution, for the rows that
        asked (logprobs=k); the others get 0.0 and None, since vLLM reports cumulative_logprob
        only with logprobs. A log_softmax over the vocabulary of every row costs a decode step
        about as much as its sampling."""
        chosen, tops = [0.0] * len(params), [None] * len(params)
        want = [i for i, p in enumerate(params) if p.logprobs is not None]
        if want:
            idx = indices(raw, want)
            logprobs = torch.log_softmax(raw[idx], dim=-1)
            values = logprobs.gather(1, tokens[idx][:, None])[:, 0].tolist()
            rows = top_logprobs(logprobs, tokens[idx], [params[i].logprobs for i in want])
            for i, value, top in zip(want, values, rows):
                chosen[i], tops[i] = value, top
        return chosen, tops

    def _sample(self, logits: torch.Tensor, requests: list[Request]) -> torch.Tensor:
        return self.draw(self.probs(logits, requests), requests)

    def probs(self, logits: torch.Tensor, requests: list[Request]) -> torch.Tensor:
        """Step 5 for the sampled rows: the distribution they draw from (temperature, top-k, top-p, min-p)."""
        params = [r.sampling_params for r in requests]
        temps = logits.new_tensor([p.temperature for p in params])
        probs = torch.softmax(logits / temps[:, None], dim=-1)
        return top_k_top_p_min_p(probs, [p.top_k for p in params], [p.top_p for p in params],
                                 [p.min_p for p in params])

    def draw(self, probs: torch.Tensor, requests: list[Request]) -> torch.Tensor:
        """One token per row from `probs`, each with its request's generator (the exponential trick:
        argmax p / E with E ~ Exp(1) draws from p)."""
        q = torch.empty_like(probs)
        for j, r in enumerate(requests):
            q[j].exponential_(generator=self.generator_of(r))
        return self.argmax(probs / q)

    def generator_of(self, request: Request) -> torch.Generator:
        seed = request.sampling_params.seed
        if seed is None:
            return self.generator
        g = self.request_generators.get(request)
        if g is None:
            g = torch.Generator(device=self.device).manual_seed(seed)
            self.request_generators[request] = g
        return g

    def forget(self, request: Request) -> None:
        """The request is finished: drop its generator (an extension forgets its own: Extension.forget)."""
        self.request_generators.pop(request, None)


def top_k_top_p_min_p(probs: torch.Tensor, top_k: list[int], top_p: list[float],
                      min_p: list[float]) -> torch.Tensor:
    """Zero the tokens each row's top-k / top-p / min-p rule removes (all rows at once). Rows without a
    rule are left as they are, sorted or not, so no row's values depend on its neighbours' rules."""
    if all(k <= 0 for k in top_k) and all(p >= 1.0 for p in top_p) and all(m <= 0.0 for m in min_p):
        return probs          # no rule: the sort over the vocabulary would cost more than the model's head
    sorted_p, order = probs.sort(dim=-1, descending=True)
    rank = torch.arange(probs.shape[1], device=probs.device)[None, :]
    k = probs.new_tensor([kk if kk > 0 else probs.shape[1] for kk in top_k])[:, None]
    drop = rank >= k
    # top-p: drop a token when the mass before it already reaches top_p (the top one stays)
    mass_before = sorted_p.cumsum(dim=-1) - sorted_p
    drop |= mass_before >= probs.new_tensor(top_p)[:, None]
    drop |= sorted_p < probs.new_tensor(min_p)[:, None] * sorted_p[:, :1]
    drop[:, 0] = False
    sorted_p = sorted_p.masked_fill(drop, 0.0)
    return torch.zeros_like(probs).scatter_(1, order, sorted_p)


def top_logprobs(logprobs: torch.Tensor, tokens: torch.Tensor, want: list[int | None]) -> list:
    """For each row that wants k (not None): the chosen token's (token, logprob, rank), then the
    k best that are not it; rank 1 = the most likely token. Sampled and prompt logprobs alike."""
    if all(w is None for w in want):
        return [None] * len(want)
    k = max(w or 0 for w in want)
    top_val, top_idx = logprobs.topk(max(k, 1), dim=-1)
    chosen = logprobs.gather(1, tokens[:, None])
    chosen_rank = (logprobs > chosen).sum(dim=-1) + 1       # 1 = the most likely token
    top_val, top_idx, chosen, chosen_rank, toks = (
        t.tolist() for t in (top_val, top_idx, chosen, chosen_rank, tokens))
    result = []
    for i, w in enumerate(want):
        if w is None:
            result.append(None)
            continue
        entries = [(toks[i], chosen[i][0], chosen_rank[i])]
        entries += [(t, v, r + 1) for r, (t, v) in enumerate(zip(top_idx[i][:w], top_val[i][:w]))
                    if t != entries[0][0]]
        result.append(entries)
    return result
