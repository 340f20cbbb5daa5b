"""Suffix trees over token ids (SuffixDecoding, Oliaro et al., NeurIPS 2025): what followed a
context before, and how often.

A SuffixTree here is a trie of every run of at most `max_depth` consecutive tokens in the texts it
holds (a depth-bounded suffix trie, not a compressed suffix tree): the path root -> 5 -> 7 spells
"5 7", and that node's `count` is how often "5 7" occurred. Appending a token t to a text puts t
under each node that spells one of the text's last 0 .. max_depth - 1 tokens: at most `max_depth`
nodes per token, whatever the text repeats. So a tree holding n tokens has at most
1 + max_depth * n nodes, and n * max_depth node updates built it: that bound is why the depth is
a setting. A text is only ever appended to, or removed whole.

    SuffixTree          the trie: append to the open text, remove a text, find a context's suffixes
    best_draft          the best continuation a tree offers after those suffixes
    GlobalSuffixCache   finished requests' outputs in one tree: at most `max_cached_requests` of them
                        and `max_cached_tokens` tokens, the least recently used (added, or drafted
                        from) evicted first

Removing a text costs at most max_depth node steps per token, whatever the tree holds: a node
keeps its children grouped by count (`ranks`, made on its first count down), so when its most
frequent child is counted down the next one is at hand, with no scan of the children.

docs/11_speculative_decoding.md, 'Suffix decoding'.
"""
from __future__ import annotations

import math
from collections import OrderedDict
from dataclasses import dataclass

from nanopaged.spec_decode.config import DEFAULT_MAX_CACHED_TOKENS


class Node:
    __slots__ = ("count", "children", "owners", "total", "best_token", "best", "ranks")

    def __init__(self) -> None:
        self.count = 0                         # occurrences of the tokens its path spells
        self.children: dict[int, Node] = {}    # next token -> node
        self.owners: set[int] | None = None    # global tree: the cached texts that hold this path
        # Kept as the counts change, so a walk's step costs the same at a node with 2 children or 2,000
        # (the root's and the short matches' nodes have hundreds): the children's counts together, and
        # the most frequent child (on a tie, the first to reach that count). SuffixTree.append counts up.
        self.total = 0
        self.best_token: int | None = None
        self.best: Node | None = None
        # count -> the tokens of the children at that count, in the order they reached it. Only a node
        # that has been counted down needs it (a request's own tree never is): None until then.
        self.ranks: dict[int, dict[int, None]] | None = None

    def ranked(self, token: int, old: int, new: int) -> None:
        """Child `token` went from count `old` (0: new) to `new` (0: dropped): move it between the groups."""
        if old:
            group = self.ranks[old]
            del group[token]
            if not group:
                del self.ranks[old]
        if new:
            self.ranks.setdefault(new, {})[token] = None

    def uncounted(self, token: int, child: "Node") -> int:
        """`child` (under `token`) was just counted once less (and dropped if at 0): the best child
        may have changed. The children's nodes it looked at (the scan that makes `ranks`, once)."""
        looked = 0
        if self.ranks is None:                        # the first count down: group the children as they are
            self.ranks, looked = {}, len(self.children)
            for t, c in self.children.items():
                self.ranks.setdefault(c.count, {})[t] = None
        else:
            self.ranked(token, child.count + 1, child.count)
        self.total -= 1
        if child is self.best:
            tied = self.ranks.get(child.count + 1)    # another child at the count the best had: it leads
            if tied:
                self.best_token = next(iter(tied))
                self.best = self.children[self.best_token]
            elif not child.count:                     # the last child went
                self.best_token, self.best = None, None
        return looked

    def size(self) -> int:
        """Nodes in the subtree rooted here."""
        n, todo = 0, [self]
        while todo:
            n += 1
            todo.extend(todo.pop().children.values())
        return n


