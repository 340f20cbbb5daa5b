"""The suffix proposer (SuffixDecoding, Oliaro et al., NeurIPS 2025): guess that the text goes on
as it most often went on before, in this request or in the outputs of earlier ones.

Each running request has a suffix tree of its own prompt + output, appended to as tokens arrive;
one global tree holds the outputs of finished requests (suffix_tree.py). After each step, for a
request that decodes next, each tree offers its best draft after the request's last tokens, and
the one that scores higher (expected accepted tokens) is the request's `spec_token_ids`. How long
a draft may be adapts to the match: ceil(max_spec_factor * matched tokens), at most k. No model
runs; the rejection sampler verifies as for n-gram drafts (q one-hot).
vLLM: v1/spec_decode/suffix_decoding.py (through Arctic Inference).

NOTE: the proposer learns that a request finished without a hook of its own: a request it has
followed that is no longer in `running` and `is_finished` has ended (stopped, at its length, or
aborted), and its output goes to the global tree; one that is only preempted keeps its tree.
"""
from __future__ import annotations

from nanopaged.core.request import Request
from nanopaged.spec_decode.config import DEFAULT_MAX_CACHED_TOKENS
from nanopaged.spec_decode.ngram_proposer import draft_alone
from nanopaged.spec_decode.suffix_tree import GlobalSuffixCache, SuffixTree, best_draft


class SuffixProposer:
    """The method "suffix": the engine's drafter (drafter.py) calls `follow`, then `propose`."""

    def __init__(self, k: int, max_tree_depth: int, max_cached_requests: int, max_spec_factor: float,
                 min_token_prob: float, max_cached_tokens: int = DEFAULT_MAX_CACHED_TOKENS) -> None:
        self.k, self.max_tree_depth = k, max_tree_depth
        self.max_spec_factor, self.min_token_prob = max_spec_factor, min_token_prob
        self.trees: dict[Request, SuffixTree] = {}     # every unfinished request seen running: its own tree
        self.cache = GlobalSuffixCache(max_tree_depth, max_cached_requests, max_cached_tokens)

    def __call__(self, running: list[Request]) -> None:
        draft_alone(self, running, self.k)

    def propose(self, todo: list[tuple[Request, int, list[int]]]) -> list[list[int]]:
        """For the drafter (drafter.py), after `follow`: (request, budget, before) -> drafts after its
        tokens and then `before`."""
        return [self.draft(r, self.trees[r], budget, before) for r, budget, before in todo]

    def follow(self, running: list[Request]) -> None:
        """Bring every running request's tree up to its tokens; finished requests' outputs to the cache."""
        self._retire(running)
        for request in running:
            self._tree_of(request)

    def draft(self, request: Request, tree: SuffixTree, budget: int, before: list[int] = ()) -> list[int]:
        """The better of the two trees' drafts after the request's last max_tree_depth - 1 tokens
        (then `before`; a longer match would leave no depth to draft in); a tie goes to the request's
        own. Its own tree ends with the request's tokens: their nodes are the open text's ends."""
        n = request.num_tokens
        context = request.token_ids(max(0, n - self.max_tree_depth + 1), n) + list(before)
        context = context[len(context) - min(len(context), self.max_tree_depth - 1):]
        ends = tree.suffixes(context) if before else tree.ends[1:]
        own = best_draft(ends, budget, self.max_spec_factor, self.min_token_prob)
        cached = best_draft(self.cache.tree.suffixes(context), budget, self.max_spec_factor, self.min_token_prob)
        if cached.score > own.score:
            self.cache.touch(cached.node)
            return cached.tokens
        return own.tokens

    def _tree_of(self, request: Request) -> SuffixTree:
        """The request's tree, brought up to its tokens (built from the prompt the first time)."""
        tree = self.trees.get(request)
        if tree is None:
            tree = self.trees[request] = SuffixTree(self.max_tree_depth)
        if tree.num_tokens < request.num_tokens:
            tree.append(request.token_ids(tree.num_tokens, request.num_tokens))
        return tree

    def forget(self, request: Request) -> None:
        """The request finished (or was aborted, maybe with no step after it): its output to the global
        tree and its own tree dropped now."""
        if self.trees.pop(request, None) is not None:
            self.cache.add(request.output_token_ids)

    def _retire(self, running: list[Request]) -> None:
        """Requests followed so far that have finished since: their output to the global tree,
        their own tree dropped."""
        alive = set(running)
        for request in [r for r in self.trees if r not in alive and r.is_finished]:
            self.cache.add(request.output_token_ids)
            del self.trees[request]
