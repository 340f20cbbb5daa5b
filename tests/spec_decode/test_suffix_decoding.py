"""Suffix decoding (method "suffix"): the suffix trees count what followed what, the global tree
keeps at most max_cached_requests outputs and never more than depth nodes a token, the proposer
drafts what the text predicts and no further than the match earns; end to end, greedy output is
plain decoding's token for token, sampled output keeps its distribution, the pool stays whole."""
import random

import pytest
from conftest import torch_threads
from test_spec_decode import (ALLOWED, GREEDY, engine, repeating_prompts, sampled_tokens, stats, token_ids,
                              two_sample_chi2_passes)

from nanopaged import SamplingParams
from nanopaged.spec_decode.extension import SpeculativeDecoding
from nanopaged.core.request import Request, RequestStatus
from nanopaged.spec_decode.config import SpeculativeConfig
from nanopaged.spec_decode.suffix_proposer import SuffixProposer
from nanopaged.spec_decode.suffix_tree import GlobalSuffixCache, SuffixTree, best_draft, walk

SUFFIX = {"method": "suffix", "num_speculative_tokens": 4}


def counts(tree: SuffixTree) -> dict[tuple[int, ...], tuple[int, frozenset]]:
    """Every path the tree spells -> (count, owners)."""
    out, todo = {}, [((), tree.root)]
    while todo:
        path, node = todo.pop()
        for t, child in node.children.items():
            out[path + (t,)] = (child.count, frozenset(child.owners or ()))
            todo.append((path + (t,), child))
    return out


def runs(texts: list[list[int]], depth: int) -> dict[tuple[int, ...], int]:
    """By brute force: every run of at most `depth` tokens in the texts -> how often it occurs."""
    out: dict[tuple[int, ...], int] = {}
    for text in texts:
        for i in range(len(text)):
            for j in range(i + 1, min(i + depth, len(text)) + 1):
                out[tuple(text[i:j])] = out.get(tuple(text[i:j]), 0) + 1
    return out


# ---------------------------------------------------------------- the tree


def test_a_node_counts_how_often_its_tokens_occurred():
    tree = SuffixTree(max_depth=3)
    tree.append([1, 2, 1, 2, 3])
    assert tree.find([1, 2]).count == 2 and tree.find([2]).count == 2 and tree.find([1, 2, 3]).count == 1
    assert tree.find([2, 1, 2]).count == 1
    assert tree.find([1, 2, 1, 2]) is None           # longer than max_depth: never stored
    assert tree.find([3, 1]) is None                 # never occurred
    assert {p: c for p, (c, _) in counts(tree).items()} == runs([[1, 2, 1, 2, 3]], 3)
    assert tree.num_nodes == 1 + len(runs([[1, 2, 1, 2, 3]], 3)) and tree.num_tokens == 5


def test_appending_piece_by_piece_builds_the_tree_appending_at_once_does():
    """The per-request tree grows as tokens arrive: one piece after another is one text."""
    rng = random.Random(0)
    text = [rng.randrange(4) for _ in range(200)]
    whole, pieces = SuffixTree(5), SuffixTree(5)
    whole.append(text)
    at = 0
    while at < len(text):
        n = rng.randint(1, 7)
        pieces.append(text[at:at + n])
        at += n
    assert counts(pieces) == counts(whole) and {p: c for p, (c, _) in counts(whole).items()} == runs([text], 5)
    # the proposer's shortcut: the open text's ends are the nodes of its last 1 .. depth - 1 tokens
    assert pieces.ends[1:] == pieces.suffixes(text) and len(pieces.ends) == 5


def test_nothing_spans_two_texts():
    tree = SuffixTree(4)
    tree.append([1, 2])
    tree.close()
    tree.append([3, 4])
    assert tree.find([2, 3]) is None and tree.find([1, 2]).count == 1 and tree.find([3, 4]).count == 1


def test_removing_a_text_takes_back_exactly_what_it_added():
    rng = random.Random(1)
    texts = [[rng.randrange(5) for _ in range(rng.randint(0, 40))] for _ in range(12)]
    tree = SuffixTree(4)
    for key, text in enumerate(texts):
        tree.append(text, owner=key)
        tree.close()
    for key in (3, 7, 0):
        tree.remove(texts[key], owner=key)
    kept = [t for key, t in enumerate(texts) if key not in (3, 7, 0)]
    assert {p: c for p, (c, _) in counts(tree).items()} == runs(kept, 4)
    assert tree.num_nodes == tree.root.size() == 1 + len(runs(kept, 4))
    for key, text in enumerate(texts):
        if key not in (3, 7, 0):
            tree.remove(text, owner=key)
    assert tree.num_nodes == 1 and tree.num_tokens == 0 and not tree.root.children


