"""Structured outputs on the demo model: every output follows its constraint, and the constraint
changes nothing else.

Sampled at temperature 1.0, 200 JSON outputs validate against a nested schema (jsonschema), regex
outputs fullmatch, choices are in the list, grammar outputs parse with a parser written here. Greedy
constrained output equals Hugging Face's model masked by the same backend, token by token; n > 1,
seeds, prefix caching, logprobs and stop strings still hold; a bad constraint is a ValueError before
anything is queued. float32 wherever tokens are compared (dtype="auto" is bfloat16 on CPUs with
bf16 matrix units, where a batch may round a choice the other way). The engine's side (mixed
batches, preemption, the hooks) is test_engine_hooks.py, on a tiny model; the server's,
tests/entrypoints/test_serve_structured.py. docs/10_structured_outputs.md explains it.
"""
import json
import re

import pytest

pytest.importorskip("xgrammar", reason="the structured extra: pip install -e '.[structured]'")
jsonschema = pytest.importorskip("jsonschema", reason="the test extra: pip install -e '.[test]'")

from nanopaged import LLM, SamplingParams, StructuredOutputsParams  # noqa: E402
from nanopaged.structured_output.extension import StructuredOutputs  # noqa: E402

SCHEMA = {                  # nested objects, an array, enums, an integer and a number, each bounded
    "type": "object",
    "properties": {
        "role": {"type": "string", "enum": ["admin", "user", "guest"]},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "score": {"type": "number", "minimum": 0, "maximum": 10},
        "tags": {"type": "array", "items": {"type": "string", "enum": ["a", "b", "c"]}, "maxItems": 2},
        "home": {"type": "object",
                 "properties": {"zip": {"type": "string", "pattern": "[0-9]{3}"},
                                "floor": {"type": "integer", "minimum": -2, "maximum": 9}},
                 "required": ["zip", "floor"]},
    },
    "required": ["role", "age", "score", "tags", "home"],
}
# A small grammar: one to three assignments, each a name and a number or a short list of numbers.
GRAMMAR = r"""
root ::= stmt (";" stmt){0,2}
stmt ::= name "=" value
name ::= [a-z]{1,6}
value ::= num | "[" num ("," num){0,2} "]"
num ::= "0" | [1-9] [0-9]{0,2}
"""


@pytest.fixture(scope="module")
def llm(demo_model_dir):
    """For outputs checked against their constraint: the default dtype (bfloat16 where the CPU has bf16
    matrix units), the faster one; tests that compare tokens use `llm32`."""
    return LLM(demo_model_dir, num_kv_blocks=1024, max_num_seqs=256)


@pytest.fixture(scope="module")
def llm32(demo_model_dir):
    return LLM(demo_model_dir, dtype="float32", num_kv_blocks=256)


@pytest.fixture(scope="module")
def chat(llm):
    def render(text):
        return llm.get_tokenizer().apply_chat_template([{"role": "user", "content": text}], tokenize=False,
                                                       add_generation_prompt=True)
    return render


def constrained(temperature=1.0, max_tokens=128, **constraint):
    options = {k: constraint.pop(k) for k in ("disable_any_whitespace",) if k in constraint}
    sampling = {k: constraint.pop(k) for k in ("n", "seed", "stop", "logprobs", "ignore_eos") if k in constraint}
    return SamplingParams(temperature=temperature, max_tokens=max_tokens, **sampling,
                          structured_outputs=StructuredOutputsParams(**constraint, **options))


def texts(outs):
    return [c.text for o in outs for c in o.outputs]


# ---- every output follows its constraint -------------------------------------------------------
def test_200_sampled_json_outputs_validate_against_a_nested_schema(llm, chat):
    prompt = chat("Describe a user of a web site as JSON with a role, age, score, tags and home.")
    outs = llm.generate([prompt] * 200, constrained(json=SCHEMA, disable_any_whitespace=True, seed=None),
                        use_tqdm=False)
    assert [c.finish_reason for o in outs for c in o.outputs] == ["stop"] * 200
    for text in texts(outs):
        jsonschema.validate(json.loads(text), SCHEMA)
    assert len(set(texts(outs))) > 20        # temperature 1.0: they are samples, not one answer


def test_regex_outputs_fullmatch(llm, chat):
    pattern = r"[A-Z][a-z]{2,8} [0-9]{2}-[0-9]{4}( \(ok\))?"
    outs = llm.generate(chat("A name and a date code:"), constrained(regex=pattern, n=16, seed=7), use_tqdm=False)
    assert all(re.fullmatch(pattern, t) for t in texts(outs)), texts(outs)


def test_choice_outputs_are_in_the_list(llm, chat):
    choices = ["positive", "negative", "neutral", 'it "depends"\n']
    outs = llm.generate([chat("Is this review positive? 'Great food, slow service.'")] * 24,
                        constrained(choice=choices, seed=None), use_tqdm=False)
    assert set(texts(outs)) <= set(choices) and len(texts(outs)) == 24


