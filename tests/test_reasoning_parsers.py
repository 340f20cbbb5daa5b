"""Reasoning parsers (nanopaged/reasoning.py): the split of a whole output, and the same split streamed.

Each parser's rule on a whole text; then every text cut one character at a time, at every tag
boundary and at random, must add up to the whole split; a tail that may be the start of a tag is
held back until the next characters say what it is.
"""
import random

import pytest

from nanopaged.reasoning import REASONING_PARSERS, ReasoningStream, check_reasoning_parser, split_reasoning

TEXTS = ["<think>\nthe user greets me\n</think>\n\nHello!", "<think></think>Hi", "no tags at all",
         "reasoning with no opening tag</think>the answer", "<think>cut off by max_tokens",
         "before<think>inside</think>after", "<think>a < b and </thin is not a tag</think>ok",
         "</think>", "<think>", "", "<thin", "answer then </think> late", "<think>x</think>y</think>z<think>w"]


@pytest.mark.parametrize("name, text, split", [
    ("qwen3", "<think>\nplan\n</think>\n\nHello!", ("\nplan\n", "\n\nHello!")),
    ("qwen3", "no tags at all", (None, "no tags at all")),
    ("qwen3", "before<think>inside</think>after", ("inside", "beforeafter")),
    ("qwen3", "<think>cut off", ("cut off", None)),
    ("qwen3", "reasoning?</think>answer", (None, "reasoning?</think>answer")),
    ("deepseek_r1", "reasoning with no opening tag</think>the answer", ("reasoning with no opening tag", "the answer")),
    ("deepseek_r1", "<think>plan</think>Hello", ("plan", "Hello")),
    ("deepseek_r1", "no end tag: all reasoning", ("no end tag: all reasoning", None)),
    ("deepseek_r1", "<think></think>Hi", (None, "Hi")),
    ("deepseek_r1", "x</think>y</think>z", ("x", "y</think>z")),
])
def test_each_parser_splits_a_whole_output_by_its_rule(name, text, split):
    assert split_reasoning(name, text) == split


def streamed(name: str, text: str, cuts: list[int]) -> tuple[str | None, str | None]:
    """The split as a client adds up a stream fed text[:cut] for each cut, then the whole text as final."""
    stream, reasoning, content = ReasoningStream(REASONING_PARSERS[name]), "", ""
    for cut in cuts:
        r, c = stream.feed(text, cut, final=False)
        reasoning, content = reasoning + r, content + c
    r, c = stream.feed(text, len(text), final=True)
    return (reasoning + r) or None, (content + c) or None


@pytest.mark.parametrize("name", sorted(REASONING_PARSERS))
@pytest.mark.parametrize("text", TEXTS)
def test_streamed_a_character_at_a_time_equals_whole(name, text):
    assert streamed(name, text, list(range(1, len(text) + 1))) == split_reasoning(name, text)


@pytest.mark.parametrize("name", sorted(REASONING_PARSERS))
def test_tags_cut_anywhere_across_chunks_split_as_whole(name):
    rng = random.Random(0)
    for text in TEXTS:
        for _ in range(30):
            cuts = sorted(rng.sample(range(len(text) + 1), k=min(len(text) + 1, rng.randint(1, 6))))
            assert streamed(name, text, cuts) == split_reasoning(name, text), (text, cuts)


def test_a_tail_that_may_be_a_tag_is_held_back_until_it_is_known():
    stream = ReasoningStream(REASONING_PARSERS["deepseek_r1"])
    assert stream.feed("plan</thi", 9, final=False) == ("plan", "")       # "</thi" may be the end tag
    assert stream.feed("plan</thing", 11, final=False) == ("</thing", "")  # it was not
    qwen = ReasoningStream(REASONING_PARSERS["qwen3"])
    assert qwen.feed("Hi <th", 6, final=False) == ("", "Hi ")
    assert qwen.feed("Hi <think>why", 13, final=False) == ("why", "")


def test_no_tags_is_all_answer_for_qwen3_and_all_reasoning_for_deepseek_r1():
    assert split_reasoning("qwen3", "plain text") == (None, "plain text")
    assert split_reasoning("deepseek_r1", "plain text") == ("plain text", None)


def test_an_unknown_parser_is_refused_naming_the_known_ones():
    assert check_reasoning_parser("qwen3") == "qwen3" and check_reasoning_parser(None) is None
    with pytest.raises(ValueError, match=r"'granite' is not a reasoning parser; choose from \['deepseek_r1', 'qwen3'\]"):
        check_reasoning_parser("granite")