def test_the_walk_follows_the_most_frequent_continuation_while_it_is_likely():
    """After [1, 2]: 3 twice, 4 once; after [1, 2, 3]: 5 once, 6 once. The path's probability is
    the product of the steps': 2/3, then 2/3 * 1/2 = 1/3."""
    tree = SuffixTree(6)
    for text in ([1, 2, 3, 5], [1, 2, 4], [1, 2, 3, 6]):
        tree.append(text)
        tree.close()
    node = tree.find([1, 2])
    d = walk(node, 8, min_token_prob=0.1)
    assert d.tokens == [3, 5] and d.score == pytest.approx(2 / 3 + 1 / 3)   # 5 seen first: it wins the tie
    assert walk(node, 8, min_token_prob=0.5).tokens == [3]                   # 1/3 < 0.5: stop after 3
    assert walk(node, 8, min_token_prob=0.7).tokens == []                    # 2/3 < 0.7: nothing
    assert walk(node, 1, min_token_prob=0.1).tokens == [3]                   # the length limit


def test_the_end_of_a_text_is_no_evidence_against_a_continuation():
    """"1 2" occurred twice, the second time at the text's end (the request's own last tokens): the
    one time it went on, it went on with 3, so p(3) = 1, not 1/2."""
    tree = SuffixTree(6)
    tree.append([1, 2, 3, 1, 2])
    assert tree.find([1, 2]).count == 2
    assert walk(tree.find([1, 2]), 8, min_token_prob=0.9).tokens == [3, 1, 2]


def test_a_longer_match_earns_a_longer_draft():
    """max_spec_tokens = min(k, ceil(max_spec_factor * matched)): one token matched, one drafted at
    factor 1; the text 10..17 then 12 matches [12] alone ([20, 12] never occurred)."""
    tree = SuffixTree(24)
    text = [10, 11, 12, 13, 14, 15, 16, 17, 20, 12]
    tree.append(text)
    assert best_draft(tree.suffixes(text), 32, 1.0, 0.1).tokens == [13]
    assert best_draft(tree.suffixes(text), 32, 0.5, 0.1).tokens == [13]               # ceil(0.5) = 1
    assert best_draft(tree.suffixes(text), 32, 3.0, 0.1).tokens == [13, 14, 15]
    assert best_draft(tree.suffixes(text), 2, 10.0, 0.1).tokens == [13, 14]           # k caps it
    longer = text + [13, 14, 15]                                             # now [12, 13, 14, 15] matched
    tree.append([13, 14, 15])
    d = best_draft(tree.suffixes(longer), 32, 1.0, 0.1)
    assert d.match_length == 4 and d.tokens == [16, 17, 20, 12]


def test_match_and_draft_together_stay_within_the_depth():
    tree = SuffixTree(6)
    text = [1, 2, 3, 4, 5, 6, 7, 8] * 3
    tree.append(text)
    d = best_draft(tree.suffixes(text[-5:]), 32, 1.0, 0.1)      # m tokens matched: m drafted, up to 6 - m
    assert (d.match_length, d.tokens) == (3, [1, 2, 3])
    d = best_draft(tree.suffixes(text[-5:]), 32, 4.0, 0.1)      # 1 matched: 4 (5 - 1 left, factor 4); 2: 4 as well
    assert (d.match_length, d.tokens) == (2, [1, 2, 3, 4])


# ---------------------------------------------------------------- the global tree


def test_the_global_cache_evicts_the_least_recently_used():
    cache = GlobalSuffixCache(max_depth=4, max_cached_requests=2)
    cache.add([1, 2, 3])
    cache.add([4, 5, 6])
    cache.add([7, 8, 9])                        # nothing used: the oldest, [1, 2, 3], goes
    assert list(cache.texts.values()) == [[4, 5, 6], [7, 8, 9]] and cache.tree.find([1]) is None
    d = best_draft(cache.tree.suffixes([4, 5]), 4, 1.0, 0.1)
    assert d.tokens == [6]
    cache.touch(d.node)                         # drafted from [4, 5, 6]: now the most recently used
    cache.add([10, 11])
    assert list(cache.texts.values()) == [[4, 5, 6], [10, 11]] and cache.tree.find([7]) is None
    assert GlobalSuffixCache(4, 0).tree.num_nodes == 1       # 0: the global tree is off
    off = GlobalSuffixCache(4, 0)
    off.add([1, 2, 3])
    assert off.tree.num_nodes == 1 and not off.texts


