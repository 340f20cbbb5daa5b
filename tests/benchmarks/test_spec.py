"""`bench.py --workload spec` (benchmarks/spec.py) on the tiny models: the prompts repeat their passage
(benchmarks/spec_prompts.py), the typos are the same every run, the agent's prompts ask the same tool call
with other values (benchmarks/spec_prompts.py), the truncated draft model (benchmarks/models.py) is what it
says and loads as a draft model, the targets are computed from the figures, and one tiny run yields every
figure and target the JSON promises."""
import json
import pathlib
import sys

import pytest

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[2]))
import bench  # noqa: E402
from benchmarks import spec, spec_agent, spec_prompts, spec_run  # noqa: E402
from benchmarks.models import build_draft_model  # noqa: E402


@pytest.fixture(scope="module")
def tokenizer(tiny_model_dirs):
    from nanopaged.engine.input_processor import load_tokenizer
    return load_tokenizer(tiny_model_dirs["llama"])


@pytest.fixture()
def cache(tmp_path, monkeypatch):
    monkeypatch.setenv("NANOPAGED_CACHE", str(tmp_path))
    return tmp_path


def test_passages_are_the_text_cut_at_sentence_ends(tokenizer):
    first = spec_prompts.TEXTS[0].read_text()
    passages = spec_prompts.split_passages(first, tokenizer)
    prose = " ".join(first.split())
    assert len(passages) >= 4
    for p in passages:
        assert p in prose and p[-1] in ".!?\"'"
        assert spec_prompts.num_tokens(tokenizer, p) >= spec_prompts.MIN_PASSAGE_TOKENS
    assert "The Lighthouse Keeper's Year" not in passages[0]       # the heading is left out
    every = spec_prompts.all_passages(tokenizer)                    # the texts in turn, none across two
    assert every[:len(passages)] == passages and len(every) > len(passages)
    assert not any("Canal Street" in p and "lighthouse" in p for p in every)


def test_typos_are_deterministic_and_few():
    text = ("The lighthouse keeper walked along the northern cliff every morning, counting seabirds and "
            "writing their numbers into a battered notebook")
    a, b = spec_prompts.add_typos(text, seed=7), spec_prompts.add_typos(text, seed=7)
    assert a == b != text
    changed = [(x, y) for x, y in zip(text.split(" "), a.split(" ")) if x != y]
    assert len(a.split(" ")) == len(text.split(" ")) and len(changed) == spec_prompts.NUM_TYPOS
    assert all(x[0] == y[0] and x[-1] == y[-1] and abs(len(x) - len(y)) <= 1 for x, y in changed)
    assert spec_prompts.add_typos(text, seed=8) != a                        # another seed, other typos


def test_prompts_ask_for_their_passage_in_the_chat_format(tokenizer):
    items = spec_prompts.build_workload(tokenizer, 6, seed=0)
    again = spec_prompts.build_workload(tokenizer, 6, seed=0)
    assert [it.prompt_token_ids for it in items] == [it.prompt_token_ids for it in again]
    assert {it.kind for it in items} == set(spec_prompts.INSTRUCTIONS)
    assert len({(it.kind, it.passage_index) for it in items}) == len(items)      # no prompt twice
    for it in items:
        text = tokenizer.decode(it.prompt_token_ids)
        assert spec_prompts.INSTRUCTIONS[it.kind].format(it.shown) in text
        assert text.rstrip().endswith("<|im_start|>assistant")                  # the generation prompt
        assert it.max_tokens == it.passage_tokens + spec_prompts.MAX_TOKENS_SLACK
        if it.kind == "repeat":
            assert it.shown == it.passage
        else:
            assert it.shown == spec_prompts.add_typos(it.passage, it.passage_index) != it.passage
    assert all(it.max_tokens == 9 for it in spec_prompts.build_workload(tokenizer, 2, max_tokens=9))
    with pytest.raises(ValueError, match="--num-prompts"):
        spec_prompts.build_workload(tokenizer, 10_000)


