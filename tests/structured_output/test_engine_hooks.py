"""How structured outputs reach the engine: two hooks and a field, nothing else.

The sampler's `logits_processors` mask the step's logits before anything else; check_stop's
`stop_rules` see every token once and end a request whose grammar has ended; the field
`structured_outputs` installs the extension once, on first use. On a tiny random model (float32):
mixed batches leave the unconstrained rows' tokens as they are, preemption keeps every matcher,
finished and aborted sequences drop theirs, and without a constraint xgrammar is not imported.
"""
import json
import logging
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch

pytest.importorskip("xgrammar", reason="the structured extra: pip install -e '.[structured]'")

from nanopaged import LLM, SamplingParams, StructuredOutputsParams  # noqa: E402
from nanopaged.structured_output.extension import StructuredOutputs  # noqa: E402
from nanopaged.core.request import Request, RequestStatus, SampledToken  # noqa: E402
from nanopaged.engine.output_processor import check_stop  # noqa: E402
from nanopaged.sample.sampler import Sampler  # noqa: E402

# Every string bounded and no free whitespace: even a random model's output ends inside max_tokens.
SCHEMA = {"type": "object",
          "properties": {"role": {"enum": ["admin", "user"]}, "n": {"type": "integer", "minimum": 0, "maximum": 99},
                         "tags": {"type": "array", "items": {"enum": ["x", "y"]}, "maxItems": 2},
                         "sub": {"type": "object", "properties": {"zip": {"type": "string", "pattern": "[0-9]{3}"}},
                                 "required": ["zip"]}},
          "required": ["role", "n", "tags", "sub"]}


def json_params(**sampling):
    """The longest output SCHEMA allows is 71 characters, so at most 71 tokens and EOS."""
    return SamplingParams(max_tokens=80, **{"temperature": 0, **sampling},
                          structured_outputs=StructuredOutputsParams(json=SCHEMA, disable_any_whitespace=True))


def prompts(n, start=3):
    return [{"prompt_token_ids": list(range(start, start + 5 + 3 * i))} for i in range(n)]


@pytest.fixture(scope="module")
def llm(tiny_model_dirs):
    return LLM(tiny_model_dirs["llama"], dtype="float32", num_kv_blocks=256, block_size=4)


# ---- the two hooks, on their own -----------------------------------------------------------------
class OnlyToken:
    """A logits processor that allows one token in every row, and records what it is told."""

    def __init__(self, token):
        self.token = token

    def __call__(self, logits, requests):
        masked = torch.full_like(logits, float("-inf"))
        masked[:, self.token] = logits[:, self.token]
        return masked


def request(params, outputs=()):
    r = Request("r", [5, 6, 7], params, max_tokens=10, eos_token_ids=frozenset({2}))
    r.output_token_ids = list(outputs)
    return r


def test_a_logits_processor_masks_before_sampling_and_logprobs():
    sampler = Sampler(torch.device("cpu"), seed=0)
    sampler.logits_processors.append(OnlyToken(7))
    rows = [request(SamplingParams(temperature=0, logprobs=2)), request(SamplingParams(temperature=1.0, logprobs=2))]
    logits = torch.randn(2, 16)
    before = logits.clone()
    out = sampler(logits, rows)
    assert out.token_ids == [7, 7]
    assert out.logprobs == [0.0, 0.0]          # the masked distribution: token 7 has all of it (as vLLM)
    assert torch.equal(logits, before)


def test_every_stop_rule_sees_every_token_and_any_of_them_stops():
    seen = []
    rules = [lambda r: seen.append(("first", r.output_token_ids[-1])) or True,
             lambda r: seen.append(("second", r.output_token_ids[-1])) or False]
    r = request(SamplingParams(ignore_eos=True), outputs=[9])
    assert check_stop(r, None, rules) == (RequestStatus.FINISHED_STOPPED, None)
    assert seen == [("first", 9), ("second", 9)]
    assert check_stop(request(SamplingParams(), outputs=[9]), None, [lambda r: False]) is None


# ---- the engine with the extension installed ------------------------------------------------------
def test_unconstrained_rows_of_a_mixed_batch_get_the_tokens_they_get_alone(llm):
    plain = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    alone = llm.generate(prompts(4), plain, use_tqdm=False)
    mixed = llm.generate(prompts(4) + prompts(4, start=40), [plain] * 4 + [json_params()] * 4, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in mixed[:4]] == [o.outputs[0].token_ids for o in alone]
    assert all(json.loads(o.outputs[0].text)["role"] in ("admin", "user") for o in mixed[4:])


def test_preemption_keeps_every_matcher_and_every_output(tiny_model_dirs, llm):
    tight = LLM(tiny_model_dirs["llama"], dtype="float32", num_kv_blocks=40, block_size=4)   # 12 do not fit
    expected = [o.outputs[0].text for o in llm.generate(prompts(12), json_params(), use_tqdm=False)]
    got = tight.generate(prompts(12), json_params(), use_tqdm=False)
    assert [o.outputs[0].text for o in got] == expected
    assert tight.get_stats()["num_preemptions"] > 0
    assert all(o.outputs[0].finish_reason == "stop" for o in got)
    assert not tight.llm_engine.extension(StructuredOutputs).manager.matchers         # each forgotten when it finished


