"""The n-gram proposer (vLLM: v1/spec_decode/ngram_proposer.py): the longest n first, the earliest
match, at most k tokens; and which requests may draft at all."""
import pytest

from nanopaged.core.request import Request
from nanopaged.sampling_params import SamplingParams
from nanopaged.spec_decode.ngram_proposer import NgramProposer, draft_budget, propose_ngram


@pytest.mark.parametrize("tokens, k, longest, shortest, drafts", [
    ([1, 2, 3, 4, 1, 2, 3], 3, 3, 1, [4, 1, 2]),          # the 3-gram [1, 2, 3] occurred at 0
    ([1, 2, 3, 4, 1, 2, 3], 1, 3, 1, [4]),                # at most k
    ([1, 2, 3, 4, 1, 2, 3, 4, 1, 2], 3, 2, 2, [3, 4, 1]),  # two matches, the same tokens after both
    ([5, 1, 2, 9, 7, 1, 2], 2, 3, 2, [9, 7]),             # no 3-gram match: the 2-gram [1, 2]
    ([7, 1, 2, 8, 3, 1, 2], 2, 3, 1, [8, 3]),
    ([9, 2, 3, 5, 3], 2, 3, 1, [5, 3]),                   # only the 1-gram [3] matches
    ([9, 2, 3, 5, 3], 2, 3, 2, []),                       # ... which is below prompt_lookup_min
    ([1, 2, 3, 4], 3, 3, 1, []),                          # nothing repeats
    ([4], 3, 3, 1, []),
    ([1, 1, 1, 1], 2, 3, 1, [1]),                         # the earliest 3-gram leaves one token after it
    ([1, 2, 1, 2], 4, 2, 2, [1, 2]),                      # fewer than k follow the match
])
def test_propose_ngram(tokens, k, longest, shortest, drafts):
    assert propose_ngram(tokens, k, longest, shortest) == drafts


@pytest.mark.parametrize("tokens, k, longest, shortest, drafts", [
    ([1, 2, 3, 1, 2, 4, 1, 2], 2, 2, 2, [3, 1]),          # [1, 2] at 0 and at 3: 0's [3, 1], not 3's [4, 1]
    ([1, 2, 3, 100, 1, 2, 3, 200, 1, 2, 3, 300, 1, 2, 3], 2, 3, 3, [100, 1]),   # vLLM's test: three matches
    ([7, 5, 7, 6, 7], 1, 1, 1, [5]),                      # [7] at 0 and at 2
    ([9, 9, 8, 9, 9, 7, 9, 9], 3, 2, 1, [8, 9, 9]),       # [9, 9] at 0 and at 3: [8, 9, 9], not [7, 9, 9]
])
def test_the_earliest_of_several_matches_gives_the_drafts(tokens, k, longest, shortest, drafts):
    """Matches of one length followed by different tokens: the first in the text wins (vLLM's
    prompt lookup, "always pick the first one"), wherever a later one is."""
    assert propose_ngram(tokens, k, longest, shortest) == drafts


@pytest.mark.parametrize("tokens, k, longest, shortest, drafts", [
    ([2, 3, 4, 5, 1, 2, 3, 4, 1, 2, 3, 4], 2, 4, 3, [1, 2]),   # vLLM's test: the 4-gram at 4, not the 3-gram at 0
    ([3, 4, 5, 2, 3, 4, 1, 2, 3, 4], 2, 4, 2, [1, 2]),         # vLLM's: no 4-gram; the 3-gram at 3, not the 2-gram at 0
    ([4, 6, 1, 4, 7, 8, 1, 4], 2, 3, 1, [7, 8]),               # the 2-gram at 2, not the 1-gram [4] at 0
])
def test_the_longest_n_wins_over_an_earlier_shorter_match(tokens, k, longest, shortest, drafts):
    """n goes from prompt_lookup_max down: a longer suffix found anywhere beats a shorter one found
    earlier, as vLLM's `_find_longest_matched_ngram_and_propose_tokens` does."""
    assert propose_ngram(tokens, k, longest, shortest) == drafts


def decoding(prompt, output, max_tokens=16, **params):
    r = Request("r", prompt, SamplingParams(max_tokens=max_tokens, **params), max_tokens=max_tokens)
    r.output_token_ids = list(output)
    r.num_computed_tokens = r.num_tokens - 1      # decodes next
    return r


def test_only_a_request_that_decodes_next_gets_drafts():
    r = decoding([1, 2, 3, 1, 2], [3])
    NgramProposer(3, 3, 1)([r])
    assert r.spec_token_ids == [1, 2, 3]
    r.spec_token_ids, r.num_computed_tokens = [], 2   # in the middle of its prompt
    NgramProposer(3, 3, 1)([r])
    assert r.spec_token_ids == []


def test_drafts_never_pass_max_tokens():
    """A verify step emits the accepted drafts and one more: drafts <= max_tokens - output - 1."""
    assert draft_budget(decoding([1, 2], [3, 4], max_tokens=6), 5) == 3
    assert draft_budget(decoding([1, 2], [3, 4], max_tokens=8), 5) == 5
    assert draft_budget(decoding([1, 2], [3, 4], max_tokens=3), 5) == 0
    r = decoding([1, 2, 3, 1, 2], [3, 1], max_tokens=4)
    NgramProposer(5, 3, 1)([r])
    assert r.spec_token_ids == [2]


def test_a_request_with_a_grammar_is_not_drafted():
    from nanopaged.structured_output.params import StructuredOutputsParams
    r = decoding([1, 2, 1], [2], structured_outputs=StructuredOutputsParams(choice=["a", "b"]))
    assert draft_budget(r, 3) == 0
