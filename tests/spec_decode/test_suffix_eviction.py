"""The global suffix tree's eviction and memory bound (nanopaged/spec_decode/suffix_tree.py).

Evicting a text costs at most max_depth node steps a token, whatever the tree holds: counted as
work (the children a removal looks at), never in seconds, on skewed text where a few tokens lead
hundreds of others. The tree never holds more than max_cached_tokens tokens, and stays the tree
built afresh from the texts it keeps. docs/11_speculative_decoding.md, "Suffix decoding".
"""
import random

import pytest
from test_suffix_decoding import assert_counts_as_a_scan_gives

from nanopaged.spec_decode import suffix_tree
from nanopaged.spec_decode.config import SpeculativeConfig
from nanopaged.spec_decode.suffix_tree import GlobalSuffixCache, SuffixTree, best_draft


class CountingChildren(dict):
    """A node's children that count every child a scan over them yields."""
    seen = 0

    def items(self):
        for item in super().items():
            CountingChildren.seen += 1
            yield item

    def values(self):
        for value in super().values():
            CountingChildren.seen += 1
            yield value

    def __iter__(self):
        for key in super().__iter__():
            CountingChildren.seen += 1
            yield key


@pytest.fixture
def counted(monkeypatch):
    """Every node made from now on keeps its children in a CountingChildren."""
    class CountedNode(suffix_tree.Node):
        __slots__ = ()

        def __init__(self):
            super().__init__()
            self.children = CountingChildren()
    monkeypatch.setattr(suffix_tree, "Node", CountedNode)
    CountingChildren.seen = 0
    return CountingChildren


def skewed(rng: random.Random, n: int, vocabulary: int = 400) -> list[int]:
    """Text where token 0 follows almost everything and hundreds of tokens follow 0 (a Zipf-like mix)."""
    return [0 if rng.random() < 0.5 else int(rng.paretovariate(0.7)) % vocabulary for _ in range(n)]


def fresh_counts(texts, depth):
    tree = SuffixTree(depth)
    for key, text in texts.items():
        tree.append(text, owner=key)
        tree.close()
    return counts(tree)


def counts(tree):
    out, todo = {}, [((), tree.root)]
    while todo:
        path, node = todo.pop()
        for t, child in dict.items(node.children):
            out[path + (t,)] = (child.count, frozenset(child.owners or ()))
            todo.append((path + (t,), child))
    return out


def test_evicting_looks_at_a_bounded_number_of_children_per_token(counted):
    """A removal steps through at most depth nodes a token; the children it looks at beyond those
    (grouping a node's children by count, once per node) stay within a small multiple of that:
    no rescan of a hot node's hundreds of children each time its most frequent child is counted down."""
    depth, rng = 6, random.Random(5)
    cache = GlobalSuffixCache(depth, max_cached_requests=40)        # 4,800 tokens: under the default cap
    for _ in range(40):                                   # full: every add from now on evicts one
        cache.add(skewed(rng, 120))
    removed, counted.seen = 0, 0
    for _ in range(200):
        removed += len(next(iter(cache.texts.values())))
        cache.add(skewed(rng, 120))
    assert counted.seen <= 2 * depth * removed, (counted.seen, removed)
    assert counts(cache.tree) == fresh_counts(cache.texts, depth)


def test_the_best_child_after_evictions_is_a_most_frequent_one():
    depth, rng = 5, random.Random(8)
    cache = GlobalSuffixCache(depth, max_cached_requests=6)
    for _ in range(300):
        cache.add(skewed(rng, rng.randrange(1, 40), vocabulary=12))
        assert_counts_as_a_scan_gives(cache.tree)


def test_the_global_tree_never_holds_more_than_max_cached_tokens():
    """Random outputs of 0 to 300 tokens under a cap of 500: never more tokens held; the tree is the
    one built afresh from the texts kept; a text longer than the cap keeps its first 500 tokens."""
    depth, cap, rng = 5, 500, random.Random(4)
    cache = GlobalSuffixCache(depth, max_cached_requests=10_000, max_cached_tokens=cap)
    for i in range(400):
        cache.add([rng.randrange(20) for _ in range(rng.randint(0, 300))])
        assert cache.tree.num_tokens == sum(map(len, cache.texts.values())) <= cap
        assert cache.tree.num_nodes <= 1 + depth * cap
        d = best_draft(cache.tree.suffixes([rng.randrange(20) for _ in range(3)]), 4, 1.0, 0.1)
        if d.tokens:
            cache.touch(d.node)
        if i % 50 == 0:
            assert counts(cache.tree) == fresh_counts(cache.texts, depth)
    long = list(range(700))
    cache.add(long)
    assert list(cache.texts.values()) == [long[:cap]] and cache.tree.num_tokens == cap
    off = GlobalSuffixCache(depth, max_cached_requests=10, max_cached_tokens=0)
    off.add([1, 2, 3])
    assert off.tree.num_nodes == 1 and not off.texts


def test_max_cached_tokens_has_a_default_and_refuses_bad_values():
    def suffix(**knobs):
        return SpeculativeConfig.from_dict({"method": "suffix", **knobs}, None, None)
    assert suffix().suffix_decoding_max_cached_tokens == 100_000
    assert suffix(suffix_decoding_max_cached_tokens=0).suffix_decoding_max_cached_tokens == 0
    for bad, match in ((-1, r"must be in \[0, inf\], got -1"), (2.5, "must be an integer, got 2.5"),
                       ("many", "must be an integer")):
        with pytest.raises(ValueError, match=f"suffix_decoding_max_cached_tokens {match}"):
            suffix(suffix_decoding_max_cached_tokens=bad)