def parse_statements(text: str) -> list:
    """A recursive-descent parser of GRAMMAR's language, written apart from the grammar: [(name, value)]."""
    pos = 0

    def take(pred, lo, hi):
        nonlocal pos
        start = pos
        while pos < len(text) and pos - start < hi and pred(text[pos]):
            pos += 1
        assert pos - start >= lo, f"expected {lo}..{hi} characters at {start} in {text!r}"
        return text[start:pos]

    def expect(char):
        nonlocal pos
        assert text[pos:pos + 1] == char, f"expected {char!r} at {pos} in {text!r}"
        pos += 1

    def number():
        digits = take(str.isdigit, 1, 4)
        assert digits == "0" or (digits[0] != "0" and len(digits) <= 3), digits
        return int(digits)

    def value():
        if text[pos:pos + 1] != "[":
            return number()
        expect("[")
        items = [number()]
        while text[pos:pos + 1] == "," and len(items) < 3:
            expect(",")
            items.append(number())
        expect("]")
        return items

    statements = []
    while True:
        name = take(lambda c: "a" <= c <= "z", 1, 6)
        expect("=")
        statements.append((name, value()))
        if pos == len(text):
            return statements
        assert len(statements) < 3, f"more than three statements in {text!r}"
        expect(";")


def test_grammar_outputs_parse_with_a_reference_parser(llm, chat):
    outs = llm.generate(chat("Write a few variable assignments."), constrained(grammar=GRAMMAR, n=24, seed=3),
                        use_tqdm=False)
    for text in texts(outs):
        assert 1 <= len(parse_statements(text)) <= 3


def test_a_parser_check_of_the_parser():
    assert parse_statements("ab=1;c=[0,12,345]") == [("ab", 1), ("c", [0, 12, 345])]
    for bad in ("a=01", "a=1;", "A=1", "a=[1,2,3,4]", "a=1;b=2;c=3;d=4", "a=1234"):
        with pytest.raises(AssertionError):
            parse_statements(bad)


# ---- the same tokens as a reference ---------------------------------------------------------------
def hf_masked_greedy(model_dir, llm, prompt_ids, params, max_tokens):
    """Hugging Face's greedy `generate`, each step's logits masked by a matcher of the same backend
    (xgrammar, the same compiled grammar) with xgrammar's own kernel: the reference."""
    import torch
    import xgrammar as xgr
    from transformers import AutoModelForCausalLM, LogitsProcessor, LogitsProcessorList

    class GrammarMask(LogitsProcessor):
        def __init__(self):
            self.matcher = xgr.GrammarMatcher(llm.llm_engine.extension(StructuredOutputs).manager.grammar(params))
            self.bitmask = xgr.allocate_token_bitmask(1, llm.llm_engine.config.model_config.vocab_size)

        def __call__(self, input_ids, scores):
            if input_ids.shape[1] > len(prompt_ids):                  # the token chosen last step
                assert self.matcher.accept_token(int(input_ids[0, -1]))
            self.matcher.fill_next_token_bitmask(self.bitmask)
            scores = scores.float()
            xgr.apply_token_bitmask_inplace(scores, self.bitmask)
            return scores

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32, local_files_only=True).eval()
    ids = torch.tensor([prompt_ids])
    with torch.inference_mode():
        out = model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=max_tokens,
                             logits_processor=LogitsProcessorList([GrammarMask()]), pad_token_id=0)
    return out[0, len(prompt_ids):].tolist()


@pytest.mark.parametrize("constraint", [{"json": SCHEMA, "disable_any_whitespace": True},
                                        {"regex": r"(yes|no), because [a-z ]{5,20}\."},
                                        {"grammar": GRAMMAR}], ids=["json", "regex", "grammar"])
def test_greedy_constrained_output_equals_hugging_face_masked_by_the_same_backend(llm32, chat, demo_model_dir,
                                                                                 constraint):
    prompt = llm32.get_tokenizer().encode(chat("Answer in the required format: is the sky blue?"))
    params = constrained(temperature=0, max_tokens=128, **constraint)
    out = llm32.generate({"prompt_token_ids": prompt}, params, use_tqdm=False)[0].outputs[0]
    assert out.finish_reason == "stop"                     # the whole grammar, its EOS the last token
    assert out.token_ids == hf_masked_greedy(demo_model_dir, llm32, prompt, params.structured_outputs, 128)


# ---- what the engine already does still holds ------------------------------------------------------
def test_n_samples_each_follow_the_grammar_with_their_own_matcher(llm, chat):
    out = llm.generate(chat("A person as JSON:"), constrained(json=SCHEMA, disable_any_whitespace=True, n=6,
                                                             seed=11), use_tqdm=False)[0]
    assert len(out.outputs) == 6 and len({c.text for c in out.outputs}) > 1
    for c in out.outputs:
        jsonschema.validate(json.loads(c.text), SCHEMA)