def test_the_draft_model_keeps_the_first_layers_and_loads_as_a_draft(tiny_model_dirs, cache):
    from safetensors import safe_open
    from nanopaged import LLM, SamplingParams
    target = tiny_model_dirs["llama"]                  # 2 layers, tied embeddings
    folder = build_draft_model(target, 1)
    assert folder.parent == cache / "bench"
    config = json.loads((folder / "config.json").read_text())
    assert config["num_hidden_layers"] == 1 and config["tie_word_embeddings"]
    with safe_open(str(folder / "model.safetensors"), "pt") as f:
        names = set(f.keys())
    assert {"model.embed_tokens.weight", "model.norm.weight"} <= names
    assert any(n.startswith("model.layers.0.") for n in names)
    assert not any(n.startswith("model.layers.1.") for n in names)
    assert (folder / "tokenizer.json").is_file()
    assert build_draft_model(target, 1) == folder                   # cached: made once
    with pytest.raises(ValueError, match="--draft-layers"):
        build_draft_model(target, 2)

    untied = build_draft_model(tiny_model_dirs["qwen2"], 1)      # its own lm_head goes along
    with safe_open(str(untied / "model.safetensors"), "pt") as f:
        assert "lm_head.weight" in f.keys()

    prompt = {"prompt_token_ids": list(range(3, 20))}
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    plain = LLM(target, num_kv_blocks=32, dtype="float32").generate(prompt, params, use_tqdm=False)
    llm = LLM(target, num_kv_blocks=32, dtype="float32",
              speculative_config={"method": "draft_model", "model": str(folder), "num_speculative_tokens": 2})
    drafted = llm.generate(prompt, params, use_tqdm=False)
    assert drafted[0].outputs[0].token_ids == plain[0].outputs[0].token_ids
    assert llm.get_stats()["spec_decode"]["num_drafts"] > 0


def test_agent_prompts_ask_the_same_call_with_other_values(tokenizer):
    items = spec_prompts.build_agent_workload(tokenizer, 6, seed=0)
    again = spec_prompts.build_agent_workload(tokenizer, 6, seed=0)
    assert [it.prompt_token_ids for it in items] == [it.prompt_token_ids for it in again]
    assert [it.date for it in spec_prompts.build_agent_workload(tokenizer, 6, seed=1)] != [it.date for it in items]
    assert len({it.city for it in items}) == 6 and {it.unit for it in items} <= set(spec_prompts.UNITS)
    example = spec_prompts.expected_answer(*spec_prompts.EXAMPLE)
    for it in items:
        text = tokenizer.decode(it.prompt_token_ids)
        assert text.count(json.dumps(spec_prompts.TOOL)) == 1 and text.count(example) == 1   # schema, worked answer
        assert text.rstrip().endswith("<|im_start|>assistant")
        assert spec_prompts.REQUEST.format(city=it.city, date=it.date, unit=it.unit) in text
        call, sentence = it.expected_answer.split("\n")
        assert json.loads(call) == {"name": "get_weather", "arguments": {"city": it.city, "date": it.date,
                                                                          "unit": it.unit}}
        assert sentence == f"I asked for the weather in {it.city} on {it.date} in {it.unit}."
        # the same prompt but for the request's line: everything before it is shared
        assert it.prompt_token_ids[:100] == items[0].prompt_token_ids[:100]
    with pytest.raises(ValueError, match="--agent-prompts"):
        spec_prompts.build_agent_workload(tokenizer, len(spec_prompts.CITIES) + 1)


def test_the_tool_call_schema_takes_the_taught_call_and_refuses_others():
    xgrammar = pytest.importorskip("xgrammar")
    assert xgrammar
    schema = spec_prompts.TOOL_CALL_SCHEMA
    assert schema["properties"]["name"]["enum"] == ["get_weather"]
    assert set(schema["properties"]["arguments"]["required"]) == {"city", "date", "unit"}
    assert spec_agent.valid_call(spec_prompts.tool_call("Lima", "2025-02-03", "celsius"),
                                spec_prompts.AgentPrompt("Lima", "2025-02-03", "celsius", "", [], 1))
    assert not spec_agent.valid_call('{"name": "get_weather"', spec_prompts.AgentPrompt("Lima", "x", "y", "", [], 1))


