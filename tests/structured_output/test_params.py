"""StructuredOutputsParams and the SamplingParams field: vLLM's names, exactly one constraint, every
mistake a ValueError where it is made; vLLM's engine arguments for the backend, honoured or refused.
No model, no xgrammar: plain data."""
import dataclasses

import pytest

from nanopaged import SamplingParams, StructuredOutputsParams
from nanopaged.structured_output.params import ANY_OBJECT_SCHEMA, choice_grammar
from nanopaged.vllm_compat import engine_settings


def test_it_is_importable_where_vllm_has_it():
    from nanopaged.sampling_params import StructuredOutputsParams as where_vllm_has_it
    assert where_vllm_has_it is StructuredOutputsParams


@pytest.mark.parametrize("kwargs, kind, text", [
    ({"json": {"type": "object", "properties": {"b": {}, "a": {}}}}, "json",
     '{"type":"object","properties":{"b":{},"a":{}}}'),                # key order kept: it is the output's order
    ({"json": '{"type": "object",\n "properties": {"b": {}, "a": {}}}'}, "json",
     '{"type":"object","properties":{"b":{},"a":{}}}'),                # a schema's text and its dict: one key
    ({"json_object": True}, "json", ANY_OBJECT_SCHEMA),
    ({"regex": "[a-z]+"}, "regex", "[a-z]+"),
    ({"choice": ["yes", "no"]}, "grammar", 'root ::= "yes" | "no"'),
    ({"grammar": 'root ::= "a"'}, "grammar", 'root ::= "a"'),
])
def test_each_constraint_becomes_one_kind_and_one_text(kwargs, kind, text):
    assert StructuredOutputsParams(**kwargs).constraint() == (kind, text)


def test_a_choice_is_quoted_so_any_string_is_safe():
    grammar = choice_grammar(['say "hi"', "back\\slash", "new\nline", "ü"])
    assert grammar == 'root ::= "say \\"hi\\"" | "back\\\\slash" | "new\\nline" | "\\u00fc"'


@pytest.mark.parametrize("kwargs, match", [
    ({}, r"exactly one constraint of .* got 0"),
    ({"json": {}, "regex": "a"}, r"exactly one constraint .* got 2: json, regex"),
    ({"regex": "a", "json_object": True}, r"got 2: regex, json_object"),
    ({"choice": []}, r"structured_outputs\.choice is empty"),
    ({"choice": "yes"}, r"structured_outputs\.choice must be a list of strings"),
    ({"choice": ["a", 1]}, r"structured_outputs\.choice must be a list of strings"),
    ({"regex": 5}, r"structured_outputs\.regex must be a string"),
    ({"grammar": "  "}, r"structured_outputs\.grammar is empty"),
    ({"json": 3}, r"structured_outputs\.json must be a JSON schema"),
    ({"json_object": False}, r"structured_outputs\.json_object must be True"),
    ({"regex": "a", "disable_any_whitespace": "yes"}, r"disable_any_whitespace must be True or False"),
    ({"regex": "a", "whitespace_pattern": r"\s?"}, r"whitespace_pattern=.* is not supported"),
    ({"structural_tag": "{}"}, r"structural_tag='\{\}' is not supported"),
])
def test_a_malformed_constraint_fails_where_it_is_made(kwargs, match):
    with pytest.raises(ValueError, match=match):
        StructuredOutputsParams(**kwargs)


def test_a_schema_that_is_not_json_is_named():
    with pytest.raises(ValueError, match=r"structured_outputs\.json is not valid JSON"):
        StructuredOutputsParams(json="{not json").constraint()


def test_sampling_params_takes_it_as_a_keyword_and_checks_its_type():
    constraint = StructuredOutputsParams(regex="[0-9]+")
    assert SamplingParams(max_tokens=4, structured_outputs=constraint).structured_outputs is constraint
    with pytest.raises(ValueError, match=r"structured_outputs must be a StructuredOutputsParams, got dict"):
        SamplingParams(structured_outputs={"json": {}})
    field = next(f for f in dataclasses.fields(SamplingParams) if f.name == "structured_outputs")
    assert field.kw_only and field.default is None                   # keyword-only, as vLLM's later fields


def test_min_tokens_is_refused_with_a_constraint():
    """A complete grammar allows only EOS, which min_tokens holds back: no token would be left to draw."""
    with pytest.raises(ValueError, match=r"min_tokens=3 cannot be combined with structured_outputs"):
        SamplingParams(min_tokens=3, structured_outputs=StructuredOutputsParams(regex="a+"))


def test_guided_decoding_is_refused_pointing_at_its_new_name():
    with pytest.raises(ValueError, match=r"guided_decoding=.* is not supported: .*give structured_outputs="):
        SamplingParams(guided_decoding={"json": {}})


@pytest.mark.parametrize("kwargs", [{"structured_outputs_config": {"backend": "xgrammar"}},
                                    {"structured_outputs_config": None}, {"guided_decoding_backend": "auto"},
                                    {"guided_decoding_disable_fallback": True},
                                    {"guided_decoding_disable_additional_properties": True}])
def test_vllms_backend_arguments_that_ask_for_xgrammar_are_accepted(kwargs):
    assert engine_settings(kwargs, set()) == {}


@pytest.mark.parametrize("kwargs, match", [
    ({"structured_outputs_config": {"backend": "guidance"}}, r"runs structured outputs on xgrammar"),
    ({"guided_decoding_backend": "outlines"}, r"runs structured outputs on xgrammar only"),
    ({"guided_decoding_disable_any_whitespace": True}, r"takes disable_any_whitespace per request"),
])
def test_vllms_backend_arguments_that_ask_for_another_are_refused(kwargs, match):
    with pytest.raises(ValueError, match=match):
        engine_settings(kwargs, set())


def test_plain_data_needs_no_xgrammar():
    """The params module imports nothing heavy: the core's installs stay small without the extra."""
    import subprocess
    import sys
    program = ("import sys; sys.modules['xgrammar'] = None; from nanopaged import SamplingParams, "
               "StructuredOutputsParams; SamplingParams(structured_outputs=StructuredOutputsParams(json={})); "
               "print('ok')")
    done = subprocess.run([sys.executable, "-c", program], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0 and done.stdout.strip() == "ok", done.stderr[-2000:]