def test_a_seed_gives_the_same_constrained_output_in_any_batch(llm32, chat):
    params = constrained(json=SCHEMA, disable_any_whitespace=True, seed=5)
    alone = llm32.generate(chat("A person as JSON:"), params, use_tqdm=False)[0].outputs[0].text
    others = [chat("Another one."), chat("And one more.")]
    batch = llm32.generate([chat("A person as JSON:")] + others, [params] + [constrained(regex="[a-z]{3,9}")] * 2,
                           use_tqdm=False)
    assert batch[0].outputs[0].text == alone


def test_prefix_caching_serves_a_constrained_prompt_again(llm, chat):
    params = constrained(regex=r"[0-9]{4}", temperature=0)
    first, again = (llm.generate(chat("A four-digit year, with a long preamble " * 8), params, use_tqdm=False)[0]
                    for _ in range(2))
    assert again.num_cached_tokens > 0 and again.outputs[0].text == first.outputs[0].text


def test_logprobs_are_of_the_masked_distribution(llm, chat):
    """As vLLM: the grammar's mask comes before the sampler, so the logprobs it reports are of the
    distribution renormalised over the allowed tokens; the forbidden ones have logprob -inf."""
    import math
    out = llm.generate(chat("Yes or no?"), constrained(choice=["yes", "no"], logprobs=5, seed=0),
                       use_tqdm=False)[0].outputs[0]
    first = out.logprobs[0]
    allowed = {t: lp.logprob for t, lp in first.items() if lp.logprob > -math.inf}
    assert sum(math.exp(lp) for lp in allowed.values()) == pytest.approx(1.0, abs=1e-4)
    assert {llm.get_tokenizer().decode([t]) for t in allowed} <= {"yes", "no", "y", "n", "ye"}
    assert out.cumulative_logprob == pytest.approx(sum(d[t].logprob for t, d in zip(out.token_ids, out.logprobs)))


def test_a_stop_string_still_cuts_a_constrained_output(llm, chat):
    out = llm.generate(chat("Go:"), constrained(regex=r"[a-z]{3} END [a-z]{3}", stop=[" END"], seed=2),
                       use_tqdm=False)[0].outputs[0]
    assert re.fullmatch(r"[a-z]{3}", out.text) and out.finish_reason == "stop" and out.stop_reason == " END"


def test_the_grammar_end_stops_a_request_even_with_ignore_eos(llm, chat):
    out = llm.generate(chat("Yes or no?"), constrained(choice=["yes", "no"], ignore_eos=True, max_tokens=50),
                       use_tqdm=False)[0].outputs[0]
    assert out.text in ("yes", "no") and out.finish_reason == "stop" and len(out.token_ids) < 50


def test_each_constraint_compiles_once(llm, chat):
    manager = llm.llm_engine.extension(StructuredOutputs).manager
    schema = {"type": "object", "properties": {"once": {"type": "boolean"}}, "required": ["once"]}
    before = len(manager.compiles)
    for _ in range(3):
        llm.generate([chat("x")] * 2, constrained(json=json.dumps(schema), temperature=0), use_tqdm=False)
    llm.generate(chat("x"), constrained(json=schema, temperature=0), use_tqdm=False)   # the same, as a dict
    assert len(manager.compiles) == before + 1


# ---- bad input: refused before queueing, the engine goes on --------------------------------------
@pytest.mark.parametrize("constraint, match", [
    ({"json": {"type": "objec"}}, r"structured_outputs\.json cannot be followed: Unsupported type \"objec\""),
    ({"json": "{not json"}, r"structured_outputs\.json is not valid JSON"),
    ({"regex": "[a-"}, r"structured_outputs\.regex='\[a-' cannot be followed: Regex parsing error"),
    ({"regex": r"[^\x00-\U0010FFFF]"}, r"structured_outputs\.regex=.* matches no text at all"),
    ({"grammar": 'root ::= "a" |'}, r"structured_outputs\.grammar=.* cannot be followed: EBNF parser error"),
    ({"grammar": 'start ::= "a"'}, r"The root rule with name \"root\" is not found"),
    ({"choice": []}, r"structured_outputs\.choice is empty"),
])
def test_a_bad_constraint_is_a_value_error_before_queueing(llm, chat, constraint, match):
    good = chat("fine")
    with pytest.raises(ValueError, match=match):
        llm.generate([good, good], [constrained(regex="[a-z]{2}"), constrained(**constraint)], use_tqdm=False)
    assert not llm.llm_engine.has_unfinished_requests()          # the good prompt was not queued either
    again = llm.generate(good, constrained(regex="[a-z]{2}"), use_tqdm=False)[0].outputs[0]
    assert re.fullmatch("[a-z]{2}", again.text)
