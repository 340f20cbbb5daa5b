"""Nothing a user passes, and no failure inside a step, leaves an LLM unusable.

A step can still fail after every check (a bug, out of memory, Ctrl-C): its requests then
end with "abort", their blocks go back, the error reaches the caller, and the next call
gives the right tokens. A stall is an error naming the engine's state, not an endless loop;
a second thread is refused, not let in to corrupt the prefix cache. A randomized run calls
the public API with hostile values of every type and checks, after each call, that it
either worked or raised ValueError and that the engine still gives its reference tokens.
"""
import random
import threading

import pytest

from conftest import make_prompts
from nanopaged import LLM, BeamSearchParams, SamplingParams
from nanopaged.engine.extension import StepObserver
from nanopaged.engine.llm_engine import EngineStalled
from nanopaged.core.scheduler import SchedulerOutput
from nanopaged.sample.sampler import Sampler

GREEDY = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)
PROMPTS = [{"prompt_token_ids": p} for p in make_prompts(512, n=4, seed=60, min_len=5, max_len=40)]


@pytest.fixture(scope="module")
def llm(tiny_model_dirs):
    return LLM(tiny_model_dirs["qwen3"], num_kv_blocks=40, block_size=8)


@pytest.fixture(scope="module")
def reference(tiny_model_dirs):
    """What a fresh engine generates for PROMPTS."""
    fresh = LLM(tiny_model_dirs["qwen3"], num_kv_blocks=40, block_size=8)
    return [o.outputs[0].token_ids for o in fresh.generate(PROMPTS, GREEDY, use_tqdm=False)]