def _runs(by_c: dict) -> dict:
    """Runs as compare() leaves them: name -> {concurrency: speedup}."""
    return {name: {"concurrency": {str(c): {"speedup_vs_off": x} for c, x in speedups.items()}}
            for name, speedups in by_c.items()}


def test_targets_follow_the_figures():
    result = {"repeating": {"configs": _runs({"off": {1: 1.0, 16: 1.0, 32: 1.0},
                                              "ngram_k3": {1: 1.7, 16: 1.4, 32: 1.2},
                                              "ngram_k5": {1: 1.9, 16: 1.1, 32: 0.9},
                                              "suffix_k16": {1: 2.1, 16: 1.2, 32: 1.05},
                                              "draft_k3": {1: 3.0, 16: 3.0, 32: 3.0}})},
              "agent": {"configs": _runs({"off": {1: 1.0}, "ngram_k5": {1: 2.5}, "suffix_k16": {1: 1.9}})},
              "json": {"forced_vs_without": (1.6, "suffix_k16")}}
    t = spec.target_figures(result)
    assert set(t) == set(spec.TARGETS)
    assert (t["ngram_one_at_a_time"]["value"], t["ngram_one_at_a_time"]["of"], t["ngram_one_at_a_time"]["met"]) == \
        (1.9, "ngram_k5", True)
    assert (t["ngram_at_16"]["value"], t["ngram_at_16"]["met"]) == (1.4, True)          # the best k at 16: k=3
    assert t["suffix_vs_ngram_one_at_a_time"]["value"] == pytest.approx(2.1 / 1.9)
    # the sweep's configurations are the best k of each method one at a time: n-gram k=5 and suffix
    assert (t["never_slower_at_16"]["value"], t["never_slower_at_16"]["of"]) == (1.1, "ngram_k5")
    assert (t["never_slower_at_32"]["value"], t["never_slower_at_32"]["met"]) == (0.9, False)
    assert (t["best_at_16"]["value"], t["best_at_16"]["of"], t["best_at_16"]["met"]) == (1.2, "suffix_k16", False)
    assert (t["agent_suffix_one_at_a_time"]["value"], t["agent_suffix_one_at_a_time"]["met"]) == (1.9, False)
    assert (t["json_forced_one_at_a_time"]["value"], t["json_forced_one_at_a_time"]["met"]) == (1.6, True)
    empty = spec.target_figures({})
    assert all(x["value"] is None and not x["met"] for x in empty.values())       # not run: missed, not dropped


def test_speedups_and_identical_outputs_are_against_off_at_the_same_concurrency():
    def run(tok_s, ids):
        return {"output_tokens_per_s": tok_s, "token_ids": ids}
    runs = {"off": {"concurrency": {"1": run(10.0, [[1, 2], [3]]), "4": run(20.0, [[1, 2], [3]])}},
            "ngram_k3": {"concurrency": {"1": run(25.0, [[1, 2], [4]]), "4": run(30.0, [[1, 2], [3]])}}}
    spec_run.compare(runs)
    one, four = runs["ngram_k3"]["concurrency"]["1"], runs["ngram_k3"]["concurrency"]["4"]
    assert (one["speedup_vs_off"], four["speedup_vs_off"]) == (2.5, 1.5)
    assert (one["identical_to_off"], one["first_differences"], four["identical_to_off"]) == (1, [0], 2)


