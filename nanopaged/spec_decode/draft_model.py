"""The draft-model proposer: a smaller model with the target's vocabulary guesses k tokens, one
forward pass each, and the target verifies them all in one.

Its K/V lives in a KV cache of its own shape, indexed by the *same* block ids as the target's:
a request's block table addresses both caches, so the draft needs no block pool, no scheduler and
no prefix cache of its own; the target's block pool allocates, shares and frees for both. The
positions past a request's table (the drafts after the last real token) go to scratch blocks at
the end of the draft cache, a few per running request. `computed[request]` counts the positions
whose draft K/V holds the request's real tokens: each proposal first catches the draft model up
on the tokens the target accepted since (a prompt, the accepted drafts, the bonus token), in one
chunked pass, then drafts.

A request's draft K/V is computed from position 0 at its first proposal (a prefix-cache hit saves
the target's work, not the draft's). It is only ever a guess-maker's memory: where it goes stale (n > 1
samples writing their first token into the block they share, a copy-on-write copy, which copies the
target's cache only), drafts get worse and fewer are accepted, but the output does not change: the
target checks every token.
vLLM: v1/spec_decode/draft_model.py (which allocates lookahead slots in the target's pool instead).
"""
from __future__ import annotations

import torch

from nanopaged.config import EngineConfig
from nanopaged.core.block_pool import cdiv
from nanopaged.core.request import Request
from nanopaged.core.scheduler import SchedulerOutput
from nanopaged.sampling_params import SamplingParams
from nanopaged.spec_decode.ngram_proposer import draft_alone
from nanopaged.sample.rejection_sampler import with_output
from nanopaged.worker.model_runner import ModelRunner

_PLAIN = SamplingParams()


