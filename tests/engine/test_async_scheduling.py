"""Async scheduling (engine/overlap.py) changes when work runs, never what a request gets.

Each test runs the same requests on an engine that steps one at a time and on one that schedules
step N+1 while N computes, and compares everything a user sees: tokens, text, finish and stop reasons,
logprobs, cached-token counts. The cases are the ones placeholders could get wrong: preemption (a
request preempted while its step computes), chunked prefill, prefix hits, aborts while a step is in
flight, stop strings and stop tokens that end a request in the step already scheduled after it,
n > 1, seeded sampling, LoRA, structured outputs, beam search. After each run the pool is checked:
every block back, the free queue sound, nothing left computing.
"""
import threading
import time

import pytest
import torch

from conftest import make_prompts
from nanopaged import LLM, BeamSearchParams, SamplingParams
from nanopaged.core.request import PLACEHOLDER, Request
from nanopaged.core.scheduler import Scheduler
from nanopaged.core.block_pool import BlockPool
from nanopaged.engine import llm_engine

PROMPTS = [{"prompt_token_ids": p} for p in make_prompts(512, n=8, seed=54, min_len=4, max_len=50)]
SHARED = [{"prompt_token_ids": list(range(3, 40)) + p} for p in make_prompts(512, n=4, seed=55, max_len=12)]


def mixed_params(n=len(PROMPTS)):
    """Greedy and seeded sampled requests, some with stop tokens, logprobs, or a length limit."""
    return [SamplingParams(max_tokens=6 + 3 * (i % 4), temperature=0 if i % 2 else 0.9, seed=i,
                           stop_token_ids=[7, 11, 13, 17, 19] if i % 3 == 0 else None,
                           logprobs=2 if i % 4 == 1 else None) for i in range(n)]


def seen(outputs):
    """Everything a user reads of the outputs."""
    return [(o.num_cached_tokens,
             [(c.token_ids, c.text, c.finish_reason, c.stop_reason, c.cumulative_logprob,
               None if c.logprobs is None else [{t: round(lp.logprob, 5) for t, lp in d.items()} for d in c.logprobs])
              for c in o.outputs]) for o in outputs]


def assert_pool_clean(llm):
    engine = llm.llm_engine
    assert engine.overlap is None or engine.overlap.in_flight is None
    assert not engine.has_unfinished_requests()
    engine.scheduler.block_pool.check_invariants()
    assert engine.scheduler.block_pool.usage() == 0.0


def both(model, **settings):
    return LLM(model, async_scheduling=False, **settings), LLM(model, async_scheduling=True, **settings)


def same_outputs(model, prompts, params, runs=1, **settings):
    """Generate on both engines (`runs` times each, to see prefix hits); the async engine overlapped steps."""
    sync, overlapped = both(model, **settings)
    for _ in range(runs):
        want = seen(sync.generate(prompts, params, use_tqdm=False))
        got = seen(overlapped.generate(prompts, params, use_tqdm=False))
        assert got == want
    assert_pool_clean(sync)
    assert_pool_clean(overlapped)
    assert overlapped.llm_engine.overlap is not None and sync.llm_engine.overlap is None
    return overlapped


@pytest.mark.parametrize("dtype", ["float32", "auto"])
def test_async_scheduling_gives_the_synchronous_outputs(tiny_model_dirs, dtype):
    llm = same_outputs(tiny_model_dirs["qwen3"], PROMPTS, mixed_params(), dtype=dtype)
    assert llm.get_stats()["async_scheduling"] is True


def test_under_preemption(tiny_model_dirs):
    llm = same_outputs(tiny_model_dirs["llama"], PROMPTS, mixed_params(), num_kv_blocks=14, block_size=4)
    assert llm.get_stats()["num_preemptions"] > 0


def test_with_prompts_chunked_into_a_small_token_budget(tiny_model_dirs):
    same_outputs(tiny_model_dirs["mistral"], PROMPTS, mixed_params(), max_num_batched_tokens=16)


def test_with_prefix_hits_on_the_second_run(tiny_model_dirs):
    llm = same_outputs(tiny_model_dirs["qwen2"], SHARED, mixed_params(len(SHARED)), runs=2, block_size=4)
    assert llm.get_stats()["prefix_cache_hits"] > 0


