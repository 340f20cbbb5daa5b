"""Stop strings: bounded in number and length, and matched at a cost per new character that does not
grow with their number (engine/detokenizer.py: StopMatcher), with the same answers as searching for
each stop string in the text's new tail (vLLM's check_stop_strings). docs/04_scheduler.md, "Stopping".
"""
import random

import pytest

from nanopaged.core.request import Request
from nanopaged.engine import detokenizer
from nanopaged.engine.detokenizer import StopMatcher, find_stop_string
from nanopaged.engine.output_processor import check_stop
from nanopaged.sampling_params import MAX_STOP_STRING_CHARS, MAX_STOP_STRINGS, SamplingParams


def search_each(text: str, new_chars: int, stops: list[str], include: bool):
    """The reference: each stop string searched for in the window the new characters can complete."""
    best = None
    for stop in stops:
        start = text.find(stop, max(0, len(text) - new_chars - len(stop) + 1))
        if start != -1 and (best is None or start + len(stop) < best[0]):
            best = (start + len(stop), start, stop)
    return None if best is None else (best[2], best[0] if include else best[1])


def test_the_matcher_finds_what_searching_each_stop_string_finds():
    rng = random.Random(0)
    for _ in range(2000):
        stops = ["".join(rng.choice("ab") for _ in range(rng.randint(1, 4))) for _ in range(rng.randint(1, 5))]
        text, include = "".join(rng.choice("abc") for _ in range(rng.randint(1, 30))), rng.random() < 0.5
        matcher = StopMatcher(stops)
        # the text arrives a few characters at a time, up to the first hit
        cuts = sorted(rng.sample(range(1, len(text) + 1), k=min(len(text), rng.randint(1, 6))))
        if cuts[-1] != len(text):
            cuts.append(len(text))
        last = 0
        for cut in cuts:
            got = matcher.hit(text[:cut], cut - last, include)
            assert got == search_each(text[:cut], cut - last, stops, include), (stops, text[:cut], cut - last)
            if got is not None:
                break
            last = cut
        # and the one-shot form agrees too
        assert find_stop_string(text, len(text), stops, include) == search_each(text, len(text), stops, include)


class CharTokenizer:
    """One character per token id (ord), enough for the detokenizer's windows."""
    def decode(self, ids, **_):
        return "".join(chr(i) for i in ids)


def test_stop_matching_looks_at_each_new_character_once_whatever_the_number_of_stops(monkeypatch):
    fed = []
    real = StopMatcher.feed
    monkeypatch.setattr(StopMatcher, "feed", lambda self, text: fed.append(len(text)) or real(self, text))
    stops = [f"never-{i:04d}-" + "x" * 100 for i in range(MAX_STOP_STRINGS)]
    text = "the quick brown fox " * 50                # 1,000 characters, one token each
    request = Request("r", [ord("a")], SamplingParams(stop=stops, max_tokens=len(text) + 1), len(text) + 1)
    detok = detokenizer.IncrementalDetokenizer(CharTokenizer(), request.prompt_token_ids, skip_special_tokens=True)
    for ch in text:
        request.output_token_ids.append(ord(ch))
        assert check_stop(request, detok) is None
    assert detok.text == text
    assert sum(fed) <= len(text)                    # each character matched once, not once per stop string


def test_a_stop_string_is_still_found_across_tokens_and_after_min_tokens():
    params = SamplingParams(stop=["ab"], min_tokens=3, max_tokens=10)
    request = Request("r", [ord("z")], params, 10)
    detok = detokenizer.IncrementalDetokenizer(CharTokenizer(), request.prompt_token_ids, skip_special_tokens=True)
    results = []
    for ch in "abxab":
        request.output_token_ids.append(ord(ch))
        results.append(check_stop(request, detok))
    assert results[:4] == [None] * 4                # "ab" at tokens 1-2 is before min_tokens: it does not count
    assert results[4] is not None and results[4][1] == "ab" and detok.text == "abx"


def test_too_many_stop_strings_or_one_too_long_is_refused_naming_the_limit():
    with pytest.raises(ValueError, match=f"MAX_STOP_STRINGS={MAX_STOP_STRINGS}"):
        SamplingParams(stop=[f"s{i}" for i in range(MAX_STOP_STRINGS + 1)])
    with pytest.raises(ValueError, match=f"MAX_STOP_STRING_CHARS={MAX_STOP_STRING_CHARS}"):
        SamplingParams(stop=["x" * (MAX_STOP_STRING_CHARS + 1)])
    SamplingParams(stop=["x" * MAX_STOP_STRING_CHARS] * MAX_STOP_STRINGS)      # at the limits: fine
