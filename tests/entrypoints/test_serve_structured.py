"""`nanopaged serve` with structured outputs, driven by the official `openai` client.

One server per module on the demo model, float32 (the same request streamed and whole must give
the same tokens) and few KV blocks, so that eight constrained streams at once preempt each other.
OpenAI's `response_format` (json_schema, json_object) on both endpoints, vLLM's extra field
`structured_outputs` (regex, choice, grammar), n > 1; a schema, regex or grammar that cannot be
compiled is a 400 naming it, and the server goes on serving. docs/10_structured_outputs.md.
"""
import json
import pathlib
import re
import sys
import urllib.request
from concurrent.futures import ThreadPoolExecutor

import pytest

for module in ("fastapi", "uvicorn", "prometheus_client"):
    pytest.importorskip(module, reason="the serve extra: pip install -e '.[serve]'")
pytest.importorskip("xgrammar", reason="the structured extra: pip install -e '.[structured]'")
openai = pytest.importorskip("openai", reason="the test extra: pip install -e '.[test]'")
jsonschema = pytest.importorskip("jsonschema", reason="the test extra: pip install -e '.[test]'")

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[2]))
from benchmarks.serve import start_nanopaged  # noqa: E402
from test_serve import metrics, post, streamed_text, wait_idle  # noqa: E402

# 16-token blocks: a chat prompt and its JSON answer take about 6; eight at once need ~48 of 24.
ENGINE_ARGS = ["--block-size", "16", "--num-kv-blocks", "24", "--max-num-seqs", "16", "--dtype", "float32"]
MODEL_NAME = "demo"
SCHEMA = {"type": "object",
          "properties": {"city": {"type": "string", "enum": ["Paris", "Rome", "Oslo"]},
                         "population": {"type": "integer", "minimum": 0, "maximum": 99999999},
                         "facts": {"type": "array", "items": {"type": "string", "maxLength": 10}, "maxItems": 2}},
          "required": ["city", "population", "facts"]}
RESPONSE_FORMAT = {"type": "json_schema", "json_schema": {"name": "city", "schema": SCHEMA, "strict": True}}
ASK = [{"role": "user", "content": "Tell me about a European capital, as JSON."}]


@pytest.fixture(scope="module")
def server(demo_model_dir):
    with pytest.MonkeyPatch.context() as env:
        env.delenv("NANOPAGED_API_KEY", raising=False)
        with start_nanopaged(demo_model_dir, ENGINE_ARGS, served_model_name=MODEL_NAME, timeout_s=180) as s:
            yield s


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.base_url + "/v1", api_key="none", max_retries=0, timeout=120)


def chat(client, **kw):
    return client.chat.completions.create(**{"model": MODEL_NAME, "messages": ASK, "max_tokens": 128,
                                             "temperature": 0, **kw})


# ---- response_format -------------------------------------------------------------------------
def test_a_json_schema_answer_validates_streamed_and_whole_alike(client):
    whole = chat(client, response_format=RESPONSE_FORMAT).choices[0]
    jsonschema.validate(json.loads(whole.message.content), SCHEMA)
    assert whole.finish_reason == "stop"
    texts, reasons, _ = streamed_text(chat(client, response_format=RESPONSE_FORMAT, stream=True))
    assert texts[0] == whole.message.content and reasons[0] == "stop"


@pytest.mark.parametrize("response_format", [{"type": "json_object"}, RESPONSE_FORMAT], ids=["object", "schema"])
def test_completions_take_response_format_too(client, response_format):
    prompt = '{"city": "Oslo", "population": 700000, "facts": ["fjord"]}\n'      # a pattern to go on with
    create = dict(model=MODEL_NAME, prompt=prompt, max_tokens=64, temperature=0,
                  extra_body={"response_format": response_format})
    whole = client.completions.create(**create).choices[0]
    assert isinstance(json.loads(whole.text), dict) and whole.finish_reason == "stop"
    texts, _, _ = streamed_text(client.completions.create(**create, stream=True))
    assert texts[0] == whole.text


def test_a_json_object_answer_is_one_json_object(client):
    answer = chat(client, response_format={"type": "json_object"},
                  messages=[{"role": "user", "content": "Give the JSON object {\"ok\": true} and nothing else."}])
    assert isinstance(json.loads(answer.choices[0].message.content), dict)


def test_n_samples_each_follow_the_schema(client):
    """Sampled at temperature 1.0, so compact JSON (disable_any_whitespace): with any whitespace allowed,
    a sample may draw a run of tabs as long as max_tokens, as it can in vLLM."""
    answer = chat(client, n=3, temperature=1.0, seed=5, max_tokens=160,
                  extra_body={"structured_outputs": {"json": SCHEMA, "disable_any_whitespace": True}})
    assert len(answer.choices) == 3 and len({c.message.content for c in answer.choices}) > 1
    for choice in answer.choices:
        jsonschema.validate(json.loads(choice.message.content), SCHEMA)