def test_with_n_samples_forked_off_one_prompt(tiny_model_dirs):
    params = [SamplingParams(n=3, max_tokens=8, temperature=1.0, seed=i) for i in range(3)]
    same_outputs(tiny_model_dirs["qwen3"], PROMPTS[:3], params, block_size=4)


def test_stop_strings_that_end_a_request_in_the_step_already_scheduled(tiny_model_dirs):
    model = tiny_model_dirs["llama"]
    probe = LLM(model).generate(PROMPTS, SamplingParams(max_tokens=12, temperature=0), use_tqdm=False)
    # each request stops on a piece of its own greedy text: somewhere inside its output
    params = [SamplingParams(max_tokens=12, temperature=0, stop=[o.outputs[0].text[4:6]])
              for o in probe if len(o.outputs[0].text) > 6]
    llm = same_outputs(model, PROMPTS[:len(params)], params)
    assert llm.get_stats()["num_discarded_rows"] > 0       # their extra rows were computed and dropped


def test_a_request_at_max_tokens_is_not_scheduled_again(tiny_model_dirs):
    llm = same_outputs(tiny_model_dirs["qwen3"], PROMPTS, SamplingParams(max_tokens=5, ignore_eos=True))
    assert llm.get_stats()["num_discarded_rows"] == 0


def test_with_lora_adapters(tiny_model_dirs, tiny_adapters):
    from nanopaged.lora.request import LoRARequest
    folders = tiny_adapters["llama"]
    loras = [LoRARequest(name, i + 1, folders[name]) for i, name in enumerate(sorted(folders))] + [None]
    per_prompt = [loras[i % len(loras)] for i in range(len(PROMPTS))]
    sync, overlapped = both(tiny_model_dirs["llama"], enable_lora=True, max_loras=2, max_lora_rank=16)
    params = SamplingParams(max_tokens=8, temperature=0)
    want = seen(sync.generate(PROMPTS, params, lora_request=per_prompt, use_tqdm=False))
    assert seen(overlapped.generate(PROMPTS, params, lora_request=per_prompt, use_tqdm=False)) == want
    assert_pool_clean(overlapped)


def test_with_structured_outputs(tiny_model_dirs):
    pytest.importorskip("xgrammar")
    from nanopaged import StructuredOutputsParams
    params = [SamplingParams(max_tokens=20, temperature=0, structured_outputs=StructuredOutputsParams(
        choice=["yes", "no", "maybe"] if i % 2 else None, regex=None if i % 2 else "[ab]{3,6}")) for i in range(4)]
    same_outputs(tiny_model_dirs["llama"], PROMPTS[:4], params, dtype="float32")


def test_beam_search_runs_its_own_steps_on_an_async_engine(tiny_model_dirs):
    sync, overlapped = both(tiny_model_dirs["qwen3"], dtype="float32")
    params = BeamSearchParams(beam_width=3, max_tokens=6)
    for llm in (sync, overlapped):
        llm.generate(PROMPTS[:2], SamplingParams(max_tokens=4), use_tqdm=False)
    want = [[b.tokens for b in o.sequences] for o in sync.beam_search(PROMPTS[:3], params)]
    assert [[b.tokens for b in o.sequences] for o in overlapped.beam_search(PROMPTS[:3], params)] == want
    assert_pool_clean(overlapped)


def test_an_abort_while_a_step_computes(tiny_model_dirs):
    """Abort one request while its step is in flight: its row is dropped, its blocks go back, the
    others get the tokens a synchronous engine gives them."""
    results = []
    for mode in (False, True):
        engine = LLM(tiny_model_dirs["qwen3"], async_scheduling=mode, block_size=4).llm_engine
        for i, p in enumerate(PROMPTS[:4]):
            engine.add_request(str(i), p, SamplingParams(max_tokens=10, temperature=0, ignore_eos=True))
        finals, steps = {}, 0
        while engine.has_unfinished_requests():
            for o in engine.step():
                if o.finished:
                    finals[o.request_id] = (o.outputs[0].finish_reason, o.outputs[0].token_ids)
            steps += 1
            if steps == 3:
                assert mode is False or engine.overlap.in_flight is not None
                engine.abort_request("1")
        assert finals["1"][0] == "abort"
        engine.scheduler.block_pool.check_invariants()
        assert engine.scheduler.block_pool.usage() == 0.0
        results.append({k: v for k, v in finals.items() if k != "1"})
    assert results[0] == results[1]