def test_the_memory_bound_holds_under_a_long_random_run():
    """3,000 outputs of up to 60 tokens over 6 token ids (much shared), random drafts touching: at
    most max_cached_requests texts; never more than 1 + depth nodes per token held, so never more
    than 1 + depth * max_cached_requests * 60; the counts and owners always those of a tree built
    afresh from the texts kept; all removed, the root alone."""
    depth, cap, longest = 5, 8, 60
    rng = random.Random(2)
    cache = GlobalSuffixCache(depth, cap)
    for i in range(3000):
        cache.add([rng.randrange(6) for _ in range(rng.randint(0, longest))])
        tree = cache.tree
        assert len(cache.texts) <= cap
        assert tree.num_tokens == sum(map(len, cache.texts.values()))
        assert tree.num_nodes <= 1 + depth * tree.num_tokens <= 1 + depth * cap * longest
        context = [rng.randrange(6) for _ in range(4)]
        d = best_draft(tree.suffixes(context), 4, 1.0, 0.1)
        if d.tokens:
            cache.touch(d.node)
        if i % 100 == 0:
            assert tree.num_nodes == tree.root.size()
            fresh = SuffixTree(depth)
            for key, text in cache.texts.items():
                fresh.append(text, owner=key)
                fresh.close()
            assert counts(tree) == counts(fresh)
    for key, text in list(cache.texts.items()):
        cache.tree.remove(text, owner=key)
    assert cache.tree.num_nodes == 1


def test_a_request_tree_holds_at_most_depth_nodes_a_token():
    rng = random.Random(3)
    tree = SuffixTree(24)
    for _ in range(200):
        tree.append([rng.randrange(3) for _ in range(rng.randint(1, 10))])
        assert tree.num_nodes <= 1 + 24 * tree.num_tokens


# ---------------------------------------------------------------- the proposer


def decoding(prompt, output=(), max_tokens=64, **params):
    r = Request("r", list(prompt), SamplingParams(max_tokens=max_tokens, **params), max_tokens=max_tokens)
    r.output_token_ids = list(output)
    r.num_computed_tokens = r.num_tokens - 1      # decodes next
    r.status = RequestStatus.RUNNING
    return r


def proposer(k=8, depth=24, cached=10000, factor=1.0, prob=0.1):
    return SuffixProposer(k, depth, cached, factor, prob)


def test_drafts_what_repeated_text_predicts():
    r = decoding([5, 6, 7, 8, 9] * 4 + [5, 6])
    proposer()([r])
    assert r.spec_token_ids == [7, 8, 9, 5, 6, 7, 8, 9]           # k = 8 of them, 8 tokens matched


def test_nothing_to_match_nothing_drafted():
    r = decoding(list(range(10, 40)))
    p = proposer()
    p([r])
    assert r.spec_token_ids == []
    r2 = decoding([1, 2, 3, 1, 2], max_tokens=64)
    r2.num_computed_tokens = 2                    # in the middle of its prompt: no drafts
    p([r2])
    assert r2.spec_token_ids == []


def test_drafts_never_pass_max_tokens():
    r = decoding([5, 6, 7, 8, 9] * 3 + [5, 6], output=[7], max_tokens=4)
    proposer()([r])
    assert r.spec_token_ids == [8, 9]             # 4 - 1 output - 1 for the step's own token


def test_the_request_tree_follows_the_tokens():
    p = proposer()
    r = decoding([1, 2, 3, 4])
    p([r])
    r.output_token_ids += [1, 2]
    r.num_computed_tokens = r.num_tokens - 1
    p([r])
    assert p.trees[r].num_tokens == r.num_tokens == 6 and r.spec_token_ids == [3, 4]


def test_a_finished_output_drafts_for_the_next_request():
    """A finished request leaves `running` with is_finished set: its output goes to the global tree,
    its own tree goes; a preempted one keeps its tree and is not cached."""
    p = proposer()
    a = decoding([100, 101], output=[7, 8, 9, 10, 11])
    p([a])
    a.status = RequestStatus.FINISHED_LENGTH
    b = decoding([50, 51, 7, 8])
    p([b])
    assert a not in p.trees and list(p.cache.texts.values()) == [[7, 8, 9, 10, 11]]
    assert b.spec_token_ids == [9, 10]            # from a's output: [7, 8] matched, 2 drafted
    c = decoding([60, 61], output=[62])
    p([c])
    c.status = RequestStatus.PREEMPTED
    p([b])
    assert c in p.trees and len(p.cache.texts) == 1
    c.status = RequestStatus.FINISHED_ABORTED     # aborted while waiting
    p([b])
    assert c not in p.trees and len(p.cache.texts) == 2
    off = proposer(cached=0)
    off([a])
    off([b])
    assert b.spec_token_ids == []                 # max_cached_requests=0: no global tree


