"""`bench.py --workload spec` (benchmarks/spec.py) on the tiny models: the prompts repeat their passage
(benchmarks/spec_prompts.py), the typos are the same every run, the truncated draft model
(benchmarks/models.py) is what it says and loads as a draft model, the targets are computed from the
figures, and one tiny run yields every figure the JSON promises."""
import json
import pathlib
import sys

import pytest

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[2]))
import bench  # noqa: E402
from benchmarks import spec, spec_prompts  # noqa: E402
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
    passages = spec_prompts.split_passages(spec_prompts.TEXT.read_text(), tokenizer)
    prose = " ".join(spec_prompts.TEXT.read_text().split())
    assert len(passages) >= 4
    for p in passages:
        assert p in prose and p[-1] in ".!?\"'"
        assert spec_prompts.num_tokens(tokenizer, p) >= spec_prompts.MIN_PASSAGE_TOKENS
    assert "The Lighthouse Keeper's Year" not in passages[0]       # the heading is left out


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


def _runs(one: dict, at_once: dict) -> dict:
    """Runs as compare() leaves them: speedups by concurrency, for named configurations."""
    return {name: {"one_at_a_time": {"speedup_vs_off": one[name]}, "at_once": {"speedup_vs_off": at_once[name]}}
            for name in one}


def test_targets_follow_the_figures():
    t = spec.target_figures(_runs({"off": 1.0, "ngram_k3": 1.7, "ngram_k5": 1.9, "draft_k3": 3.0},
                                  {"off": 1.0, "ngram_k3": 1.2, "ngram_k5": 1.1, "draft_k3": 3.0}))
    one, batched = t["ngram_one_at_a_time"], t["ngram_at_once"]
    assert (one["value"], one["best_of"], one["target"], one["met"]) == (1.9, "ngram_k5", 1.8, True)
    assert (batched["value"], batched["best_of"], batched["target"], batched["met"]) == (1.2, "ngram_k3", 1.3, False)
    t = spec.target_figures({"off": {}, "ngram_k3": {"error": "boom"}})
    assert t["ngram_one_at_a_time"] == {"target": 1.8, "value": None, "best_of": None, "met": False}


def test_speedups_and_identical_outputs_are_against_off_at_the_same_concurrency():
    def run(tok_s, ids):
        return {"output_tokens_per_s": tok_s, "token_ids": ids}
    runs = {"off": {"one_at_a_time": run(10.0, [[1, 2], [3]]), "at_once": run(20.0, [[1, 2], [3]])},
            "ngram_k3": {"one_at_a_time": run(25.0, [[1, 2], [4]]), "at_once": run(30.0, [[1, 2], [3]])}}
    spec.compare(runs)
    assert runs["ngram_k3"]["one_at_a_time"]["speedup_vs_off"] == 2.5
    assert runs["ngram_k3"]["at_once"]["speedup_vs_off"] == 1.5
    assert runs["ngram_k3"]["one_at_a_time"]["identical_to_off"] == 1
    assert runs["ngram_k3"]["one_at_a_time"]["first_differences"] == [0]
    assert runs["ngram_k3"]["at_once"]["identical_to_off"] == 2


def test_spec_flags_and_peers():
    args = bench.parse_args(["--workload", "spec"])
    assert args.peers == [] and args.ngram_k == [3, 5] and (args.prompt_lookup_max, args.prompt_lookup_min) == (4, 2)
    assert (args.num_prompts, args.concurrency, args.draft_layers) == (16, 16, 6)
    assert bench.parse_args([]).peers == ["hf", "hf-paged"]           # the other workloads keep theirs
    assert bench.parse_args(["--workload", "spec", "--peers", "vllm"]).peers == ["vllm"]
    for bad in (["--peers", "hf"], ["--ngram-k", "3,x"], ["--prompt-lookup-min", "5"], ["--draft-layers", "0"]):
        with pytest.raises(SystemExit):
            bench.parse_args(["--workload", "spec", *bad])


def test_spec_workload_smoke(tiny_model_dirs, cache, tmp_path, capsys):
    out = tmp_path / "spec.json"
    r = bench.main(["--workload", "spec", "--model", tiny_model_dirs["llama"], "--num-prompts", "2",
                    "--concurrency", "2", "--spec-max-tokens", "6", "--ngram-k", "2,3", "--draft-layers", "1",
                    "--draft-k", "2", "--num-requests", "2", "--input-len", "4", "8", "--output-len", "4", "6",
                    "--num-kv-blocks", "64", "--dtype", "float32", "--json", str(out)])
    saved = json.loads(out.read_text())
    for key in ("workload", "settings", "prompts", "configs", "targets", "trace", "machine", "versions"):
        assert key in saved, key
    assert saved["workload"] == "spec" and "peers" not in saved
    assert set(saved["configs"]) == {"off", "ngram_k2", "ngram_k3", "draft_k2"}
    assert "self-draft" in saved["settings"]["draft_note"] and saved["settings"]["draft_layers"] == 1
    for name, c in saved["configs"].items():
        assert "error" not in c, (name, c.get("error"))
        for run in spec.RUNS:
            x = c[run]
            assert x["output_tokens_per_s"] > 0 and 0 < x["output_tokens"] <= 2 * 6
            assert x["speedup_vs_off"] == pytest.approx(x["output_tokens_per_s"] /
                                                        saved["configs"]["off"][run]["output_tokens_per_s"])
            assert 0 <= x["identical_to_off"] <= 2 and "token_ids" not in x
            if name == "off":
                assert x["spec_decode"] is None and x["identical_to_off"] == 2
            else:
                assert x["spec_decode"]["num_drafts"] >= 0
                assert x["mean_acceptance_length"] == x["spec_decode"]["mean_acceptance_length"]
    t = saved["targets"]["ngram_one_at_a_time"]
    best = max(saved["configs"][n]["one_at_a_time"]["speedup_vs_off"] for n in ("ngram_k2", "ngram_k3"))
    assert t["value"] == pytest.approx(best) and t["met"] == (best >= spec.TARGETS["one_at_a_time"])
    trace = saved["trace"]
    assert trace["off"]["output_tokens_per_s"] > 0 and "spec_decode" in trace["ngram_k2"]
    assert trace["cost"] == pytest.approx(1 - trace["ngram_k2"]["speedup_vs_off"])
    assert len(saved["prompts"]) == 2 and all("off_output" in p for p in saved["prompts"])
    printed = capsys.readouterr().out
    assert "one request at a time" in printed and "2 at once" in printed and "self-draft" in printed
    assert "target: n-gram one at a time >= 1.8x" in printed
    assert r["configs"].keys() == saved["configs"].keys()


def test_the_vllm_row_says_why_it_did_not_run(monkeypatch, tokenizer):
    monkeypatch.setattr(spec, "side_python", lambda args, peer: None)
    args = bench.parse_args(["--workload", "spec", "--peers", "vllm"])
    row = spec.run_vllm_spec(args, "unused", spec_prompts.build_workload(tokenizer, 1), {"dtype": "float32"})
    assert "setup_vllm_peer.sh" in row["skipped"]