def test_a_failing_forward_pass_aborts_both_steps_and_the_next_call_is_correct(tiny_model_dirs, monkeypatch):
    llm = LLM(tiny_model_dirs["qwen3"], async_scheduling=True, block_size=4)
    params = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)
    want = [o.outputs[0].token_ids for o in llm.generate(PROMPTS, params, use_tqdm=False)]
    runner, calls = llm.llm_engine.runner, []
    real = runner.forward

    def failing(out, inputs):
        calls.append(1)
        if len(calls) == 3:
            raise RuntimeError("injected failure")
        return real(out, inputs)
    monkeypatch.setattr(runner, "forward", failing)
    with pytest.raises(RuntimeError, match="injected failure"):
        llm.generate(PROMPTS, params, use_tqdm=False)
    monkeypatch.undo()
    llm.llm_engine.step()                        # the final "abort" outputs
    assert_pool_clean(llm)
    assert [o.outputs[0].token_ids for o in llm.generate(PROMPTS, params, use_tqdm=False)] == want


def test_the_stats_time_every_phase_of_a_step(tiny_model_dirs):
    llm = LLM(tiny_model_dirs["qwen3"], async_scheduling=True)
    llm.generate(PROMPTS, SamplingParams(max_tokens=6), use_tqdm=False)
    stats = llm.get_stats()
    assert set(stats["step_time_s"]) == {"schedule", "prepare", "forward", "wait", "sample", "update", "output"}
    assert all(v > 0 for v in stats["step_time_s"].values())
    assert 0 < stats["model_busy_share"] <= 1
    sync = LLM(tiny_model_dirs["qwen3"], async_scheduling=False)
    sync.generate(PROMPTS, SamplingParams(max_tokens=6), use_tqdm=False)
    assert set(sync.get_stats()["step_time_s"]) == {"schedule", "prepare", "forward", "sample", "update", "output"}


# ---- the settings ----------------------------------------------------------------------------------
def test_unset_it_is_off_on_a_cpu_and_named_it_is_on(tiny_model_dirs):
    assert LLM(tiny_model_dirs["qwen3"]).get_stats()["async_scheduling"] is False
    llm = LLM(tiny_model_dirs["qwen3"], async_scheduling=True)
    llm.generate(PROMPTS, SamplingParams(max_tokens=4), use_tqdm=False)
    assert llm.get_stats()["async_scheduling"] is True and llm.llm_engine.overlap.num_overlapped_steps > 0


def test_unset_it_gives_way_to_forced_drafts_once_a_structured_request_comes(tiny_model_dirs, monkeypatch):
    """Asked for by name, async scheduling forces no drafts; unset where it is on by default (a GPU; here
    the default is made on), the first structured request installs the drafter and the steps run one at
    a time from then on (its drafts need each step's tokens)."""
    pytest.importorskip("xgrammar")
    monkeypatch.setattr(llm_engine, "resolve_async_scheduling", lambda config: config.async_scheduling is not False)
    from nanopaged import StructuredOutputsParams
    from nanopaged.spec_decode.extension import SpeculativeDecoding
    params = SamplingParams(max_tokens=12, temperature=0, structured_outputs=StructuredOutputsParams(regex="[ab]{4,9}"))
    named = LLM(tiny_model_dirs["llama"], dtype="float32", async_scheduling=True)
    unset = LLM(tiny_model_dirs["llama"], dtype="float32")
    want = [o.outputs[0].token_ids for o in named.generate(PROMPTS[:3], params, use_tqdm=False)]
    assert named.llm_engine.find(SpeculativeDecoding) is None
    unset.generate(PROMPTS, SamplingParams(max_tokens=4), use_tqdm=False)
    overlapped = unset.llm_engine.overlap.num_overlapped_steps
    assert overlapped > 0
    assert [o.outputs[0].token_ids for o in unset.generate(PROMPTS[:3], params, use_tqdm=False)] == want
    assert unset.llm_engine.find(SpeculativeDecoding) is not None
    assert unset.llm_engine.overlap.num_overlapped_steps == overlapped
    assert_pool_clean(unset)


