"""The user-facing API: vLLM's LLM / SamplingParams / RequestOutput, and the lower LLMEngine."""
import json
import re
import shutil

import pytest

from conftest import EOS_TOKEN_ID, make_prompts
from nanopaged import LLM, LLMEngine, RequestOutput, SamplingParams
from nanopaged.engine.extension import StepObserver


@pytest.fixture(scope="module")
def llm(tiny_model_dirs):
    return LLM(tiny_model_dirs["llama"], num_kv_blocks=64, max_model_len=256)


def test_generate_accepts_strings_token_ids_and_a_mix(llm):
    tok = llm.get_tokenizer()
    greedy = SamplingParams(temperature=0, max_tokens=5)
    a = llm.generate("def main():", greedy, use_tqdm=False)
    b = llm.generate([{"prompt_token_ids": tok.encode("def main():")}, "import os"], greedy,
                     use_tqdm=False)
    assert len(a) == 1 and len(b) == 2
    assert a[0].outputs[0].token_ids == b[0].outputs[0].token_ids
    assert a[0].prompt == "def main():" and b[0].prompt is None and b[1].prompt == "import os"


def test_outputs_come_back_in_input_order_with_vllm_fields(llm):
    """Outputs in the order of the prompts, not the order they finish in: here the first
    prompt finishes last and the second first."""
    prompts = make_prompts(512, n=6, seed=3)
    lengths = [12, 1, 7, 3, 9, 2]
    finish_order = []
    watcher = llm.llm_engine.install(StepObserver(lambda step: finish_order.extend(r.request_id for r, _ in step.stopped)))
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts],
                        [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True) for n in lengths],
                        use_tqdm=False)
    llm.llm_engine.remove(watcher)
    assert finish_order != sorted(finish_order, key=int)       # they did finish out of order
    assert [o.prompt_token_ids for o in outs] == prompts
    assert [len(o.outputs[0].token_ids) for o in outs] == lengths
    for o in outs:
        assert isinstance(o, RequestOutput) and o.finished and o.num_cached_tokens == 0
        c = o.outputs[0]
        assert c.index == 0 and c.finish_reason == "length" and c.stop_reason is None
        assert c.cumulative_logprob is None and c.logprobs is None     # vLLM: None unless logprobs=k
        assert c.text == llm.get_tokenizer().decode(c.token_ids, skip_special_tokens=True)


def with_eos_ids(folder, tmp_path, eos_ids):
    """A copy of a model folder whose generation_config.json lists these EOS ids."""
    copy = tmp_path / "model"
    shutil.copytree(folder, copy)
    config = json.loads((copy / "generation_config.json").read_text())
    (copy / "generation_config.json").write_text(json.dumps({**config, "eos_token_id": eos_ids}))
    return str(copy)


def test_every_eos_id_of_generation_config_stops_with_no_stop_reason(tiny_model_dirs, tmp_path):
    """Llama 3 lists several EOS ids; generation stops at whichever comes first, with
    finish_reason "stop", stop_reason None (vLLM's convention for EOS), the EOS kept in token_ids."""
    prompt = {"prompt_token_ids": make_prompts(512, n=1, seed=5)[0]}
    free = LLM(tiny_model_dirs["llama"], num_kv_blocks=64).generate(
        prompt, SamplingParams(temperature=0, max_tokens=12, ignore_eos=True), use_tqdm=False)[0]
    tokens = free.outputs[0].token_ids
    first, later = tokens[3], tokens[7]
    assert first not in tokens[:3] and later not in tokens[:7], "pick other positions"
    for eos_ids, stop_at in (([later, first], 3), ([later, 511], 7)):
        llm = LLM(with_eos_ids(tiny_model_dirs["llama"], tmp_path / str(stop_at), eos_ids), num_kv_blocks=64)
        c = llm.generate(prompt, SamplingParams(temperature=0, max_tokens=12), use_tqdm=False)[0].outputs[0]
        assert c.token_ids == tokens[:stop_at + 1]
        assert c.finish_reason == "stop" and c.stop_reason is None


def test_one_sampling_params_per_prompt(llm):
    outs = llm.generate(["a", "b"], [SamplingParams(temperature=0, max_tokens=2),
                                     SamplingParams(temperature=0, max_tokens=5, ignore_eos=True)],
                        use_tqdm=False)
    assert len(outs[1].outputs[0].token_ids) == 5
    with pytest.raises(ValueError, match="2 SamplingParams for 3 prompts"):
        llm.generate(["a", "b", "c"], [SamplingParams(), SamplingParams()])


