"""The rejection sampler: which drafts the target model agrees with, and the token after them.

A request with k drafts d_1..d_k got k + 1 logits rows from one forward pass: row j scores the
token after d_1..d_j (row 0: the token after the request's real tokens). Going along the rows:

  greedy    accept d_j while it is row j-1's argmax; the first row that disagrees gives its
            argmax instead, and if all k agree, row k gives one more (the bonus token). The
            output is the one plain decoding gives, token for token.
  sampled   accept d_j with probability min(1, p(d_j) / q(d_j)), p = row j-1's distribution after
            every sampling rule (temperature, top-k/p, min-p, penalties with the drafts before it in
            the history), q = the proposer's (n-gram: q(d_j) = 1). The first rejection draws from
            max(p - q, 0), normalised; all accepted, the bonus is drawn from row k's p. Each
            emitted token is then distributed exactly as p: speculation changes the speed, not the
            output distribution (Leviathan et al. 2023, appendix A.1; Chen et al. 2023).

vLLM: v1/sample/rejection_sampler.py. Seeded requests draw every uniform and token from their own
generator, so they stay reproducible. docs/11_speculative_decoding.md.
"""
from __future__ import annotations

import copy

import torch

from nanopaged.core.request import Request, SampledToken
from nanopaged.sample.parallel_sampling import ParallelSampler
from nanopaged.worker.model_runner import ModelRunnerOutput


def accept_greedy(argmax: list[int], drafts: list[int]) -> list[int]:
    """The tokens a greedy request emits: the drafts while they equal the target's argmax of the
    row before, then the target's own token (len(argmax) == len(drafts) + 1)."""
    out = []
    for j, d in enumerate(drafts):
        out.append(argmax[j])
        if argmax[j] != d:
            return out
    return out + [argmax[len(drafts)]]


def accept_sampled(p: torch.Tensor, drafts: list[int], q: torch.Tensor | None,
                   generator: torch.Generator | None, draw) -> list[int]:
    """The tokens a sampled request emits. p: (k + 1, vocab) the target's distributions; q: (k,
    vocab) the draft's, or None for a proposer that is certain of its drafts (n-gram: q = one-hot);
    `draw(probs)` samples one token from a (vocab,) distribution with the request's generator."""
    out = []
    for j, d in enumerate(drafts):
        q_d = 1.0 if q is None else float(q[j, d])
        u = float(torch.rand((), generator=generator, device=p.device))
        if u * q_d < float(p[j, d]):            # u < p / q, without dividing by a q of 0
            out.append(d)
            continue
        residual = p[j].clone()
        if q is None:
            residual[d] = 0.0                   # max(p - onehot(d), 0)
        else:
            residual = (residual - q[j]).clamp_(min=0.0)
        total = float(residual.sum())
        # p = q exactly leaves nothing to reject into; then p itself is what remains (vLLM does the same)
        out.append(draw(residual / total if total > 0 else p[j]))
        return out
    return out + [draw(p[len(drafts)])]


class RejectionSampler:
    """The engine's token-selection rule while speculation is on: requests with drafts are verified
    here, the others go to the parallel sampler as before. `stats.record(drafts, accepted)` counts
    (spec_decode/stats.py); `draft_probs(request)` gives a draft model's q."""

    def __init__(self, parallel: ParallelSampler, stats, draft_probs=None) -> None:
        self.parallel = parallel
        self.sampler = parallel.sampler          # the one Sampler: its rules, generators and processors
        self.stats = stats
        self.draft_probs = draft_probs or (lambda request: None)

    def add(self, samples: list[Request]) -> None:
        self.parallel.add(samples)

    def forget(self, request: Request) -> None:
        self.parallel.forget(request)

    @torch.inference_mode()
    def __call__(self, runner_output: ModelRunnerOutput) -> dict[Request, list[SampledToken]]:
        rows = runs(runner_output.requests)
        if len(rows) == len(runner_output.requests):     # no drafts this step: the plain sampler, as is
            return self.parallel(runner_output)
        plain = [(r, start) for r, start, n in rows if n == 1]
        out = {}
        if plain:
            idx = [start for _, start in plain]
            out = self.parallel(ModelRunnerOutput([r for r, _ in plain], runner_output.logits[idx], []))
        drafted = [(r, start, n) for r, start, n in rows if n > 1]
        if drafted:
            out.update(self._verify(runner_output.logits, drafted))
        return out

    def _verify(self, logits: torch.Tensor, drafted) -> dict[Request, list[SampledToken]]:
        """Every drafted request's rows through the sampler's rules at once, then each accepted."""
        sampler = self.sampler
        views = [view for request, _, n in drafted for view in row_views(request, n)]
        idx = [start + j for _, start, n in drafted for j in range(n)]
        raw, processed = sampler.process_logits(logits[idx], views)
        argmax = processed.argmax(dim=-1).tolist()
        sampled_rows = [i for i, v in enumerate(views) if not v.sampling_params.greedy]
        probs = {}
        if sampled_rows:
            p = sampler.probs(processed[sampled_rows], [views[i] for i in sampled_rows])
            probs = dict(zip(sampled_rows, p))
        out, at = {}, 0
        for request, _, n in drafted:
            drafts = request.spec_token_ids[:n - 1]
            if request.sampling_params.greedy:
                tokens = accept_greedy(argmax[at:at + n], drafts)
            else:
                g = sampler.generator_of(request)
                draw = lambda pr, g=g: int(torch.multinomial(pr, 1, generator=g))  # noqa: E731
                tokens = accept_sampled(torch.stack([probs[at + j] for j in range(n)]), drafts,
                                        self.draft_probs(request), g, draw)
            self.stats.record(len(drafts), len(tokens) - 1)
            out[request] = self._sampled(raw[at:at + len(tokens)], tokens, views[at:at + len(tokens)])
            at += n
        return out

    def _sampled(self, raw: torch.Tensor, tokens: list[int], views: list[Request]) -> list[SampledToken]:
        """The emitted tokens, each with its logprob (and top-k) in its own row's raw distribution."""
        logprobs, tops = self.sampler.logprobs_of(raw, raw.new_tensor(tokens, dtype=torch.long),
                                                [v.sampling_params for v in views])
        return [SampledToken(t, lp, top) for t, lp, top in zip(tokens, logprobs, tops)]


def runs(requests: list[Request]) -> list[tuple[Request, int, int]]:
    """(request, first row, rows) for each run of consecutive rows of one request."""
    out = []
    for i, r in enumerate(requests):
        if out and out[-1][0] is r:
            out[-1] = (r, out[-1][1], out[-1][2] + 1)
        else:
            out.append((r, i, 1))
    return out


def row_views(request: Request, n: int) -> list[Request]:
    """What the sampler's rules see at each of a request's n rows: row j as if its first j drafts
    were already output (penalties, min_tokens and bad_words count them)."""
    return [request] + [with_output(request, request.output_token_ids + request.spec_token_ids[:j])
                        for j in range(1, n)]


def with_output(request: Request, output_token_ids: list[int]) -> Request:
    """A shallow copy of the request whose output is `output_token_ids`: what the sampler's rules
    read for a position past its real tokens (the request itself keeps its generator). `view_of`
    names the request itself, for a processor that keeps state per request (a grammar's matcher)."""
    view = copy.copy(request)
    view.output_token_ids = output_token_ids
    view.view_of = getattr(request, "view_of", request)
    return view
