"""Drafts the grammar forces (spec_decode/drafter.py, structured_output/manager.py: forced_drafts):
greedy output is plain decoding's token for token (forced drafts alone, and with each method after
them), sampled JSON always validates, the distribution holds, forced drafts are drafted and accepted,
the grammar's matcher ends where the accepted tokens put it, and the block pool ends whole. Counted:
no method draft the grammar refuses reaches a verify pass, and forced drafts stop before a token the
free text after them can merge with, so a model writing the text's own tokens accepts every one."""
import json
from collections import Counter

import pytest
import torch
from conftest import torch_threads
from test_spec_decode import NGRAM, draft, two_sample_chi2_passes

pytest.importorskip("xgrammar", reason="the structured extra: pip install -e '.[structured]'")
jsonschema = pytest.importorskip("jsonschema", reason="the test extra: pip install -e '.[test]'")

import nanopaged.spec_decode.extension as spec_extension  # noqa: E402
from nanopaged.structured_output.extension import StructuredOutputs  # noqa: E402
from nanopaged import LLM, SamplingParams, StructuredOutputsParams  # noqa: E402
from nanopaged.spec_decode.extension import SpeculativeDecoding  # noqa: E402

SCHEMA = {"type": "object",
          "properties": {"role": {"enum": ["admin", "user", "guest"]}, "n": {"type": "integer", "minimum": 0, "maximum": 99},
                         "sub": {"type": "object", "properties": {"zip": {"type": "string", "pattern": "[0-9]{3}"}},
                                 "required": ["zip"]}},
          "required": ["role", "n", "sub"]}
SUFFIX = {"method": "suffix", "num_speculative_tokens": 4}


@pytest.fixture(autouse=True)
def one_thread():
    with torch_threads(1):
        yield


def params(**sampling):
    return SamplingParams(max_tokens=60, **{"temperature": 0, **sampling},
                          structured_outputs=StructuredOutputsParams(json=SCHEMA, disable_any_whitespace=True))


def prompts(n):
    return [{"prompt_token_ids": list(range(3, 8 + 3 * i))} for i in range(n)]


def engine(model, spec=None, forced=True, monkeypatch=None):
    monkeypatch.setattr(spec_extension, "FORCED_DRAFTS", forced)
    return LLM(model, dtype="float32", speculative_config=spec, cpu_threads=None, num_kv_blocks=256, block_size=4)


def tokens(outs):
    return [o.outputs[0].token_ids for o in outs]


def check_whole(llm):
    pool = llm.llm_engine.scheduler.block_pool
    assert pool.num_free_blocks == pool.num_blocks
    assert not llm.llm_engine.find(StructuredOutputs).manager.matchers    # every matcher forgotten


@pytest.mark.parametrize("spec", [None, "ngram", "suffix", "draft_model"])
def test_greedy_output_is_plain_decoding_with_each_method(tiny_model_dirs, spec, monkeypatch):
    model = tiny_model_dirs["llama"]
    plain = tokens(engine(model, forced=False, monkeypatch=monkeypatch).generate(prompts(4), params(), use_tqdm=False))
    config = {None: None, "ngram": NGRAM, "suffix": SUFFIX, "draft_model": draft(model, k=3)}[spec]
    llm = engine(model, config, monkeypatch=monkeypatch)
    assert tokens(llm.generate(prompts(4), params(), use_tqdm=False)) == plain
    s = llm.llm_engine.find(SpeculativeDecoding).counts
    assert s.num_forced_draft_tokens > 0 and s.num_accepted_forced_tokens > 0
    check_whole(llm)


def test_sampled_json_always_validates(tiny_model_dirs, monkeypatch):
    """Temperature 1, 60 seeds, forced drafts and n-gram drafts after them: every output is the schema's."""
    llm = engine(tiny_model_dirs["llama"], NGRAM, monkeypatch=monkeypatch)
    outs = llm.generate(prompts(1) * 60, [params(temperature=1.0, seed=i) for i in range(60)], use_tqdm=False)
    for o in outs:
        jsonschema.validate(json.loads(o.outputs[0].text), SCHEMA)
    s = llm.llm_engine.find(SpeculativeDecoding).counts
    assert s.num_accepted_forced_tokens > 100
    check_whole(llm)


def test_the_distribution_holds(tiny_model_dirs, monkeypatch):
    """The role and n chosen at temperature 1 in 400 requests each, with and without forced drafts:
    the two samples agree (chi-square, as test_spec_decode.py)."""
    model = tiny_model_dirs["llama"]

    def choices(llm, first_seed):
        outs = llm.generate(prompts(1) * 400, [params(temperature=1.0, seed=first_seed + i) for i in range(400)],
                            use_tqdm=False)
        values = [json.loads(o.outputs[0].text) for o in outs]
        return [hash((v["role"], v["n"] % 5)) for v in values]
    plain = choices(engine(model, forced=False, monkeypatch=monkeypatch), 0)
    forced = choices(engine(model, monkeypatch=monkeypatch), 10_000)
    assert len(Counter(plain)) > 3
    assert two_sample_chi2_passes(plain, forced)