def test_ignore_eos_generates_exactly_max_tokens(llm):
    outs = llm.generate(["x"] * 3, SamplingParams(temperature=0, max_tokens=40, ignore_eos=True),
                        use_tqdm=False)
    assert all(len(o.outputs[0].token_ids) == 40 for o in outs)
    assert all(o.outputs[0].finish_reason == "length" for o in outs)


def test_seeded_sampling_is_reproducible_and_batch_independent(llm):
    p = SamplingParams(temperature=1.0, max_tokens=12, seed=1234, ignore_eos=True)
    alone = llm.generate("hello", p, use_tqdm=False)[0].outputs[0].token_ids
    crowd = llm.generate(["other", "hello", "more text here"],
                         [SamplingParams(temperature=0.8, max_tokens=12), p, SamplingParams()],
                         use_tqdm=False)[1].outputs[0].token_ids
    assert alone == crowd
    other_seed = llm.generate("hello", SamplingParams(temperature=1.0, max_tokens=12, seed=99,
                                                      ignore_eos=True), use_tqdm=False)
    assert other_seed[0].outputs[0].token_ids != alone


def test_max_tokens_none_runs_to_the_context_length(tiny_model_dirs):
    llm = LLM(tiny_model_dirs["llama"], max_model_len=20, num_kv_blocks=8)
    out = llm.generate({"prompt_token_ids": [5, 6, 7]},
                       SamplingParams(temperature=0, max_tokens=None, ignore_eos=True), use_tqdm=False)[0]
    assert len(out.outputs[0].token_ids) == 17 and out.outputs[0].finish_reason == "length"


def test_max_tokens_past_the_context_is_clipped(tiny_model_dirs):
    llm = LLM(tiny_model_dirs["llama"], max_model_len=20, num_kv_blocks=8)
    out = llm.generate({"prompt_token_ids": [5] * 10},
                       SamplingParams(temperature=0, max_tokens=100, ignore_eos=True), use_tqdm=False)[0]
    assert len(out.outputs[0].token_ids) == 10 and out.outputs[0].finish_reason == "length"


def test_engine_step_streams_the_requests_that_advanced(tiny_model_dirs):
    llm = LLM(tiny_model_dirs["qwen2"], num_kv_blocks=32)
    engine: LLMEngine = llm.llm_engine
    engine.add_request("a", {"prompt_token_ids": [5, 6, 7, 8]},
                       SamplingParams(temperature=0, max_tokens=3, ignore_eos=True))
    engine.add_request("b", "some text", SamplingParams(temperature=0, max_tokens=5, ignore_eos=True))
    seen = {"a": [], "b": []}
    while engine.has_unfinished_requests():
        for out in engine.step():
            seen[out.request_id].append((len(out.outputs[0].token_ids), out.finished))
    assert seen["a"] == [(1, False), (2, False), (3, True)]
    assert seen["b"][-1] == (5, True) and len(seen["b"]) == 5


