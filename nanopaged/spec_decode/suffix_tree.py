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
    GlobalSuffixCache   finished requests' outputs in one tree: at most `max_cached_requests`, the
                        least recently used (added, or drafted from) evicted first

docs/11_speculative_decoding.md, 'Suffix decoding'.
"""
from __future__ import annotations

import math
from collections import OrderedDict
from dataclasses import dataclass


class Node:
    __slots__ = ("count", "children", "owners", "total", "best_token", "best")

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

    def uncounted(self, child: "Node") -> None:
        """`child` was just counted once less (and dropped if at 0): the best child may have changed."""
        self.total -= 1
        if child is self.best:
            self.best_token, self.best = max(self.children.items(), key=lambda item: item[1].count,
                                             default=(None, None))

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
                if child.owners is not None:
                    child.owners.discard(owner)
                if child.count == 0:
                    del node.children[t]
                    self.num_nodes -= child.size()
                node.uncounted(child)
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
    """The outputs of finished requests, in one SuffixTree. At most `max_cached_requests` texts (0:
    none, the global tree is off); adding one more removes the least recently used, where a text is
    used when it is added and whenever a draft comes from a path it holds (vLLM evicts in the order
    added: the same order while no global draft is taken)."""

    def __init__(self, max_depth: int, max_cached_requests: int) -> None:
        self.tree = SuffixTree(max_depth)
        self.max_cached_requests = max_cached_requests
        self.texts: OrderedDict[int, list[int]] = OrderedDict()   # key -> tokens, least recently used first
        self._next_key = 0

    def add(self, tokens: list[int]) -> None:
        if self.max_cached_requests == 0 or not tokens:
            return
        key, self._next_key = self._next_key, self._next_key + 1
        self.texts[key] = list(tokens)
        self.tree.append(self.texts[key], owner=key)
        self.tree.close()
        while len(self.texts) > self.max_cached_requests:
            old, old_tokens = self.texts.popitem(last=False)
            self.tree.remove(old_tokens, owner=old)

    def touch(self, node: Node) -> None:
        """The texts that hold the path ending at `node` were just drafted from: used most recently."""
        for key in node.owners or ():
            self.texts.move_to_end(key)
