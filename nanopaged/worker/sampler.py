"""The sampler: the next token of every sampling row, vectorised over the batch.

In order, as vLLM's sampler (v1/sample/sampler.py) does:
  0. the logits processors, a hook for extensions (structured outputs mask the tokens a grammar
     forbids: nanopaged/structured_output/), as vLLM applies its grammar bitmask before its sampler;
  1. logprobs of the raw logits, after step 0 as in vLLM (what `cumulative_logprob` and
     `logprobs=k` report), for the rows that asked for them;
  2. the token rules: allowed_token_ids, bad_words, logit_bias;
  3. penalties: repetition (prompt + output tokens), presence and frequency (output tokens);
  4. min_tokens: EOS and stop tokens cannot be drawn before the request has min_tokens;
  5. greedy rows take the argmax; the others divide by temperature, cut by top-k, top-p and
     min-p, and draw with the exponential race argmax(p / q), q ~ Exp(1), which samples
     from p exactly and lets each row use its own generator.
Tensor work is done for all rows at once; Python loops only run over requests to collect
their token ids or generators, never over the vocabulary.

A request with its own `seed` draws from its own torch.Generator, so its tokens do not
depend on which other requests share the batch or on preemption (the generator lives
here, keyed by the request, and is not touched by recomputation).

The engine calls it through `nanopaged/engine/parallel_sampling.py: ParallelSampler`, which adds
the rows of the n > 1 samples that fork off a request (docs/06_sharing.md).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from nanopaged.core.request import Request


@dataclass
class SamplerOutput:
    token_ids: list[int]
    logprobs: list[float]                  # of the chosen token, raw model distribution (0.0 unless asked)
    top_logprobs: list[list[tuple[int, float, int]] | None]  # per row: (token, logprob, rank)


def torch_argmax(x: torch.Tensor) -> torch.Tensor:
    return x.argmax(dim=-1)


class Sampler:
    def __init__(self, device: torch.device, seed: int, argmax=torch_argmax) -> None:
        self.device = device
        # each row's largest index, as torch.argmax(x, dim=-1): the runner may hand a faster one
        # (the CPU kernels' argmax_rows, worker/cpu_fused.py)
        self.argmax = argmax
        self.generator = torch.Generator(device=device).manual_seed(seed)
        self.request_generators: dict[Request, torch.Generator] = {}
        # The hook, step 0: each processor(logits, requests) returns the logits to sample from (row i
        # is requests[i]'s), leaving the tensor it is given as it was; processor.forget(request) at the end.
        self.logits_processors: list = []

    @torch.inference_mode()
    def __call__(self, logits: torch.Tensor, requests: list[Request]) -> SamplerOutput:
        raw, logits = self.process_logits(logits, requests)
        params = [r.sampling_params for r in requests]
        tokens = self.argmax(logits)
        random_rows = [i for i, p in enumerate(params) if not p.greedy]
        if random_rows:
            idx = indices(logits, random_rows)
            tokens[idx] = self._sample(logits[idx], [requests[i] for i in random_rows])
        return SamplerOutput(tokens.tolist(), *self._logprobs(raw, tokens, params))

    def process_logits(self, logits: torch.Tensor, requests: list[Request]) -> tuple[torch.Tensor, torch.Tensor]:
        """Steps 0-4: (the raw logits the logprobs are taken from, the logits to choose from)."""
        logits = logits.float()
        for process in self.logits_processors:
            logits = process(logits, requests)
        raw = logits
        params = [r.sampling_params for r in requests]
        if any(p.allowed_token_ids or p.bad_words_token_ids or p.logit_bias for p in params):
            logits = apply_token_rules(logits, requests)
        if any(p.has_penalties for p in params):
            logits = apply_penalties(logits, requests)
        if any(r.num_output_tokens < r.sampling_params.min_tokens for r in requests):
            logits = block_stop_tokens(logits, requests)
        return raw, logits

    def _logprobs(self, raw: torch.Tensor, tokens: torch.Tensor, params) -> tuple[list, list]:
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
        """The request is finished: drop its generator, and what the logits processors keep for it."""
        self.request_generators.pop(request, None)
        for process in self.logits_processors:
            process.forget(request)


def indices(like: torch.Tensor, xs: list[int]) -> torch.Tensor:
    """An index tensor on the device of `like`."""
    return like.new_tensor(xs, dtype=torch.long)


def apply_token_rules(logits: torch.Tensor, requests: list[Request]) -> torch.Tensor:
    """vLLM's three, in its order (v1/sample/sampler.py): allowed_token_ids leaves only those tokens;
    bad_words blocks a word's last token when the output ends with the word's other tokens (a
    one-token word always; v1/sample/ops/bad_words.py); logit_bias adds to the logits."""
    blocked = torch.zeros_like(logits, dtype=torch.bool)
    allow_rows, allow_toks, block_rows, block_toks, bias_rows, bias_toks, biases = [], [], [], [], [], [], []
    for j, r in enumerate(requests):
        p = r.sampling_params
        if p.allowed_token_ids:
            blocked[j] = True
            allow_rows += [j] * len(p.allowed_token_ids)
            allow_toks += p.allowed_token_ids
        for *start, last in p.bad_words_token_ids or ():
            if len(start) <= r.num_output_tokens and r.output_token_ids[r.num_output_tokens - len(start):] == start:
                block_rows.append(j)
                block_toks.append(last)
        for token, bias in (p.logit_bias or {}).items():
            bias_rows.append(j)
            bias_toks.append(token)
            biases.append(bias)
    blocked[indices(logits, allow_rows), indices(logits, allow_toks)] = False
    blocked[indices(logits, block_rows), indices(logits, block_toks)] = True
    logits = logits.masked_fill(blocked, float("-inf"))
    return logits.index_put_((indices(logits, bias_rows), indices(logits, bias_toks)),
                             logits.new_tensor(biases), accumulate=True)


def apply_penalties(logits: torch.Tensor, requests: list[Request]) -> torch.Tensor:
    """vLLM's penalties; a row without penalties is left exactly as it was."""
    out_rows, out_toks, seen_rows, seen_toks = [], [], [], []
    for j, r in enumerate(requests):
        out_rows += [j] * r.num_output_tokens
        out_toks += r.output_token_ids
        seen_rows += [j] * r.num_prompt_tokens
        seen_toks += r.prompt_token_ids
    counts = logits.new_zeros(logits.shape)           # new_*: on the logits' device
    counts.index_put_((indices(logits, out_rows), indices(logits, out_toks)),
                      logits.new_ones(len(out_toks)), accumulate=True)
    seen = counts > 0
    seen[indices(logits, seen_rows), indices(logits, seen_toks)] = True
    p = [r.sampling_params for r in requests]
    rep = logits.new_tensor([x.repetition_penalty for x in p])[:, None]
    pres = logits.new_tensor([x.presence_penalty for x in p])[:, None]
    freq = logits.new_tensor([x.frequency_penalty for x in p])[:, None]
    penalized = torch.where(logits > 0, logits / rep, logits * rep)
    logits = torch.where(seen, penalized, logits)
    return logits - freq * counts - pres * (counts > 0).float()


def block_stop_tokens(logits: torch.Tensor, requests: list[Request]) -> torch.Tensor:
    """Before min_tokens, EOS (unless ignore_eos) and stop_token_ids get probability 0."""
    rows, toks = [], []
    for j, r in enumerate(requests):
        p = r.sampling_params
        if r.num_output_tokens < p.min_tokens:
            stop = set(p.stop_token_ids) | (set() if p.ignore_eos else set(r.eos_token_ids))
            rows += [j] * len(stop)
            toks += sorted(stop)
    logits = logits.clone()
    logits[indices(logits, rows), indices(logits, toks)] = float("-inf")
    return logits


def top_k_top_p_min_p(probs: torch.Tensor, top_k: list[int], top_p: list[float],
                      min_p: list[float]) -> torch.Tensor:
    """Zero the tokens each row's top-k / top-p / min-p rule removes (all rows at once)."""
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