def test_forced_drafts_are_read_from_the_engine_and_a_run_without_them_is_the_baseline():
    args = bench.parse_args(["--workload", "spec"])
    configs = spec_agent.json_configurations(args)
    assert configs["off"][1] is None and configs["off"][2] is False       # no speculative config, no drafts
    assert {"ngram_k5", "suffix_k16"} <= set(configs)
    switch = spec_run.forced_drafts_switch()
    if switch:
        assert configs["ngram_k5_unforced"][1][switch] is False
    runs = {"off": {"forced_drafts": False, "concurrency": {"1": {"output_tokens_per_s": 10.0}}},
            "forced": {"forced_drafts": True, "concurrency": {"1": {"output_tokens_per_s": 16.0}}},
            "ngram_k5": {"forced_drafts": True, "concurrency": {"1": {"output_tokens_per_s": 18.0}}},
            "suffix_k16": {"forced_drafts": True, "concurrency": {"1": {"output_tokens_per_s": 15.0}}}}
    # the grammar's drafts alone over no drafts; n-gram's own drafts are not credited to the grammar
    assert spec_agent.forced_vs_without(runs, 1) == (1.6, "forced")
    assert spec_agent.forced_vs_without({"off": runs["off"]}, 1) == (None, None)


def test_spec_flags_and_peers():
    args = bench.parse_args(["--workload", "spec"])
    assert args.peers == [] and args.ngram_k == [3, 5] and (args.prompt_lookup_max, args.prompt_lookup_min) == (4, 2)
    assert (args.num_prompts, args.concurrency, args.draft_layers) == (32, [1, 4, 16, 32], 6)
    assert (args.suffix_k, args.agent_prompts, args.json_prompts) == ([16], 32, 16)
    assert args.spec_workloads == ["repeating", "agent", "json", "trace"]
    assert bench.parse_args(["--workload", "spec", "--concurrency", "16"]).concurrency == [16]   # one value still works
    assert spec_run.concurrency_levels([16, 32], 20) == [1, 16, 20]         # 1 always; none above the prompts
    assert bench.parse_args([]).peers == ["hf", "hf-paged"]           # the other workloads keep theirs
    assert bench.parse_args(["--workload", "spec", "--peers", "vllm"]).peers == ["vllm"]
    for bad in (["--peers", "hf"], ["--ngram-k", "3,x"], ["--prompt-lookup-min", "5"], ["--draft-layers", "0"],
                ["--concurrency", "0,4"], ["--suffix-k", "x"], ["--spec-workloads", "repeating,nope"],
                ["--agent-prompts", "0"]):
        with pytest.raises(SystemExit):
            bench.parse_args(["--workload", "spec", *bad])