def assert_clean_and_correct(llm, reference):
    engine = llm.llm_engine
    engine.step()                                    # hands back any final "abort" outputs
    assert not engine.has_unfinished_requests()
    engine.scheduler.block_pool.check_invariants()
    assert engine.scheduler.block_pool.usage() == 0.0
    outs = llm.generate(PROMPTS, GREEDY, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == reference


class Boom(Exception):
    pass


def fail_once(monkeypatch, obj, name, at=3):
    """Make obj.name raise on its `at`-th call (by default a few steps in: some requests
    mid-prompt, some decoding)."""
    real, calls = getattr(obj, name), []

    def failing(*args, **kwargs):
        calls.append(1)
        if len(calls) == at:
            raise Boom("injected failure")
        return real(*args, **kwargs)

    monkeypatch.setattr(obj, name, failing)


@pytest.mark.parametrize("part, method", [("runner", "forward"), ("Sampler", "__call__"),
                                          ("output_processor", "process")])
def test_a_failing_step_aborts_its_requests_and_the_next_call_is_correct(llm, reference, monkeypatch,
                                                                          part, method):
    fail_once(monkeypatch, Sampler if part == "Sampler" else getattr(llm.llm_engine, part), method)
    with pytest.raises(Boom):
        llm.generate(PROMPTS + [{"prompt_token_ids": [5] * 30}], SamplingParams(n=2, max_tokens=10, seed=1),
                     use_tqdm=False)
    monkeypatch.undo()
    assert_clean_and_correct(llm, reference)


def test_an_aborted_step_gives_final_abort_outputs_to_an_engine_user(llm, monkeypatch):
    engine = llm.llm_engine
    engine.add_request("a", PROMPTS[0], GREEDY)
    engine.add_request("b", PROMPTS[1], SamplingParams(n=3, max_tokens=5, seed=2))
    engine.step()
    fail_once(monkeypatch, engine.runner, "forward", at=2)
    engine.step()
    with pytest.raises(Boom):
        engine.step()
    monkeypatch.undo()
    final = {o.request_id: o for o in engine.step()}
    assert set(final) == {"a", "b"} and all(o.finished for o in final.values())
    assert [c.finish_reason for c in final["b"].outputs] == ["abort"] * 3
    assert final["a"].outputs[0].finish_reason == "abort"
    assert not engine.has_unfinished_requests() and engine.scheduler.block_pool.usage() == 0.0


def test_ctrl_c_in_generate_leaves_nothing_behind(llm, reference):
    steps = []

    def interrupt(step):
        steps.append(step)
        if len(steps) == 2:
            raise KeyboardInterrupt

    watcher = llm.llm_engine.install(StepObserver(interrupt))
    try:
        with pytest.raises(KeyboardInterrupt):
            llm.generate(PROMPTS, GREEDY, use_tqdm=False)
    finally:
        llm.llm_engine.remove(watcher)
    assert_clean_and_correct(llm, reference)


def test_a_failing_beam_search_leaves_no_beam_behind(llm, reference, monkeypatch):
    fail_once(monkeypatch, llm.llm_engine.runner, "forward")
    with pytest.raises(Boom):
        llm.beam_search(PROMPTS, BeamSearchParams(beam_width=3, max_tokens=6))
    monkeypatch.undo()
    assert_clean_and_correct(llm, reference)


def test_a_stall_is_an_error_naming_the_engine_state(llm, reference, monkeypatch):
    """A bug that lets nothing be scheduled must not turn generate into an endless loop."""
    monkeypatch.setattr(llm.llm_engine.scheduler, "schedule", lambda: SchedulerOutput())
    with pytest.raises(EngineStalled, match=r"no request can be scheduled: 4 waiting, 0 running, 40 of 40 KV "
                                            r"blocks free, max_num_seqs 256; the oldest waiting request '\d+'"):
        llm.generate(PROMPTS, GREEDY, use_tqdm=False)
    monkeypatch.undo()
    assert_clean_and_correct(llm, reference)


def test_a_second_thread_is_refused_not_let_in(llm, reference):
    inside, release, errors = threading.Event(), threading.Event(), []

    def hold(step):
        inside.set()
        release.wait(timeout=30)

    watcher = llm.llm_engine.install(StepObserver(hold))
    first = threading.Thread(target=lambda: llm.generate(PROMPTS, GREEDY, use_tqdm=False))
    first.start()
    try:
        assert inside.wait(timeout=30)
        for call in (lambda: llm.generate("x", GREEDY, use_tqdm=False),
                     lambda: llm.chat([{"role": "user", "content": "x"}], GREEDY, use_tqdm=False),
                     lambda: llm.beam_search("x", BeamSearchParams(beam_width=2, max_tokens=2))):
            with pytest.raises(RuntimeError, match=r"already running a call in another thread"):
                call()
    finally:
        release.set()
        first.join(timeout=60)
        llm.llm_engine.remove(watcher)
    assert not errors
    assert_clean_and_correct(llm, reference)


def test_aborting_a_request_frees_its_blocks_and_gives_a_final_output(llm):
    engine = llm.llm_engine
    engine.add_request("n3", PROMPTS[2], SamplingParams(n=3, max_tokens=8, seed=4))   # samples not forked yet
    engine.add_request("one", PROMPTS[3], GREEDY)
    engine.step()                  # both prefill (40 blocks of 8 hold them); n3's prompt may be unfinished
    engine.abort_request("n3")
    outputs = {o.request_id: o for o in engine.step()}
    assert outputs["n3"].finished and [c.finish_reason for c in outputs["n3"].outputs] == ["abort"] * 3
    while engine.has_unfinished_requests():
        outputs.update({o.request_id: o for o in engine.step()})
    assert outputs["one"].outputs[0].finish_reason == "length"
    assert engine.scheduler.block_pool.usage() == 0.0 and not engine.token_selection.unforked
    engine.abort_request("never-queued")         # an unknown id is a no-op, not an error
    assert engine.step() == []


def test_generate_picks_ids_a_user_has_not_queued(llm):
    engine = llm.llm_engine
    for request_id in ("0", "1", "2", "3", "4", "5"):
        engine.add_request(request_id, PROMPTS[0], GREEDY)
    outs = llm.generate(PROMPTS[1:3], GREEDY, use_tqdm=False)
    assert [o.prompt_token_ids for o in outs] == [p["prompt_token_ids"] for p in PROMPTS[1:3]]
    assert not engine.has_unfinished_requests()      # the user's six ran along and finished too


# ---- a randomized run of hostile calls ----------------------------------------------------
HOSTILE = [None, 0, 1, -1, 2, 3, 7, 2**31, 2**63, 2**64, -2**64, 0.0, 0.5, 1.5, -0.5, 1e-9, 1e30,
           float("inf"), float("-inf"), float("nan"), True, False, "", "x", "\udc80", [], [1], [-3],
           [10**6], [2**70], ["a"], ["\udc80"], {}, {"a": 1}, (3,), b"bytes", object()]
VALID = {"n": [1, 2, 3], "temperature": [0.0, 0.7, 1.0, 1e-4], "top_p": [1.0, 0.9], "top_k": [0, 5, -1],
         "min_p": [0.0, 0.1], "seed": [None, 0, 7, 2**64 - 3], "stop": [None, "e", ["a", "th"]],
         "stop_token_ids": [None, [7, 11], [3, 600]], "include_stop_str_in_output": [False, True],
         "ignore_eos": [False, True], "max_tokens": [1, 3, 6, None], "min_tokens": [0, 1, 2],
         "logprobs": [None, 0, 3], "prompt_logprobs": [None, 1], "presence_penalty": [0.0, 1.0],
         "frequency_penalty": [0.0, -0.5], "repetition_penalty": [1.0, 1.3],
         "skip_special_tokens": [True, False]}


def random_params(rng):
    """Some fields set, each to a value it may take or, one time in twelve, to a hostile one."""
    kwargs = {"max_tokens": rng.choice([1, 3, 6])}
    for name in rng.sample(sorted(VALID), rng.randint(2, 12)):
        kwargs[name] = rng.choice(HOSTILE) if rng.random() < 0.08 else rng.choice(VALID[name])
    return SamplingParams(**kwargs)


def random_prompt(rng):
    if rng.random() < 0.75:
        return rng.choice([{"prompt_token_ids": [rng.randrange(3, 512) for _ in range(rng.randint(1, 30))]},
                           {"prompt_token_ids": [rng.randrange(3, 512)] * 5, "cache_salt": "t"},
                           "some text " * rng.randint(1, 5)])
    return rng.choice([{"prompt_token_ids": [rng.choice(HOSTILE) for _ in range(rng.randint(0, 3))]},
                       {"prompt_token_ids": [5] * 5, "cache_salt": rng.choice(HOSTILE)},
                       rng.choice(HOSTILE), {"prompt": rng.choice(HOSTILE)}, {"prompt_token_ids": [5] * 600}])


def random_call(llm, rng):
    kind = rng.random()
    if kind < 0.5:
        prompts = [random_prompt(rng) for _ in range(rng.randint(1, 3))]
        params = random_params(rng) if rng.random() < 0.7 else [random_params(rng) for _ in prompts]
        llm.generate(prompts if rng.random() < 0.9 else rng.choice(HOSTILE), params, use_tqdm=False)
    elif kind < 0.65:
        role, content = rng.choice(["user", "system", rng.choice(HOSTILE)]), rng.choice(["hi", rng.choice(HOSTILE)])
        llm.chat([{"role": role, "content": content}], random_params(rng), use_tqdm=False)
    elif kind < 0.8:
        llm.beam_search(random_prompt(rng), BeamSearchParams(beam_width=rng.choice([1, 2, 3, rng.choice(HOSTILE)]),
                                                             max_tokens=rng.choice([2, 4, rng.choice(HOSTILE)]),
                                                             length_penalty=rng.choice([1.0, 0.5, rng.choice(HOSTILE)])))
    else:
        engine = llm.llm_engine
        request_id = rng.choice(["r1", "r2", rng.choice(HOSTILE)])
        engine.add_request(request_id, random_prompt(rng), random_params(rng))
        for _ in range(rng.randint(0, 3)):
            engine.step()
        if rng.random() < 0.5:
            engine.abort_request(request_id)
        while engine.has_unfinished_requests():
            engine.step()


@pytest.mark.filterwarnings("ignore:temperature .* is below 0.01")   # expected: tiny temperatures
@pytest.mark.parametrize("seed", range(3))
def test_random_hostile_calls_either_work_or_raise_value_error(tiny_model_dirs, seed):
    llm = LLM(tiny_model_dirs["llama"], num_kv_blocks=24, block_size=8, max_num_seqs=6)
    reference = [o.outputs[0].token_ids for o in llm.generate(PROMPTS, GREEDY, use_tqdm=False)]
    rng = random.Random(seed)
    outcomes = {"ok": 0, "ValueError": 0}
    for call in range(150):
        try:
            random_call(llm, rng)
            outcomes["ok"] += 1
        except ValueError:
            outcomes["ValueError"] += 1
        engine = llm.llm_engine
        while engine.has_unfinished_requests():       # what an engine user left queued
            engine.step()
        engine.scheduler.block_pool.check_invariants()
        assert engine.scheduler.block_pool.usage() == 0.0, call
        if call % 50 == 49:
            assert [o.outputs[0].token_ids for o in llm.generate(PROMPTS, GREEDY, use_tqdm=False)] == reference
    assert outcomes["ok"] > 5 and outcomes["ValueError"] > 5, outcomes