@pytest.mark.parametrize("settings, named", [
    ({"speculative_config": {"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_max": 2}},
     "speculative_config"),
    ({"runner": "pooling"}, "runner='pooling'"),
    ({"tensor_parallel_size": 2}, "tensor_parallel_size"),
    ({"async_scheduling": "yes"}, "async_scheduling")])
def test_what_it_cannot_run_with_is_refused_by_name(tiny_model_dirs, settings, named):
    with pytest.raises(ValueError, match=named):
        LLM(tiny_model_dirs["qwen3"], **{"async_scheduling": True, **settings})


def test_what_it_cannot_run_with_turns_the_default_off(tiny_model_dirs):
    llm = LLM(tiny_model_dirs["qwen3"], speculative_config={"method": "ngram", "num_speculative_tokens": 2,
                                                            "prompt_lookup_max": 2})
    assert llm.llm_engine.config.async_scheduling is False


# ---- the pieces --------------------------------------------------------------------------------------
def test_a_placeholder_is_a_token_the_scheduler_counts_before_it_is_known():
    pool = BlockPool(8, 4, True, "sha256")
    scheduler = Scheduler(pool, 4, 64)
    request = Request("r", [5, 6, 7], SamplingParams(), max_tokens=3)
    scheduler.add_request(request)
    first = scheduler.schedule()
    scheduler.advance(first)
    assert request.num_output_placeholders == 1 and request.num_tokens_with_spec == 4
    second = scheduler.schedule()                  # scheduled before the first step's token is known
    assert second.scheduled == [(request, 1)] and request.token_ids(3, 4) == [PLACEHOLDER]
    from nanopaged.core.request import SampledToken
    scheduler.append(first, {request: [SampledToken(9)]})
    assert request.num_output_placeholders == 0 and request.token_ids(3, 4) == [9]
    scheduler.advance(second)
    scheduler.append(second, {request: [SampledToken(10)]})
    scheduler.advance(scheduler.schedule())
    # its third token is in flight and max_tokens=3: its end is known, no fourth step is scheduled
    assert scheduler.schedule().scheduled == []


def test_the_kernels_let_python_run_beside_them():
    """The model thread overlaps only if the C++ kernels let go of the GIL while they run: during one long
    kernel call on another thread, this thread's Python keeps running (with the GIL held, it could not)."""
    from nanopaged.cpu.build import cpu_ops
    ops = cpu_ops()
    if not ops.has_avx512_bf16:
        pytest.skip("this host's build has no linear_bf16 (AVX512-BF16)")
    x = torch.randn(1024, 4096, dtype=torch.bfloat16)
    packed = ops.pack_bf16_weight(torch.randn(4096, 4096, dtype=torch.bfloat16))
    call, done = [], threading.Event()

    def kernel():
        start = time.perf_counter()
        ops.linear_bf16(x, packed, torch.empty(0), 4096)
        call.extend([start, time.perf_counter()])
        done.set()
    worker = threading.Thread(target=kernel)
    ticks = [time.perf_counter()]
    worker.start()
    while not done.is_set():
        now = time.perf_counter()
        if now - ticks[-1] > 0.001:
            ticks.append(now)
    worker.join()
    start, end = call
    inside = [t for t in ticks if start + 0.01 < t < end - 0.01]
    assert end - start > 0.05, "the kernel call was too short to tell"
    assert len(inside) > (end - start - 0.02) / 0.001 / 4


def test_the_demo_model_gives_the_synchronous_outputs(demo_model_dir):
    """The real model in its default dtype: chat-like prompts, greedy and seeded sampling, stop strings."""
    prompts = [f"Question {i}: tell me a short story about the number {i}." for i in range(12)]
    params = [SamplingParams(max_tokens=40, temperature=0 if i % 2 else 0.8, seed=i,
                             stop=["\n\n"] if i % 3 == 0 else None, logprobs=1 if i % 4 == 1 else None)
              for i in range(12)]
    same_outputs(demo_model_dir, prompts, params, max_num_seqs=8)