class DraftModelProposer:
    def __init__(self, engine, spec) -> None:
        target = engine.config
        self.k = spec.num_speculative_tokens
        self.sampler = engine.sampler                    # the target's Sampler: its rules and generators
        self.num_blocks = engine.runner.num_kv_blocks
        self.block_size = target.block_size
        self.scratch_per_request = cdiv(self.k, target.block_size) + 1
        self.budget = target.max_num_batched_tokens
        config = EngineConfig(
            model=spec.model, tokenizer=target.tokenizer, dtype=target.dtype, device=target.device,
            block_size=target.block_size, max_model_len=target.max_model_len, max_num_seqs=target.max_num_seqs,
            max_num_batched_tokens=target.max_num_batched_tokens,
            num_kv_blocks=self.num_blocks + target.max_num_seqs * self.scratch_per_request,
            attention_backend=target.attention_backend, enforce_eager=True, cpu_threads=None,
            cpu_linear=target.cpu_linear, cpu_kernels=target.cpu_kernels, batch_invariant=target.batch_invariant,
            seed=target.seed)
        self.runner = ModelRunner(config)
        self.computed: dict[Request, tuple[int, int]] = {}   # request -> (positions, its preemptions then)
        self.q: dict[Request, torch.Tensor] = {}             # sampled requests: the drafts' distributions

    def draft_probs(self, request: Request) -> torch.Tensor | None:
        """q for the rejection sampler: (drafts, vocab), for a sampled request drafted last step."""
        return self.q.get(request)

    def follow(self, running: list[Request]) -> None:
        """Forget the draft K/V of requests no longer running; no q is pending yet."""
        self.q = {}
        alive = set(running)
        self.computed = {r: c for r, c in self.computed.items() if r in alive}

    def forget(self, request: Request) -> None:
        """The request finished: its draft K/V's bookkeeping and its q go now."""
        self.computed.pop(request, None)
        self.q.pop(request, None)

    def __call__(self, running: list[Request]) -> None:
        draft_alone(self, running, self.k)

    @torch.inference_mode()
    def propose(self, todo: list[tuple[Request, int, list[int]]]) -> list[list[int]]:
        """(request, budget, before): up to `budget` drafts after the request's tokens and `before`
        (forced drafts: the draft model reads them as it catches up). q of a sampled request has a
        one-hot row for each token of `before` (drafts proposed for certain), then the model's."""
        if not todo:
            return []
        views = [self._view(r, i, before) for i, (r, _, before) in enumerate(todo)]
        logits = self._catch_up(views)
        drafts: list[list[int]] = [[] for _ in todo]
        probs: list[list[torch.Tensor | None]] = [[] for _ in todo]
        live = list(range(len(todo)))
        while live:
            tokens, q = self._choose(logits, [todo[i][0] for i in live], [views[i] for i in live])
            for i, t, qi in zip(live, tokens, q):
                drafts[i].append(t)
                probs[i].append(qi)
            live = [i for i in live if len(drafts[i]) < todo[i][1]]
            if live:
                logits = self._forward([(views[i], drafts[i][-1]) for i in live])
        for (r, _, before), q in zip(todo, probs):
            # the last token's K/V may have gone to a scratch block (its block is allocated next step)
            self.computed[r] = (min(r.num_tokens, len(r.block_ids) * self.block_size), r.num_preemptions)
            if not r.sampling_params.greedy:
                certain = torch.zeros(len(before), q[0].shape[-1], device=q[0].device)
                certain[range(len(before)), before] = 1.0
                self.q[r] = torch.cat([certain, torch.stack(q)])
        return drafts

    def _view(self, r: Request, i: int, before: list[int]) -> Request:
        """The request as the draft runner sees it: its tokens and `before`, the draft K/V it has,
        its block table and then its scratch blocks."""
        done, preemptions = self.computed.get(r, (0, -1))
        start = self.num_blocks + i * self.scratch_per_request
        return Request(r.request_id, r.prompt_token_ids, _PLAIN, max_tokens=1,
                       output_token_ids=list(r.output_token_ids) + list(before),
                       num_computed_tokens=done if preemptions == r.num_preemptions else 0,
                       block_ids=r.block_ids + list(range(start, start + self.scratch_per_request)))

    def _catch_up(self, views: list[Request]) -> torch.Tensor:
        """Compute the draft K/V of every real token not yet in it, in passes of at most the token
        budget; the logits at each request's last token (its first draft's distribution)."""
        last = {}
        while len(last) < len(views):
            budget, out = self.budget, SchedulerOutput()
            for v in views:
                n = min(v.num_tokens - v.num_computed_tokens, budget)
                if n > 0:
                    out.scheduled.append((v, n))
                    budget -= n
            result = self.runner.execute(out)
            for v, n in out.scheduled:
                v.num_computed_tokens += n
            last.update(zip(map(id, result.requests), result.logits))
        return torch.stack([last[id(v)] for v in views])

    def _forward(self, fed: list[tuple[Request, int]]) -> torch.Tensor:
        """One draft step: each view gets its newest draft token; the logits after it."""
        out = SchedulerOutput()
        for v, token in fed:
            v.output_token_ids.append(token)
            out.scheduled.append((v, 1))
        logits = self.runner.execute(out).logits
        for v, _ in fed:
            v.num_computed_tokens += 1
        return logits

    def _choose(self, logits: torch.Tensor, requests: list[Request], views: list[Request]
                ) -> tuple[list[int], list]:
        """The draft model's logits under the request's own sampling rules (its token rules, penalties
        and min_tokens, with the drafts so far in its history), so it drafts what the target may
        accept; greedy requests draft the argmax, sampled ones draw from q, that distribution after
        temperature, top-k, top-p and min-p, with the request's generator."""
        history = [with_output(r, v.output_token_ids) for r, v in zip(requests, views)]
        _, logits = self.sampler.process_logits(logits, history)
        tokens, q = logits.argmax(dim=-1), [None] * len(requests)
        sampled = [i for i, r in enumerate(requests) if not r.sampling_params.greedy]
        if sampled:
            chosen = [requests[i] for i in sampled]
            probs = self.sampler.probs(logits[sampled], chosen)
            tokens[sampled] = self.sampler.draw(probs, chosen)
            for i, p in zip(sampled, probs):
                q[i] = p
        return tokens.tolist(), q