def test_spec_workload_smoke(tiny_model_dirs, cache, tmp_path, capsys):
    out = tmp_path / "spec.json"
    r = bench.main(["--workload", "spec", "--model", tiny_model_dirs["llama"], "--num-prompts", "2",
                    "--concurrency", "2", "--spec-max-tokens", "6", "--ngram-k", "2,3", "--suffix-k", "4",
                    "--draft-layers", "1", "--draft-k", "2", "--agent-prompts", "3", "--json-prompts", "2",
                    "--num-requests", "2", "--input-len", "4", "8", "--output-len", "4", "6",
                    "--num-kv-blocks", "128", "--dtype", "float32", "--json", str(out)])
    saved = json.loads(out.read_text())
    for key in ("workload", "settings", "prompts", "repeating", "agent", "json", "trace", "targets", "machine",
                "versions"):
        assert key in saved, key
    assert saved["workload"] == "spec" and "peers" not in saved
    rep = saved["repeating"]
    assert rep["concurrency"] == [1, 2]
    assert set(rep["configs"]) == {"off", "ngram_k2", "ngram_k3", "suffix_k4", "draft_k2"}
    assert "self-draft" in saved["settings"]["draft_note"] and saved["settings"]["draft_layers"] == 1
    assert "current policy" in saved["settings"]["draft_policy"]
    for name, c in rep["configs"].items():
        assert "error" not in c, (name, c.get("error"))
        for level in ("1", "2"):
            x = c["concurrency"][level]
            assert x["output_tokens_per_s"] > 0 and 0 < x["output_tokens"] <= 2 * 6
            off = rep["configs"]["off"]["concurrency"][level]
            assert x["speedup_vs_off"] == pytest.approx(x["output_tokens_per_s"] / off["output_tokens_per_s"])
            assert 0 <= x["identical_to_off"] <= 2 and "token_ids" not in x and "texts" not in x
            if name == "off":
                assert x["spec_decode"] is None and x["identical_to_off"] == 2
            else:
                assert x["spec_decode"]["num_drafts"] >= 0
                assert x["mean_acceptance_length"] == x["spec_decode"]["mean_acceptance_length"]
    agent = saved["agent"]
    assert set(agent["configs"]) == {"off", "ngram_k2", "ngram_k3", "suffix_k4"} and "prompt_token_ids" not in agent
    for name, c in agent["configs"].items():
        assert "error" not in c, (name, c.get("error"))
        assert list(c["concurrency"]) == ["1"] and c["concurrency"]["1"]["num_requests"] == 3
        assert len(c["concurrency"]["1"]["call_s"]) == 3 and c["first_and_rest"]["first_tokens_per_s"] > 0
    assert len(agent["prompts"]) == 3 and all("off_output" in p and "expected_answer" in p for p in agent["prompts"])
    assert 0 <= agent["answers_as_taught"] <= 3 and agent["settings"]["enable_prefix_caching"]
    js = saved["json"]
    assert js["settings"]["concurrency"] == [1, 2] and "off" in js["configs"]
    for name, c in js["configs"].items():
        assert "error" not in c, (name, c.get("error"))
        assert isinstance(c["forced_drafts"], bool) and set(c["concurrency"]) == {"1", "2"}
    assert js["configs"]["off"]["forced_drafts"] is False
    assert 0 <= js["valid_calls"] <= 2
    trace = saved["trace"]
    assert trace["off"]["output_tokens_per_s"] > 0 and "spec_decode" in trace["ngram_k2"]
    assert trace["ngram_k2"]["cost"] == pytest.approx(1 - trace["ngram_k2"]["speedup_vs_off"])
    assert "speedup_vs_off" in trace["suffix_k4"]
    assert set(saved["targets"]) == set(spec.TARGETS)
    for name, t in saved["targets"].items():
        assert t["met"] == (t["value"] is not None and t["value"] >= t["target"]), name
    best = max(rep["configs"][n]["concurrency"]["1"]["speedup_vs_off"] for n in ("ngram_k2", "ngram_k3"))
    assert saved["targets"]["ngram_one_at_a_time"]["value"] == pytest.approx(best)
    assert saved["targets"]["agent_suffix_one_at_a_time"]["value"] == pytest.approx(
        agent["configs"]["suffix_k4"]["concurrency"]["1"]["speedup_vs_off"])
    assert saved["targets"]["never_slower_at_16"]["value"] is None          # 16 at once was not run: missed
    assert len(saved["prompts"]) == 2 and all("off_output" in p for p in saved["prompts"])
    printed = capsys.readouterr().out
    for line in ("one request at a time", "2 at once", "self-draft", "agent: one tool call asked 3 times",
                 "json: the agent's tool call", "target: repeating, best n-gram k over off, one at a time >= 1.8x",
                 "target: agent, suffix over off, one at a time >= 2.0x", "random-token trace"):
        assert line in printed, line
    assert r["repeating"]["configs"].keys() == rep["configs"].keys()


def test_one_workload_alone(tiny_model_dirs, cache, tmp_path):
    r = bench.main(["--workload", "spec", "--spec-workloads", "agent", "--model", tiny_model_dirs["llama"],
                    "--agent-prompts", "2", "--ngram-k", "2", "--suffix-k", "4", "--draft-layers", "1",
                    "--num-kv-blocks", "128", "--dtype", "float32"])
    assert "agent" in r and not {"repeating", "json", "trace"} & set(r)
    assert r["targets"]["ngram_one_at_a_time"]["value"] is None and r["targets"]["agent_suffix_one_at_a_time"]["value"]


def test_the_vllm_row_says_why_it_did_not_run(monkeypatch, tokenizer):
    monkeypatch.setattr(spec, "side_python", lambda args, peer: None)
    args = bench.parse_args(["--workload", "spec", "--peers", "vllm"])
    row = spec.run_vllm_spec(args, "unused", spec_prompts.build_workload(tokenizer, 1), {"dtype": "float32"})
    assert "setup_vllm_peer.sh" in row["skipped"]