class SuffixTree:
    def __init__(self, max_depth: int) -> None:
        self.max_depth = max_depth
        self.root = Node()
        self.num_nodes = 1
        self.num_tokens = 0              # tokens held, over all texts: num_nodes <= 1 + max_depth * num_tokens
        self.ends = [self.root]          # the open text: ends[j] spells its last j tokens, j < max_depth
        self.visits = 0                  # nodes `remove` has looked at, for tests that count its work

    def append(self, tokens: list[int], owner: int | None = None) -> None:
        """Append tokens to the open text: each adds or counts at most max_depth nodes."""
        # The proposer's hottest loop (every token of every request, max_depth times): Node.counted is
        # written out here, and the open text's ends kept in a local.
        root, depth, ends = self.root, self.max_depth, self.ends
        for t in tokens:
            longer = [root]
            for node in ends:            # node spells the last j tokens; its child t the new last j + 1
                child = node.children.get(t)
                if child is None:
                    child = node.children[t] = Node()
                    self.num_nodes += 1
                child.count += 1
                node.total += 1
                if node.ranks is not None:
                    node.ranked(t, child.count - 1, child.count)
                if node.best is None or child.count > node.best.count:
                    node.best_token, node.best = t, child
                if owner is not None:
                    child.owners = child.owners or set()
                    child.owners.add(owner)
                if len(longer) < depth:
                    longer.append(child)
            ends = longer
        self.ends = ends
        self.num_tokens += len(tokens)

    def close(self) -> None:
        """The next append starts a new text (nothing spans two texts)."""
        self.ends = [self.root]

    def remove(self, tokens: list[int], owner: int | None = None) -> None:
        """Take a closed text back out: every run it added, counted down; a node at 0 goes, with its
        subtree (a longer run never occurs more often than its prefix, so that is all at 0 too)."""
        for start in range(len(tokens)):
            node = self.root
            for t in tokens[start:start + self.max_depth]:
                child = node.children[t]
                child.count -= 1
                self.visits += 1
                if child.owners is not None:
                    child.owners.discard(owner)
                if child.count == 0:
                    del node.children[t]
                    dropped = child.size()            # the rest of this run: a chain at 0 as well
                    self.num_nodes -= dropped
                    self.visits += dropped
                self.visits += node.uncounted(t, child)
                if child.count == 0:
                    break
                node = child
        self.num_tokens -= len(tokens)

    def find(self, context: list[int]) -> Node | None:
        """The node that spells `context`, or None if it never occurred."""
        node = self.root
        for t in context:
            node = node.children.get(t)
            if node is None:
                return None
        return node

    def suffixes(self, context: list[int]) -> list[Node]:
        """The nodes that spell the last 1, 2, ... tokens of `context`, while they occurred (if the
        last m never did, no longer suffix did), up to max_depth - 1: a longer match leaves no depth
        to draft in. The open text's own are at hand: `ends[1:]`."""
        out = []
        for m in range(1, min(len(context), self.max_depth - 1) + 1):
            node = self.find(context[len(context) - m:])
            if node is None:
                break
            out.append(node)
        return out


@dataclass
class Draft:
    tokens: list[int]
    score: float = 0.0           # expected accepted tokens: the sum of each draft prefix's probability
    match_length: int = 0        # the context tokens matched before it
    node: Node | None = None     # where the walk ended (its owners are the texts that predicted it)


def best_draft(suffixes: list[Node], max_spec_tokens: int, spec_factor: float, min_token_prob: float) -> Draft:
    """Of the request's last m tokens matched in a tree (suffixes[m - 1], SuffixTree.suffixes), the
    draft that scores best: from the match's node, the most frequent next token while the product of
    the steps' probabilities stays >= min_token_prob, at most min(max_spec_tokens, ceil(spec_factor
    * m)) tokens (a longer match earns a longer draft), and never past the tree's depth (match and
    draft together: max_depth tokens at most). A tie goes to the longer match."""
    best = Draft([])
    for m, node in enumerate(suffixes, start=1):
        limit = min(max_spec_tokens, math.ceil(round(spec_factor * m, 9)))
        draft = walk(node, limit, min_token_prob)
        if draft.tokens and draft.score >= best.score:
            best = Draft(draft.tokens, draft.score, m, draft.node)
    return best


def walk(node: Node, limit: int, min_token_prob: float) -> Draft:
    """Follow the most frequent child (the first to reach its count, on a tie) up to `limit` tokens. A step's
    probability is child.count / the children's counts together: how often the context went on
    with that token among the times it went on at all (the occurrence at a text's very end, such
    as the request's own last tokens, has no next token and does not count)."""
    tokens, score, prob = [], 0.0, 1.0
    while len(tokens) < limit and node.best is not None:
        token, child = node.best_token, node.best
        prob *= child.count / node.total
        if prob < min_token_prob:
            break
        tokens.append(token)
        score += prob
        node = child
    return Draft(tokens, score, 0, node)


class GlobalSuffixCache:
    """The outputs of finished requests, in one SuffixTree. At most `max_cached_requests` texts and
    `max_cached_tokens` tokens (either 0: none, the global tree is off); a text that does not fit
    first removes the least recently used, where a text is used when it is added and whenever a draft
    comes from a path it holds (vLLM evicts in the order added: the same order while no global draft
    is taken). An output longer than max_cached_tokens keeps its first max_cached_tokens tokens."""

    def __init__(self, max_depth: int, max_cached_requests: int,
                 max_cached_tokens: int = DEFAULT_MAX_CACHED_TOKENS) -> None:
        self.tree = SuffixTree(max_depth)
        self.max_cached_requests, self.max_cached_tokens = max_cached_requests, max_cached_tokens
        self.texts: OrderedDict[int, list[int]] = OrderedDict()   # key -> tokens, least recently used first
        self._next_key = 0

    def add(self, tokens: list[int]) -> None:
        if self.max_cached_requests == 0 or self.max_cached_tokens == 0 or not tokens:
            return
        tokens = list(tokens[:self.max_cached_tokens])
        while self.texts and (len(self.texts) >= self.max_cached_requests
                              or self.tree.num_tokens + len(tokens) > self.max_cached_tokens):
            old, old_tokens = self.texts.popitem(last=False)
            self.tree.remove(old_tokens, owner=old)
        key, self._next_key = self._next_key, self._next_key + 1
        self.texts[key] = tokens
        self.tree.append(tokens, owner=key)
        self.tree.close()

    def touch(self, node: Node) -> None:
        """The texts that hold the path ending at `node` were just drafted from: used most recently."""
        for key in node.owners or ():
            self.texts.move_to_end(key)