def expected_figures(prompt_lens, max_tokens, bs=16):
    """What get_stats() must say for requests that all start in step 1 and run to max_tokens.

    Step 1 computes every prompt; step k > 1 computes request i's token at position
    L_i + k - 2. During step k request i (if k <= m_i) holds cdiv(L_i + k - 1, bs) blocks and,
    after it, K/V for L_i + k - 1 tokens.
    """
    steps = max(max_tokens)
    held = [[(L + k - 1) for L, m in zip(prompt_lens, max_tokens) if k <= m] for k in range(1, steps + 1)]
    blocks = [sum(-(-t // bs) for t in h) for h in held]
    return {"num_steps": steps, "num_generated_tokens": sum(max_tokens),
            "num_prompt_tokens_computed": sum(prompt_lens), "prefix_cache_queries": sum(prompt_lens),
            "prefix_cache_hits": 0, "num_preemptions": 0, "peak_kv_blocks_used": max(blocks),
            "max_num_running": len(prompt_lens), "mean_kv_blocks_used": sum(blocks) / steps,
            "kv_utilization": sum(map(sum, held)) / (sum(blocks) * bs), "kv_sharing_saving": 0.0}


def test_stats_are_what_the_trace_implies(tiny_model_dirs):
    prompts = make_prompts(512, n=4, seed=6, min_len=10, max_len=60)
    max_tokens = [5, 30, 12, 21]
    # one step at a time: with async scheduling the next step's blocks are taken while a step computes
    llm = LLM(tiny_model_dirs["llama"], num_kv_blocks=64, async_scheduling=False)
    llm.generate([{"prompt_token_ids": p} for p in prompts],
                 [SamplingParams(temperature=0, max_tokens=m, ignore_eos=True) for m in max_tokens], use_tqdm=False)
    stats = llm.get_stats()
    want = expected_figures([len(p) for p in prompts], max_tokens)
    for key, value in want.items():
        assert stats[key] == pytest.approx(value), key
    assert stats["peak_kv_cache_usage"] == want["peak_kv_blocks_used"] / 64
    assert stats["num_kv_blocks"] == 64 and stats["block_size"] == 16 and stats["kv_cache_usage"] == 0.0
    assert stats["model_time_s"] > 0 and stats["schedule_time_s"] > 0     # how they compare is the bench's to say
    llm.reset_stats()
    assert llm.get_stats()["num_steps"] == 0 and llm.get_stats()["num_generated_tokens"] == 0


def test_progress_bar_shows_the_figures_the_stats_hold(tiny_model_dirs, capsys):
    """Preemptions and prefix hits happen here; the bar's last figures are the engine's."""
    system = make_prompts(512, n=1, seed=7, min_len=32, max_len=32)[0]
    prompts = [{"prompt_token_ids": system + q} for q in make_prompts(512, n=6, seed=8, min_len=3, max_len=12)]
    llm = LLM(tiny_model_dirs["llama"], num_kv_blocks=10, block_size=8)
    llm.generate(prompts, SamplingParams(temperature=0, max_tokens=20, ignore_eos=True), use_tqdm=True)
    stats = llm.get_stats()
    assert stats["num_preemptions"] > 0 and stats["prefix_cache_hits"] > 0
    last = capsys.readouterr().err.replace("\r", "\n").strip().splitlines()[-1]
    assert "6/6" in last and "tok/s" in last
    assert f"preempted {stats['num_preemptions']}" in last
    assert f"prefix hit {stats['prefix_cache_hits'] / stats['prefix_cache_queries']:.0%}" in last
    kv_in_last_step = re.search(r"KV (\d+\.\d)%", last).group(1)
    assert 0 < float(kv_in_last_step) <= 100


def test_chat_applies_the_template_with_the_generation_prompt(llm):
    tok = llm.get_tokenizer()
    conv = [{"role": "user", "content": "hi there"}]
    out = llm.chat(conv, SamplingParams(temperature=0, max_tokens=4), use_tqdm=False)
    text = tok.apply_chat_template(conv, tokenize=False, add_generation_prompt=True)
    assert out[0].prompt == text and text.endswith("<|im_start|>assistant\n")
    assert out[0].prompt_token_ids == tok.encode(text, add_special_tokens=False)
    two = llm.chat([conv, conv], SamplingParams(temperature=0, max_tokens=4), use_tqdm=False)
    assert len(two) == 2 and two[0].outputs[0].token_ids == out[0].outputs[0].token_ids


def test_chat_with_a_template_of_ones_own(llm):
    template = "{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}{% endfor %}<assistant>"
    conv = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"}]
    out = llm.chat(conv, SamplingParams(temperature=0, max_tokens=4), use_tqdm=False, chat_template=template)[0]
    assert out.prompt == "<system>be brief<user>hi<assistant>"
    assert out.prompt_token_ids == llm.get_tokenizer().encode(out.prompt, add_special_tokens=False)
    assert out.finished and out.outputs[0].token_ids


def test_a_template_that_refuses_the_messages_is_a_value_error_naming_them(llm):
    """A template's own raise_exception (roles must alternate, ...) and a TypeError inside it are the
    messages' fault: a ValueError (a 400 in the server), never an error that ends a request as a 500."""
    refuses = "{{ raise_exception('Conversation roles must alternate user/assistant') }}"
    with pytest.raises(ValueError, match="messages: the chat template cannot render.*roles must alternate"):
        llm.chat([{"role": "user", "content": "hi"}], chat_template=refuses, use_tqdm=False)
    adds_a_dict = "{% for m in messages %}{{ m['content'] + m }}{% endfor %}"
    with pytest.raises(ValueError, match="messages: the chat template cannot render.*TypeError"):
        llm.chat([{"role": "user", "content": "hi"}], chat_template=adds_a_dict, use_tqdm=False)


def test_kv_utilization_is_high_and_below_one(tiny_model_dirs):
    llm = LLM(tiny_model_dirs["llama"], num_kv_blocks=64)
    llm.generate([{"prompt_token_ids": [5] * n} for n in (10, 50, 90, 130)],
                 SamplingParams(max_tokens=30, ignore_eos=True), use_tqdm=False)
    stats = llm.get_stats()
    # waste is < 1 block of 16 per request, on contexts of 10..160 tokens
    assert 0.8 < stats["kv_utilization"] < 1.0
    assert stats["max_num_running"] == 4
