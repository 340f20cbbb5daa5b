"""Adapters in the engine: every request's greedy tokens are Hugging Face's with its adapter applied by
PEFT, with adapters and the base model mixed in one call, under slot waits, preemption, chunked prefill,
the prefix cache and n > 1; a refused adapter fails its own request only; with more adapters than slots
over consecutive steps, slot loads are counted: each adapter loads once when it comes back, never evicted
while its step needs it."""
import shutil

import pytest
import torch

import peft_adapters
from peft_adapters import ADAPTERS, hf_top_logprobs, make_adapter, peft_greedy
from nanopaged import LLM, LoRARequest, SamplingParams
from nanopaged.core.block_pool import BlockPool
from nanopaged.core.request import Request
from nanopaged.lora.extension import LoRA
from nanopaged.lora.manager import adapter_id

GREEDY = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)
NAMES = [None, *ADAPTERS]          # the base model and the three adapters


def lora_requests(folders):
    return {name: LoRARequest(name, i + 1, folders[name]) for i, name in enumerate(ADAPTERS)} | {None: None}


def run(llm, prompts, loras, params=GREEDY):
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, lora_request=loras, use_tqdm=False)
    return [o.outputs[0].token_ids for o in outs]


@pytest.fixture(scope="module")
def expected(tiny_model_dirs, tiny_adapters, make_prompts):
    """Per model: prompts, the adapter of each (spread over NAMES) and PEFT's greedy tokens for each."""
    out = {}
    for model in ("llama", "qwen3"):
        prompts = make_prompts(512, n=8, seed=3)
        names = [NAMES[i % len(NAMES)] for i in range(len(prompts))]
        want = [peft_greedy(tiny_model_dirs[model], tiny_adapters[model][n] if n else None, [p], 10)[0]
                for p, n in zip(prompts, names)]
        out[model] = prompts, names, want
    return out


@pytest.mark.parametrize("model", ["llama", "qwen3"])
def test_three_adapters_and_the_base_model_in_one_call_match_peft(tiny_model_dirs, tiny_adapters, expected, model):
    prompts, names, want = expected[model]
    base = [peft_greedy(tiny_model_dirs[model], None, [p], 10)[0] for p, n in zip(prompts, names) if n]
    assert base != [w for w, n in zip(want, names) if n], "the adapters must change some greedy tokens"
    llm = LLM(tiny_model_dirs[model], dtype="float32", enable_lora=True, max_loras=4)
    reqs = lora_requests(tiny_adapters[model])
    assert run(llm, prompts, [reqs[n] for n in names]) == want
    stats = llm.get_stats()["lora"]
    assert stats["max_active_adapters"] == 3 and stats["adapters_read"] == 3 and stats["slot_waits"] == 0


def test_merged_peft_gives_the_same_tokens(tiny_model_dirs, tiny_adapters, expected):
    """Merging the adapter into the weights is the same model (nanopaged never merges: docs/12_lora.md)."""
    prompts, names, want = expected["llama"]
    for p, n, w in zip(prompts, names, want):
        if n:
            assert peft_greedy(tiny_model_dirs["llama"], tiny_adapters["llama"][n], [p], 10, merged=True)[0] == w


def test_fewer_slots_than_adapters_waits_and_never_mixes_them(tiny_model_dirs, tiny_adapters, expected):
    prompts, names, want = expected["llama"]
    llm = LLM(tiny_model_dirs["llama"], dtype="float32", enable_lora=True, max_loras=1, max_cpu_loras=1)
    reqs = lora_requests(tiny_adapters["llama"])
    assert run(llm, prompts, [reqs[n] for n in names]) == want
    stats = llm.get_stats()["lora"]
    assert stats["slot_waits"] > 0 and stats["max_active_adapters"] == 1
    assert stats["adapters_in_memory"] <= 3 and stats["adapters_read"] >= 3