def test_the_better_scoring_tree_wins():
    """The request's own text says 9 after [7, 8] once in two (score 1/2 + 1/2); the cached outputs
    say 30, 31 always (score 2)."""
    p = proposer()
    for _ in range(3):
        p.cache.add([7, 8, 30, 31])
    r = decoding([7, 8, 9, 7, 8, 2, 7, 8])
    p([r])
    assert r.spec_token_ids == [30, 31]


# ---------------------------------------------------------------- the config


def suffix_config(**given):
    return SpeculativeConfig.from_dict({"method": "suffix", **given}, None, None)


def test_vllm_names_and_defaults():
    assert suffix_config() == SpeculativeConfig("suffix", 32, suffix_decoding_max_tree_depth=24,
                                                suffix_decoding_max_cached_requests=10000,
                                                suffix_decoding_max_spec_factor=1.0,
                                                suffix_decoding_min_token_prob=0.1)
    got = suffix_config(num_speculative_tokens=8, suffix_decoding_max_tree_depth=16,
                        suffix_decoding_max_cached_requests=0, suffix_decoding_max_spec_factor=2,
                        suffix_decoding_min_token_prob=0)
    assert (got.num_speculative_tokens, got.suffix_decoding_max_tree_depth, got.suffix_decoding_max_cached_requests,
            got.suffix_decoding_max_spec_factor, got.suffix_decoding_min_token_prob) == (8, 16, 0, 2, 0)


@pytest.mark.parametrize("given, match", [
    ({"suffix_decoding_max_tree_depth": 1}, r"suffix_decoding_max_tree_depth must be in \[2, inf\], got 1"),
    ({"suffix_decoding_max_tree_depth": 2.5}, r"suffix_decoding_max_tree_depth must be an integer, got 2.5"),
    ({"suffix_decoding_max_cached_requests": -1}, r"suffix_decoding_max_cached_requests must be in \[0, inf\], got -1"),
    ({"suffix_decoding_max_spec_factor": 0}, r"suffix_decoding_max_spec_factor must be in \(0, inf\], got 0"),
    ({"suffix_decoding_max_spec_factor": "2"}, r"suffix_decoding_max_spec_factor must be a number, got '2'"),
    ({"suffix_decoding_min_token_prob": 1.5}, r"suffix_decoding_min_token_prob must be in \[0, 1\], got 1.5"),
    ({"suffix_decoding_min_token_prob": float("nan")}, r"suffix_decoding_min_token_prob must be a finite number"),
    ({"num_speculative_tokens": 33}, r"num_speculative_tokens must be in \[1, 32\], got 33"),
    ({"prompt_lookup_max": 3}, r"prompt_lookup_max belongs to method 'ngram', not 'suffix'"),
    ({"model": "/models/small"}, r"method 'suffix' runs no draft model"),
])
def test_bad_suffix_configs(given, match):
    with pytest.raises(ValueError, match=match):
        suffix_config(**given)


def test_suffix_knobs_belong_to_suffix():
    with pytest.raises(ValueError, match=r"suffix_decoding_min_token_prob belongs to method 'suffix', not 'ngram'"):
        SpeculativeConfig.from_dict({"method": "ngram", "num_speculative_tokens": 2,
                                     "suffix_decoding_min_token_prob": 0.2}, None, None)


# ---------------------------------------------------------------- end to end


@pytest.fixture(autouse=True)
def one_thread():
    """Engines compared bit for bit run on one fixed thread (test_spec_decode.py: one_thread says why)."""
    with torch_threads(1):
        yield


def proposer_of(llm) -> SuffixProposer:
    return llm.llm_engine.find(SpeculativeDecoding).proposer


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_greedy_suffix_equals_plain_decoding(tiny_model_dirs, arch):
    """Preemption included (24 blocks): a preempted request keeps its tree and comes back to it."""
    prompts = repeating_prompts()
    plain = token_ids(engine(tiny_model_dirs[arch], num_kv_blocks=24), prompts, GREEDY)
    llm = engine(tiny_model_dirs[arch], SUFFIX, num_kv_blocks=24)
    assert token_ids(llm, prompts, GREEDY) == plain
    s, got = stats(llm), llm.get_stats()
    assert s.num_drafts > 0 and 0 < s.num_accepted_tokens < s.num_draft_tokens
    assert got["num_preemptions"] > 0
    pool = llm.llm_engine.scheduler.block_pool
    pool.check_invariants()
    assert pool.num_free_blocks == pool.num_blocks
    p = proposer_of(llm)
    assert not p.trees and len(p.cache.texts) == len(prompts)      # every output cached, no tree left


