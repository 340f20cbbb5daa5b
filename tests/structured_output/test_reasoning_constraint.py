"""Under a reasoning parser, a structured-output constraint holds the answer only (structured_output/manager.py).

A tiny random Qwen3 never closes a reasoning itself, so the rule is shown on the prompt: a prompt that
leaves the reasoning open gets free text, one whose last tag closed it gets the constrained text from
the first token; without a reasoning parser the constraint holds at once, whatever the prompt. The
manager's matcher is then fed an output that closes the reasoning. docs/08_server.md, "Reasoning output".
"""
import re

import pytest

from nanopaged import LLM, SamplingParams, StructuredOutputsParams

pytest.importorskip("xgrammar", reason="the structured extra: pip install -e '.[structured]'")

SETTINGS = dict(block_size=16, num_kv_blocks=64, max_num_seqs=8, dtype="float32")
DIGITS = SamplingParams(temperature=0, max_tokens=12, structured_outputs=StructuredOutputsParams(regex="[0-9]{12}"))
OPEN = "Question: why?\n<think>\n"
CLOSED = "Question: why?\n<think>\n\n</think>\n\n"


@pytest.fixture(scope="module")
def deepseek_llm(tiny_model_dirs):
    return LLM(tiny_model_dirs["qwen3"], reasoning_parser="deepseek_r1", **SETTINGS)


def digits(llm, prompt: str) -> bool:
    return re.fullmatch("[0-9]{12}", llm.generate([prompt], DIGITS)[0].outputs[0].text) is not None


def test_a_constraint_waits_while_the_prompt_leaves_the_reasoning_open(deepseek_llm):
    assert not digits(deepseek_llm, OPEN)            # still reasoning: free text


def test_a_constraint_holds_from_the_start_once_the_prompt_closed_the_reasoning(deepseek_llm):
    assert digits(deepseek_llm, CLOSED)


def test_without_a_reasoning_parser_the_constraint_holds_from_the_start(tiny_model_dirs):
    assert digits(LLM(tiny_model_dirs["qwen3"], **SETTINGS), OPEN)


def test_the_answer_starts_after_the_token_that_closes_the_reasoning(deepseek_llm):
    """The manager's matcher scans the reasoning for the end tag, then accepts the answer's tokens."""
    from nanopaged.structured_output.extension import StructuredOutputs
    manager = deepseek_llm.llm_engine.find(StructuredOutputs).manager
    tokenizer = deepseek_llm.llm_engine.tokenizer

    class Sequence:                     # what the manager reads of a request
        prompt_token_ids = tokenizer.encode(OPEN, add_special_tokens=False)
        sampling_params = DIGITS
        output_token_ids = tokenizer.encode("I think</think>12", add_special_tokens=False)
        num_output_tokens = len(output_token_ids)

    state = manager._matcher(Sequence)
    assert state.answering and state.num_accepted == Sequence.num_output_tokens and not state.ended
    manager.forget(Sequence)
    Sequence.output_token_ids = tokenizer.encode("still thinking </thin", add_special_tokens=False)
    Sequence.num_output_tokens = len(Sequence.output_token_ids)
    assert not manager._matcher(Sequence).answering
    manager.forget(Sequence)


@pytest.mark.parametrize("given, kept", [("qwen3", "qwen3"), ("deepseek_r1", "deepseek_r1"), ("", None), (None, None)])
def test_vllms_names_and_its_off_value_are_taken(tiny_model_dirs, given, kept):
    assert LLM(tiny_model_dirs["qwen3"], reasoning_parser=given, **SETTINGS).llm_engine.config.reasoning_parser == kept


def test_an_unknown_reasoning_parser_is_refused_naming_the_known_ones(tiny_model_dirs):
    with pytest.raises(ValueError, match=r"reasoning_parser 'r1' is not a reasoning parser; choose from "
                                         r"\['deepseek_r1', 'qwen3'\]"):
        LLM(tiny_model_dirs["qwen3"], reasoning_parser="r1", **SETTINGS)