def test_a_slot_the_step_still_needs_is_never_evicted_so_each_adapter_loads_once_per_entry(
        tiny_model_dirs, tiny_adapters, expected):
    """Three adapters through two slots over consecutive steps. Adapter "attn" ends first and "mlp" after
    it, so "attn" holds the least recently used slot when "all" and "attn" come back in one step: "all"
    must take the slot "mlp" left, not the one "attn" (needed by the same step) holds. Counted: before
    each forward pass exactly the step's adapters without a slot are loaded, and every row's slot holds
    its own adapter; the tokens are PEFT's."""
    prompts, names, want = expected["llama"]                    # names: None, attn, mlp, all, None, attn, ...
    llm = LLM(tiny_model_dirs["llama"], dtype="float32", enable_lora=True, max_loras=2, max_cpu_loras=3)
    engine, reqs = llm.llm_engine, lora_requests(tiny_adapters["llama"])
    manager, real, steps = engine.find(LoRA).manager, engine.find(LoRA).manager.before_forward, []

    def counted(out, inputs):
        before, loads = set(manager.slot_ids), manager.stats.slot_loads
        real(out, inputs)
        needed = {adapter_id(r) for r, _ in out.scheduled} - {0}
        held = {manager.slot_ids[slot] for slot, _ in manager.step.groups}
        steps.append((manager.stats.slot_loads - loads, len(needed - before), held == needed))
    manager.before_forward = counted
    tokens = {}

    def run(requests):                                           # (prompt index, max_tokens), to the end
        for i, max_tokens in requests:
            engine.add_request(str(i), {"prompt_token_ids": prompts[i]}, SamplingParams(
                temperature=0, max_tokens=max_tokens, ignore_eos=True), lora_request=reqs[names[i]])
        while engine.has_unfinished_requests():
            tokens.update({o.request_id: o.outputs[0].token_ids for o in engine.step() if o.finished})
    run([(1, 2), (2, 4)])                                        # attn, then mlp, end
    run([(3, 10), (5, 10)])                                      # all and attn in one step
    assert all(tokens[str(i)] == want[i][:len(tokens[str(i)])] for i in (1, 2, 3, 5))
    assert [(loads, missing) for loads, missing, _ in steps] == [(m, m) for _, m, _ in steps]
    assert all(held for _, _, held in steps) and sum(m for _, m, _ in steps) == 3


def test_preemption_and_chunked_prefill_keep_each_adapter(tiny_model_dirs, tiny_adapters, expected):
    prompts, names, want = expected["llama"]
    llm = LLM(tiny_model_dirs["llama"], dtype="float32", enable_lora=True, max_loras=2, num_kv_blocks=24,
              block_size=4, max_num_batched_tokens=16)
    reqs = lora_requests(tiny_adapters["llama"])
    assert run(llm, prompts, [reqs[n] for n in names]) == want
    assert llm.get_stats()["num_preemptions"] > 0


def test_the_prefix_cache_shares_blocks_within_an_adapter_only(tiny_model_dirs, tiny_adapters):
    prompt = list(range(5, 70))            # four full blocks of 16
    reqs = lora_requests(tiny_adapters["llama"])
    pool = BlockPool(8, 16, enable_caching=True)
    keys = {n: (reqs[n].lora_int_id,) if reqs[n] else () for n in NAMES}      # what the LoRA extension supplies
    hashes = {n: pool.block_hashes(Request("r", prompt, GREEDY, max_tokens=1, extra_keys=keys[n])) for n in NAMES}
    assert len({h[0] for h in hashes.values()}) == len(NAMES)      # every adapter names its own blocks
    again = pool.block_hashes(Request("s", prompt, GREEDY, max_tokens=1, extra_keys=keys["attn"]))
    assert again == hashes["attn"]
    llm = LLM(tiny_model_dirs["llama"], dtype="float32", enable_lora=True, max_loras=2, max_cpu_loras=3)
    p = {"prompt_token_ids": prompt}
    llm.generate([p], GREEDY, lora_request=reqs["attn"], use_tqdm=False)
    llm.reset_stats()
    llm.generate([p], GREEDY, lora_request=reqs["mlp"], use_tqdm=False)
    assert llm.get_stats()["prefix_cache_hits"] == 0
    llm.generate([p], GREEDY, lora_request=reqs["attn"], use_tqdm=False)
    assert llm.get_stats()["prefix_cache_hits"] == 64


def test_n_samples_fork_within_their_adapter(tiny_model_dirs, tiny_adapters, expected):
    prompts, names, want = expected["llama"]
    reqs = lora_requests(tiny_adapters["llama"])
    llm = LLM(tiny_model_dirs["llama"], dtype="float32", enable_lora=True, max_loras=4)
    params = SamplingParams(n=3, temperature=0, max_tokens=10, ignore_eos=True)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, lora_request=[reqs[n] for n in names],
                        use_tqdm=False)
    assert [[c.token_ids for c in o.outputs] for o in outs] == [[w] * 3 for w in want]
    assert llm.get_stats()["kv_sharing_saving"] > 0