def test_a_second_run_drafts_from_the_first_runs_outputs(tiny_model_dirs):
    """Prompts with nothing to repeat: the second run's drafts come from the global tree (the first
    run's outputs, the same greedy tokens), and more of them are kept."""
    prompts = [{"prompt_token_ids": p} for p in
               [[random.Random(i).randrange(3, 500) for _ in range(12)] for i in range(4)]]
    llm = engine(tiny_model_dirs["llama"], SUFFIX)
    first = token_ids(llm, prompts, GREEDY)
    accepted = stats(llm).num_accepted_tokens
    assert token_ids(llm, prompts, GREEDY) == first
    assert stats(llm).num_accepted_tokens - accepted > max(accepted, 4 * 20)
    assert len(proposer_of(llm).cache.texts) == 8


def test_an_aborted_request_is_retired(tiny_model_dirs):
    llm = engine(tiny_model_dirs["llama"], SUFFIX)
    e = llm.llm_engine
    for i, prompt in enumerate(repeating_prompts(2)):
        e.add_request(str(i), prompt, SamplingParams(temperature=0, max_tokens=30, ignore_eos=True))
    for _ in range(3):
        e.step()
    assert len(proposer_of(llm).trees) == 2
    e.abort_request("0")
    while e.has_unfinished_requests():
        e.step()
    p = proposer_of(llm)
    assert not p.trees and len(p.cache.texts) == 2
    assert e.scheduler.block_pool.num_free_blocks == e.scheduler.block_pool.num_blocks


def test_sampled_output_keeps_its_distribution(tiny_model_dirs):
    """test_spec_decode.py's check, for suffix drafts: 5,000 tokens each, with and without."""
    model = tiny_model_dirs["llama"]
    plain = sampled_tokens(engine(model), {"temperature": 1.0}, 0)
    llm = engine(model, SUFFIX)
    fast = sampled_tokens(llm, {"temperature": 1.0}, 10_000)
    s = stats(llm)
    assert s.num_drafts > 1000 and 100 < s.num_accepted_tokens < s.num_draft_tokens
    assert set(fast) <= set(ALLOWED) and two_sample_chi2_passes(plain, fast)


def test_demo_model_greedy_suffix(demo_model_dir):
    """The real model on a repeating prompt: drafts accepted, output unchanged; run again, more
    accepted."""
    prompt = "one two three four five one two three four five one two three four five one two"
    p = SamplingParams(temperature=0, max_tokens=24)
    plain = token_ids(engine(demo_model_dir), [prompt], p)
    llm = engine(demo_model_dir, {"method": "suffix"})             # k = 32, vLLM's default for suffix
    assert token_ids(llm, [prompt], p) == plain
    first = stats(llm).num_accepted_tokens
    assert first > 0 and stats(llm).mean_acceptance_length > 1.5
    assert token_ids(llm, [prompt], p) == plain                      # again, the first output in the global tree
    assert stats(llm).num_accepted_tokens - first > first


def test_each_nodes_total_and_best_child_follow_the_counts():
    """A walk reads `total` and `best` instead of scanning the children: after random appends and
    LRU evictions, every node's are what a scan gives (its most frequent child, its children's sum)."""
    rng = random.Random(3)
    cache = GlobalSuffixCache(max_depth=5, max_cached_requests=4)
    for _ in range(60):
        cache.add([rng.randrange(6) for _ in range(rng.randrange(1, 12))])
    assert_counts_as_a_scan_gives(cache.tree)


def assert_counts_as_a_scan_gives(tree) -> None:
    """Every node's `total` is its children's counts summed, its `best` a most frequent child (None: no child)."""
    todo = [tree.root]
    while todo:
        node = todo.pop()
        todo.extend(node.children.values())
        assert node.total == sum(c.count for c in node.children.values())
        if node.children:
            assert node.best is node.children[node.best_token]
            assert node.best.count == max(c.count for c in node.children.values())
        else:
            assert node.best is None


def test_an_aborted_request_gives_up_its_tree_at_once(tiny_model_dirs):
    """Its tree is dropped and its output joins the global tree when it ends, not at a next step that
    may never come (a server whose only client left)."""
    llm = engine(tiny_model_dirs["llama"], SUFFIX)
    eng, proposer = llm.llm_engine, proposer_of(llm)
    eng.add_request("a", repeating_prompts(1)[0], GREEDY)
    for _ in range(3):
        eng.step()
    assert len(proposer.trees) == 1
    eng.abort_request("a")
    assert not proposer.trees and len(proposer.cache.texts) == 1