def test_n_samples_each_get_a_matcher_and_give_it_back(llm):
    out = llm.generate(prompts(1), json_params(n=5, temperature=1.0, seed=4), use_tqdm=False)[0]
    assert len(out.outputs) == 5 and all(json.loads(c.text) for c in out.outputs)
    assert not llm.llm_engine.extension(StructuredOutputs).manager.matchers


def test_an_aborted_request_gives_its_matcher_back(llm):
    engine = llm.llm_engine
    engine.add_request("gone", prompts(1)[0], json_params())
    for _ in range(3):
        engine.step()
    assert len(engine.extension(StructuredOutputs).manager.matchers) == 1
    engine.abort_request("gone")
    engine.step()
    assert not engine.extension(StructuredOutputs).manager.matchers and not engine.has_unfinished_requests()


def test_a_token_the_grammar_refuses_ends_the_request(llm, caplog):
    """The mask makes it impossible with the sampler; a token-selection rule of its own can still
    give one. The request then stops (logged), rather than feeding its matcher what it cannot follow."""
    engine = llm.llm_engine
    engine.add_request("wrong", prompts(1)[0], SamplingParams(
        max_tokens=8, structured_outputs=StructuredOutputsParams(choice=["yes"])))
    outputs = []
    logging.getLogger("nanopaged").addHandler(caplog.handler)          # nanopaged's log does not propagate
    try:
        while engine.has_unfinished_requests():
            outputs += engine.step(lambda out: {r: [SampledToken(5)] for r in out.requests})
    finally:
        logging.getLogger("nanopaged").removeHandler(caplog.handler)
    final = outputs[-1].outputs[0]
    assert final.token_ids == [5] and final.finish_reason == "stop"
    assert "the grammar refuses token 5" in caplog.text


def test_the_extension_is_installed_once_even_from_many_threads(tiny_model_dirs):
    """The server processes requests on several input threads at once: one install, one hook each."""
    llm = LLM(tiny_model_dirs["llama"], dtype="float32", num_kv_blocks=64)
    engine = llm.llm_engine
    with ThreadPoolExecutor(8) as pool:
        list(pool.map(lambda i: engine.process_request(str(i), prompts(1)[0], json_params()), range(16)))
    assert len(engine.sampler.logits_processors) == 1 and len(engine.output_processor.stop_rules) == 1
    assert len(engine.extension(StructuredOutputs).manager.compiles) == 1             # and the schema compiled once


def test_without_xgrammar_a_constraint_is_a_value_error_naming_the_extra(tiny_model_dirs, monkeypatch):
    llm = LLM(tiny_model_dirs["llama"], dtype="float32", num_kv_blocks=64)
    monkeypatch.setitem(sys.modules, "nanopaged.structured_output.backend_xgrammar", None)   # as if not installed
    with pytest.raises(ValueError, match=r"structured_outputs needs xgrammar.*pip install -e '\.\[structured\]'"):
        llm.generate(prompts(1), json_params(), use_tqdm=False)
    assert not llm.llm_engine.sampler.logits_processors      # nothing half installed
    assert llm.generate(prompts(1), SamplingParams(max_tokens=3), use_tqdm=False)[0].outputs[0].token_ids
    monkeypatch.undo()                                                # installed after all: the next one works
    assert json.loads(llm.generate(prompts(1), json_params(), use_tqdm=False)[0].outputs[0].text)


def test_the_optional_xgrammar_is_not_imported_without_a_constraint(tiny_model_dirs):
    """The registry imports the extension's own modules (their imports say the truth); the optional
    package, and the backend that needs it, load only when a request asks for a constraint."""
    program = ("import sys; from nanopaged import LLM, SamplingParams; "
               f"llm = LLM({tiny_model_dirs['llama']!r}, num_kv_blocks=16); "
               "llm.generate('hi', SamplingParams(max_tokens=2), use_tqdm=False); "
               "print(sorted(m for m in sys.modules if m.startswith(('nanopaged.structured_output.backend_xgrammar', "
               "'xgrammar'))))")
    done = subprocess.run([sys.executable, "-c", program], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.strip().splitlines()[-1] == "[]"


def test_a_tokenizer_the_backend_cannot_read_is_a_value_error(tiny_model_dirs, monkeypatch):
    import xgrammar

    def unreadable(*args, **kwargs):
        raise RuntimeError("unknown vocabulary type")

    llm = LLM(tiny_model_dirs["llama"], dtype="float32", num_kv_blocks=64)
    monkeypatch.setattr(xgrammar.TokenizerInfo, "from_huggingface", unreadable)
    with pytest.raises(ValueError, match=r"xgrammar cannot read this model's tokenizer .*unknown vocabulary type"):
        llm.generate(prompts(1), json_params(), use_tqdm=False)
    assert llm.generate(prompts(1), SamplingParams(max_tokens=3), use_tqdm=False)[0].outputs[0].token_ids