def test_chat_takes_an_adapter(tiny_model_dirs, tiny_adapters):
    llm = LLM(tiny_model_dirs["llama"], dtype="float32", enable_lora=True)
    conv = [{"role": "user", "content": "hello there"}]
    req = lora_requests(tiny_adapters["llama"])["all"]
    [chat] = llm.chat(conv, GREEDY, lora_request=req, use_tqdm=False)
    prompt = llm.get_tokenizer().apply_chat_template(conv, add_generation_prompt=True, tokenize=False)
    [plain] = llm.generate(prompt, GREEDY, lora_request=req, use_tqdm=False)
    [base] = llm.generate(prompt, GREEDY, use_tqdm=False)
    assert chat.outputs[0].token_ids == plain.outputs[0].token_ids != base.outputs[0].token_ids


# ---- refused adapters: a ValueError naming what is wrong, at add time; the engine serves on --------------
@pytest.fixture(scope="module")
def lora_llm(tiny_model_dirs):
    return LLM(tiny_model_dirs["llama"], dtype="float32", enable_lora=True, max_loras=2, max_lora_rank=8)


@pytest.mark.parametrize("lora, named", [
    ({"r": 8, "target_modules": ["q_proj"], "use_dora": True}, "DoRA"),
    ({"r": 8, "target_modules": ["q_proj"], "modules_to_save": ["lm_head"]}, "modules_to_save"),
    ({"r": 8, "target_modules": ["embed_tokens", "q_proj"]}, "embed_tokens"),
    ({"r": 8, "target_modules": ["lm_head"]}, "lm_head"),
    ({"r": 16, "target_modules": ["q_proj"]}, "above max_lora_rank=8"),
])
def test_a_refused_adapter_fails_its_request_and_the_engine_serves_on(lora_llm, tiny_model_dirs, tmp_path,
                                                                      lora, named):
    make_adapter(tiny_model_dirs["llama"], tmp_path / "bad", **lora)
    with pytest.raises(ValueError, match=named):
        lora_llm.generate("hello", GREEDY, lora_request=LoRARequest("bad", 99, str(tmp_path / "bad")),
                          use_tqdm=False)
    assert not lora_llm.llm_engine.has_unfinished_requests()
    assert len(lora_llm.generate(["hello", "world"], GREEDY, use_tqdm=False)) == 2


def test_bad_lora_requests_are_refused_by_name(lora_llm, tiny_model_dirs, tiny_adapters, tmp_path):
    good = tiny_adapters["llama"]["attn"]
    with pytest.raises(ValueError, match="must be a LoRARequest"):
        lora_llm.generate("hi", GREEDY, lora_request="attn", use_tqdm=False)
    with pytest.raises(ValueError, match="got 1 lora_request for 2 prompts"):
        lora_llm.generate(["a", "b"], GREEDY, lora_request=[LoRARequest("a", 1, good)], use_tqdm=False)
    with pytest.raises(ValueError, match="no adapter_config.json"):
        lora_llm.generate("hi", GREEDY, lora_request=LoRARequest("gone", 7, str(tmp_path / "nowhere")),
                          use_tqdm=False)
    lora_llm.generate("hi", GREEDY, lora_request=LoRARequest("attn", 3, good), use_tqdm=False)
    with pytest.raises(ValueError, match="lora_int_id=3 already names adapter 'attn'"):
        lora_llm.generate("hi", GREEDY, lora_request=LoRARequest("other", 3, str(tmp_path)), use_tqdm=False)
    with pytest.raises(ValueError, match="needs an engine made with enable_lora=True"):
        LLM(tiny_model_dirs["llama"], dtype="float32").generate(
            "hi", GREEDY, lora_request=LoRARequest("attn", 1, good), use_tqdm=False)


def test_a_vanished_folder_fails_only_when_it_must_be_read_again(tiny_model_dirs, tiny_adapters, tmp_path):
    """In memory, an adapter outlives its folder; dropped from memory (max_cpu_loras), it is read again,
    and a folder gone by then fails that request, by name."""
    folder = tmp_path / "copy"
    shutil.copytree(tiny_adapters["llama"]["attn"], folder)
    llm = LLM(tiny_model_dirs["llama"], dtype="float32", enable_lora=True, max_loras=1, max_cpu_loras=1)
    mine, other = LoRARequest("mine", 1, str(folder)), LoRARequest("mlp", 2, tiny_adapters["llama"]["mlp"])
    first = run(llm, [[5, 6, 7, 8]], [mine])
    shutil.rmtree(folder)
    assert run(llm, [[5, 6, 7, 8]], [mine]) == first          # still in memory
    run(llm, [[5, 6, 7, 8]], [other])                          # takes its place (max_cpu_loras=1)
    with pytest.raises(ValueError, match="LoRA adapter 'mine': no adapter_config.json"):
        run(llm, [[5, 6, 7, 8]], [mine])
    assert llm.get_stats()["lora"]["adapters_in_memory"] == 1
    assert run(llm, [[5, 6, 7, 8]], [None]) and not llm.llm_engine.has_unfinished_requests()