def test_response_format_text_asks_for_nothing(client):
    plain, free = chat(client, max_tokens=12), chat(client, max_tokens=12, response_format={"type": "text"})
    assert plain.choices[0].message.content == free.choices[0].message.content


# ---- vLLM's extra field ------------------------------------------------------------------------
@pytest.mark.parametrize("constraint, check", [
    ({"regex": r"[A-Z][a-z]+, [0-9]{4}"}, lambda t: re.fullmatch(r"[A-Z][a-z]+, [0-9]{4}", t)),
    ({"choice": ["Paris", "Rome", "Oslo"]}, lambda t: t in ("Paris", "Rome", "Oslo")),
    ({"grammar": 'root ::= "The answer is " [0-9]{1,3} "."'}, lambda t: re.fullmatch(r"The answer is [0-9]{1,3}\.", t)),
])
def test_structured_outputs_take_a_regex_a_choice_or_a_grammar(client, constraint, check):
    text = chat(client, extra_body={"structured_outputs": constraint}).choices[0].message.content
    assert check(text), text


def test_constrained_logprobs_stay_json(client):
    """A forbidden token's logprob is -inf, which JSON cannot say: reported as -9999.0, as vLLM does."""
    answer = chat(client, extra_body={"structured_outputs": {"choice": ["yes", "no"]}}, logprobs=True,
                  top_logprobs=20).choices[0]
    first = answer.logprobs.content[0]
    assert answer.message.content in ("yes", "no") and first.logprob > -9999.0
    assert min(t.logprob for t in first.top_logprobs) == -9999.0


# ---- preemption: eight constrained streams in 24 blocks ------------------------------------------
def test_constrained_streams_that_preempt_each_other_all_follow_the_schema(server, client):
    before = metrics(server).get("nanopaged:num_preemptions_total", 0)
    questions = [[{"role": "user", "content": f"Capital number {i}, as JSON."}] for i in range(8)]

    def ask(messages):     # sampled, so compact JSON: no run of whitespace can reach max_tokens
        stream = client.chat.completions.create(
            model=MODEL_NAME, messages=messages, max_tokens=160, stream=True, temperature=1.0, seed=3,
            extra_body={"structured_outputs": {"json": SCHEMA, "disable_any_whitespace": True}})
        return streamed_text(stream)

    with ThreadPoolExecutor(8) as pool:
        results = list(pool.map(ask, questions))
    for texts, reasons, _ in results:
        jsonschema.validate(json.loads(texts[0]), SCHEMA)
        assert reasons[0] == "stop"
    assert metrics(server)["nanopaged:num_preemptions_total"] > before
    assert wait_idle(server)["nanopaged:kv_cache_usage_perc"] == 0


# ---- bad input: a 400 that names it, and the server goes on --------------------------------------------
def schema_format(schema):
    return {"type": "json_schema", "json_schema": {"name": "x", "schema": schema}}


@pytest.mark.parametrize("extra, param, match", [
    ({"response_format": schema_format({"type": "objec"})}, "response_format",
     r"response_format\.json_schema\.schema cannot be followed: Unsupported type"),
    ({"response_format": schema_format({"type": "integer", "minimum": 5, "maximum": 1})}, "response_format",
     r"Invalid range"),
    ({"response_format": {"type": "json_schema"}}, "response_format", r"must be an object with a 'schema'"),
    ({"response_format": {"type": "xml"}}, "response_format", r"type is one of"),
    ({"structured_outputs": {"regex": "[a-"}}, "structured_outputs", r"structured_outputs\.regex='\[a-'"),
    ({"structured_outputs": {"grammar": 'root ::= "a" |'}}, "structured_outputs", r"EBNF parser error"),
    ({"structured_outputs": {"choice": []}}, "structured_outputs", r"choice is empty"),
    ({"structured_outputs": {"regex": "a", "choice": ["a"]}}, "structured_outputs", r"exactly one constraint"),
    ({"structured_outputs": {"guided_json": {}}}, "structured_outputs", r"unsupported field"),
    ({"structured_outputs": {"regex": "a"}, "response_format": {"type": "json_object"}}, "structured_outputs",
     r"not both"),
    ({"structured_outputs": {"regex": "a+"}, "min_tokens": 2}, "min_tokens", r"cannot be combined"),
])
def test_a_constraint_that_cannot_be_followed_is_a_400_naming_it(server, client, extra, param, match):
    status, answer = post(server, "/v1/chat/completions", {"messages": ASK, "max_tokens": 8, **extra})
    assert status == 400, answer
    assert answer["error"]["param"] == param and re.search(match, answer["error"]["message"]), answer
    assert chat(client, max_tokens=4).choices[0].message.content        # and the engine goes on
    assert urllib.request.urlopen(server.base_url + "/health", timeout=5).status == 200