def test_the_matcher_follows_the_accepted_tokens_only(tiny_model_dirs, monkeypatch):
    """After every step, each structured request's matcher has accepted exactly its output: rejected
    drafts (n-gram drafts the model disagrees with) never moved it."""
    llm = engine(tiny_model_dirs["llama"], NGRAM, monkeypatch=monkeypatch)
    eng = llm.llm_engine
    for i, p in enumerate(prompts(3)):
        eng.add_request(str(i), p, params(temperature=1.0, seed=i))
    manager = None
    while eng.has_unfinished_requests():
        eng.step()
        manager = eng.find(StructuredOutputs).manager
        for r in eng.scheduler.running:
            state = manager.matchers.get(r)
            if state is not None:
                assert state.num_accepted == r.num_output_tokens
                mask = torch.empty(1, (manager.backend.vocab_size + 31) // 32, dtype=torch.int32)
                state.matcher.fill_row(mask, 0)                  # where the output leaves it: not ended
                assert mask.any()
    assert eng.find(SpeculativeDecoding).counts.num_draft_tokens > eng.find(SpeculativeDecoding).counts.num_accepted_tokens
    check_whole(llm)


def test_method_drafts_are_checked_against_the_grammar_before_they_are_verified(tiny_model_dirs, monkeypatch):
    """n-gram drafts copy the prompt, which the schema mostly refuses: each step's drafts must be cut at
    the first token the grammar refuses before the verify pass, so no verify row is spent on a token
    the mask would refuse anyway. Counted after every proposal: drafts the grammar refuses, none."""
    llm = engine(tiny_model_dirs["llama"], NGRAM, monkeypatch=monkeypatch)
    eng = llm.llm_engine
    spec = eng.find(SpeculativeDecoding)
    real, refused, proposed = spec.propose, [], []

    def checked(running):
        real(running)
        grammar = eng.find(StructuredOutputs).manager
        for r in running:
            if r.spec_token_ids:
                proposed.append(len(r.spec_token_ids))
                refused.append(len(r.spec_token_ids) - len(grammar.allowed_drafts(r, [], r.spec_token_ids)))
    spec.propose = checked
    repeats = [{"prompt_token_ids": [5, 6, 7, 5, 6, 7, 5, 6, 7, 5, 6]} for _ in range(3)]   # n-gram bait
    llm.generate(repeats + prompts(3), params(), use_tqdm=False)
    assert sum(proposed) > 0 and sum(refused) == 0, (sum(proposed), sum(refused))
    assert spec.counts.num_draft_tokens > spec.counts.num_forced_draft_tokens      # the method drafted too


# A value of either type after "v": the grammar forces `"v": ` and leaves the next character free; this
# tokenizer writes the forced space and what follows as one token (' "', ' 1')
EITHER = {"type": "object", "properties": {"name": {"type": "string"}, "v": {"type": ["string", "integer"]},
                                           "w": {"type": ["string", "integer"]}}, "required": ["name", "v", "w"]}


@pytest.mark.parametrize("text", ['{"name": "ab", "v": "cd", "w": 5}', '{"name": "x", "v": 12, "w": "hello"}'])
def test_forced_drafts_stop_before_a_token_the_free_text_can_merge_with(tiny_model_dirs, monkeypatch, text):
    """The forced text's last token may merge with the free text after it (' ' + '"' is ' "'): a draft
    that keeps it is refused by a model writing the text's own tokens, one verify row wasted each time.
    Driven here by exactly such a model (each step takes the accepted drafts and the text's next
    token): every forced draft is accepted, and the drafts save steps."""
    llm = engine(tiny_model_dirs["llama"], monkeypatch=monkeypatch)
    eng, tokenizer = llm.llm_engine, llm.get_tokenizer()
    p = SamplingParams(temperature=0, max_tokens=60,
                       structured_outputs=StructuredOutputsParams(json=EITHER, disable_any_whitespace=True))
    [request] = eng.process_request("r", {"prompt_token_ids": [5, 6, 7]}, p)
    manager = eng.find(StructuredOutputs).manager
    target = tokenizer.encode(text, add_special_tokens=False) + [tokenizer.eos_token_id]
    drafted = accepted = steps = 0
    while request.num_output_tokens < len(target):
        at, drafts = request.num_output_tokens, manager.forced_drafts(request, 16)
        taken = next((i for i, t in enumerate(drafts) if target[at + i:at + i + 1] != [t]), len(drafts))
        drafted, accepted, steps = drafted + len(drafts), accepted + taken, steps + 1
        request.output_token_ids += target[at:at + taken + 1]
    assert manager.ended(request) and manager.matchers[request].rejected is None     # the text is the schema's
    assert drafted == accepted > 0 and steps < len(target), (drafted, accepted, steps, len(target))


def test_demo_model_greedy_json_unchanged(demo_model_dir, monkeypatch):
    chat = [{"role": "user", "content": "Describe a user of a web site as JSON."}]
    p = SamplingParams(temperature=0, max_tokens=80, structured_outputs=StructuredOutputsParams(json=SCHEMA))
    outs = {}
    for forced in (False, True):
        llm = engine(demo_model_dir, forced=forced, monkeypatch=monkeypatch)
        prompt = llm.get_tokenizer().apply_chat_template(chat, tokenize=False, add_generation_prompt=True)
        outs[forced] = llm.generate([prompt], p, use_tqdm=False)[0].outputs[0]
    assert outs[True].token_ids == outs[False].token_ids
    jsonschema.validate(json.loads(outs[True].text), SCHEMA)
    s = llm.llm_engine.find(SpeculativeDecoding).counts
    assert s.num_accepted_forced_tokens > 0
    assert llm.llm_engine.find(SpeculativeDecoding).spec is None          # forced drafts alone: no speculative config
    check_whole(llm)