@pytest.mark.parametrize("kwargs, match", [
    ({"max_loras": 0}, r"max_loras must be in \[1, inf\]"),
    ({"max_lora_rank": 1024}, r"max_lora_rank must be in \[1, 512\]"),
    ({"max_loras": 4, "max_cpu_loras": 2}, r"max_cpu_loras must be in \[4, inf\], got 2"),
    ({"tensor_parallel_size": 2}, "enable_lora=True runs in one process"),
    ({"lora_dtype": "float16"}, "lora_dtype='float16' is not supported"),
    ({"enable_lora_bias": True}, "refuses adapters with trained biases"),
])
def test_lora_settings_are_checked(tiny_model_dirs, kwargs, match):
    with pytest.raises(ValueError, match=match):
        LLM(tiny_model_dirs["llama"], dtype="float32", enable_lora=True, **kwargs)


def test_the_demo_model_in_bfloat16_is_close_to_peft_and_batch_invariant(demo_model_dir, tmp_path):
    """The default path (fused layers, nanopaged's bfloat16 kernel for the updates too) against PEFT in
    bfloat16 by vLLM's rule; and a request's tokens and logprobs the same alone as in a mixed batch."""
    from conftest import TOP_LOGPROBS, check_logprobs_close
    folders = {}
    for i, (name, lora) in enumerate(ADAPTERS.items()):
        make_adapter(demo_model_dir, tmp_path / name, seed=i, scale=0.3, dtype=torch.bfloat16, **lora)
        folders[name] = str(tmp_path / name)
    reqs = lora_requests(folders)
    llm = LLM(demo_model_dir, enable_lora=True, max_loras=3)
    assert llm.get_stats()["batch_invariant"] is True
    prompts = [[1, 504, 3458, 282, 4649, 314], [1, 9690, 253, 11612, 563, 260, 3736, 42], [1, 1073, 28, 5213, 3],
               [1, 13063, 2218, 253, 655]]
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True, logprobs=TOP_LOGPROBS)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, lora_request=[reqs[n] for n in NAMES],
                        use_tqdm=False)
    got = [(o.outputs[0].token_ids, [{t: lp.logprob for t, lp in d.items()} for d in o.outputs[0].logprobs])
           for o in outs]
    want = [hf_top_logprobs(demo_model_dir, folders[n] if n else None, p, 8) for p, n in zip(prompts, NAMES)]
    check_logprobs_close(got, want)
    for i, (p, n) in enumerate(zip(prompts, NAMES)):
        [alone] = llm.generate({"prompt_token_ids": p}, params, lora_request=reqs[n], use_tqdm=False)
        assert alone.outputs[0].token_ids == outs[i].outputs[0].token_ids
        assert alone.outputs[0].cumulative_logprob == outs[i].outputs[0].cumulative_logprob


def test_beam_search_runs_each_prompt_under_its_adapter_as_peft_does(tiny_model_dirs, tiny_adapters, make_prompts):
    from nanopaged import BeamSearchParams
    from transformers import AutoModelForCausalLM
    prompts = make_prompts(512, n=2, seed=30, min_len=4, max_len=30)
    model_dir, folder = tiny_model_dirs["llama"], tiny_adapters["llama"]["all"]
    hf = peft_adapters.peft.PeftModel.from_pretrained(
        AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32, local_files_only=True), folder).eval()
    want = [hf.generate(input_ids=torch.tensor([p]), num_beams=3, do_sample=False, max_new_tokens=8, min_new_tokens=8,
                        early_stopping=False, pad_token_id=0)[0].tolist() for p in prompts]
    llm = LLM(model_dir, dtype="float32", enable_lora=True, num_kv_blocks=100)
    outs = llm.beam_search([{"prompt_token_ids": p} for p in prompts],
                           BeamSearchParams(beam_width=3, max_tokens=8, ignore_eos=True),
                           lora_request=[lora_requests(tiny_adapters["llama"])["all"], None])
    assert outs[0].sequences[0].tokens == want[0]
    base = llm.beam_search({"prompt_token_ids": prompts[1]}, BeamSearchParams(beam_width=3, max_tokens=8,
                                                                              ignore_eos=True))
    assert outs[1].sequences[0].tokens == base[0].sequences[0].tokens
    assert llm.get_stats()["kv_cache_usage"] == 0.0
