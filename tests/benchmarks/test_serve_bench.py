"""bench.py --workload serve (benchmarks/serve.py), its arithmetic and its bookkeeping, in seconds and
without a model server: percentiles, TTFT / TPOT / ITL from hand-made chunk timings, issue 40's targets
from hand-made figures, the chat set's shared system prompt, the command line, a stand-in OpenAI client
for the two endpoints, vLLM's settings matched to nanopaged's, and a server that does not start."""
import asyncio
import json
import math
import pathlib
import sys
from types import SimpleNamespace as NS

import pytest

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[2]))
from benchmarks import report, serve  # noqa: E402
from benchmarks.serve import RequestResult  # noqa: E402


# ---- percentiles, TTFT, TPOT, ITL -----------------------------------------------------------------

def test_percentiles_nearest_rank_in_ms():
    got = serve.percentiles([i / 1000 for i in range(100, 0, -1)])     # 1..100 ms, in any order
    assert got == pytest.approx({"p50": 50.0, "p90": 90.0, "p99": 99.0})
    three = serve.percentiles([0.3, 0.1, 0.2])                        # ranks ceil(q * 3): 2, 3, 3
    assert three == pytest.approx({"p50": 200.0, "p90": 300.0, "p99": 300.0})
    five = serve.percentiles([0.005, 0.001, 0.004, 0.002, 0.003])     # p50: rank ceil(2.5) = 3, the median
    assert five["p50"] == pytest.approx(3.0)
    assert all(math.isnan(v) for v in serve.percentiles([]).values())


def test_ttft_tpot_itl_from_chunk_times():
    # request a: text chunks at 0.1, 0.2, 0.4 s and 5 tokens (a chunk may carry several);
    # request b: 0.3, 0.35 s and 2 tokens; c failed; d: one chunk, one token (no TPOT, no gap)
    results = [RequestResult(True, "a", [0.1, 0.2, 0.4], 0.5, 5, True),
               RequestResult(True, "b", [0.3, 0.35], 0.4, 2, True),
               RequestResult(False, error="APIConnectionError: refused"),
               RequestResult(True, "d", [0.05], 0.06, 1, True)]
    f = serve.figures(results, duration_s=2.0)
    assert (f["completed"], f["failed"], f["errors"]) == (3, 1, ["APIConnectionError: refused"])
    assert f["requests_per_s"] == pytest.approx(1.5)
    assert f["output_tokens"] == 8 and f["output_tokens_per_s"] == pytest.approx(4.0)
    assert f["output_tokens_from"] == "usage"
    # TTFT: 50, 100, 300 ms
    assert (f["ttft_ms_p50"], f["ttft_ms_p99"]) == pytest.approx((100.0, 300.0))
    # TPOT: a (0.4 - 0.1) / 4 = 75 ms, b 0.05 / 1 = 50 ms; d has one token, so none
    assert (f["tpot_ms_p50"], f["tpot_ms_p99"]) == pytest.approx((50.0, 75.0))
    # ITL, pooled: a's gaps 100 and 200 ms, b's 50 ms
    assert (f["itl_ms_p50"], f["itl_ms_p90"], f["itl_ms_p99"]) == pytest.approx((100.0, 200.0, 200.0))


def test_output_tokens_counted_says_how():
    by_chunks = RequestResult(True, "x", [0.1, 0.2], 0.3, 2, tokens_from_usage=False)
    by_usage = RequestResult(True, "y", [0.1, 0.2], 0.3, 3, tokens_from_usage=True)
    assert serve.figures([by_chunks], 1.0)["output_tokens_from"] == "text chunks"
    assert serve.figures([by_chunks, by_usage], 1.0)["output_tokens_from"] == "usage where given, else text chunks"
    assert serve.figures([RequestResult(False, error="e")], 1.0)["output_tokens_from"] is None


def test_arrivals_poisson_at_the_rate_and_inf_all_at_once():
    assert serve.arrival_times(5, math.inf, seed=1) == [0.0] * 5
    times = serve.arrival_times(4000, 4.0, seed=1)
    assert times[0] == 0.0 and times == sorted(times)
    assert 3.8 < len(times) / times[-1] < 4.2                      # about 4 a second
    assert times == serve.arrival_times(4000, 4.0, seed=1) != serve.arrival_times(4000, 4.0, seed=2)


# ---- the targets -----------------------------------------------------------------------------------

def run_figures(tok_s: float, ttft_p99_ms: float) -> dict:
    return {"output_tokens_per_s": tok_s, "ttft_ms_p99": ttft_p99_ms}


def servers(ours: dict, theirs: dict | None) -> dict:
    out = {"nanopaged": {"datasets": {"random": ours}}}
    out["vllm"] = {"skipped": "no vllm environment"} if theirs is None else {"datasets": {"random": theirs}}
    return out


def test_saturated_throughput_target_met_missed_not_measured():
    met = serve.target_figures(servers({"inf": run_figures(150, 900)}, {"inf": run_figures(100, 3000)}),
                               ["random"])["random"]["saturated_throughput_vs_vllm"]
    assert met["status"] == "met" and met["value"] == pytest.approx(1.5)
    missed = serve.throughput_target({"inf": run_figures(149, 900)}, {"inf": run_figures(100, 3000)})
    assert missed["status"] == "missed" and missed["value"] == pytest.approx(1.49)
    no_inf = serve.throughput_target({"4": run_figures(150, 900)}, {"4": run_figures(100, 3000)})
    assert no_inf["status"] == "not measured" and no_inf["why"] == "no inf rate measured"
    no_vllm = serve.target_figures(servers({"inf": run_figures(150, 900)}, None), ["random"])
    assert no_vllm["random"]["saturated_throughput_vs_vllm"]["status"] == "not measured"
    assert no_vllm["random"]["ttft_p99_where_vllm_passes_2s"]["status"] == "not measured"


def test_ttft_target_at_the_lowest_rate_where_vllm_passes_2s():
    theirs = {"1": run_figures(30, 400), "16": run_figures(90, 2500), "4": run_figures(80, 2100),
              "inf": run_figures(100, 6000)}
    # vLLM passes 2 s first at 4/s (the keys sort as numbers: as text, "16" would come first);
    # nanopaged's p99 there decides
    met = serve.ttft_target({"1": run_figures(30, 300), "4": run_figures(85, 999), "16": run_figures(95, 1500),
                             "inf": run_figures(150, 3000)}, theirs)
    assert (met["status"], met["rate"], met["value"], met["vllm"]) == ("met", "4", 999, 2100)
    missed = serve.ttft_target({"1": run_figures(30, 300), "4": run_figures(85, 1000), "16": run_figures(95, 500),
                                "inf": run_figures(150, 500)}, theirs)
    assert (missed["status"], missed["rate"]) == ("missed", "4")


def test_ttft_target_not_reached_when_vllm_keeps_under_2s():
    t = serve.ttft_target({"1": run_figures(30, 300), "inf": run_figures(150, 900)},
                          {"1": run_figures(30, 400), "inf": run_figures(100, 2000)})     # 2000 does not pass 2 s
    assert t["status"] == "not reached: raise the rates" and t["value"] is None
    assert "raise the rates" in report.describe_target(t)
    gone = serve.ttft_target({"1": run_figures(30, 300)}, {"1": run_figures(30, 400), "2": run_figures(50, 2400)})
    assert gone["status"] == "not measured" and gone["rate"] == "2"


# ---- the prompts -----------------------------------------------------------------------------------

def test_chat_set_shares_one_system_prompt_and_is_seeded():
    a = serve.make_prompts(6, (4, 12), (8, 16), seed=3, dataset="chat", system_seed=0)
    b = serve.make_prompts(6, (4, 12), (8, 16), seed=4, dataset="chat", system_seed=0)   # another rate's
    systems = {p[0]["content"] for p, _ in a + b}
    assert len(systems) == 1                                        # one system prompt for every request
    system = systems.pop()
    assert abs(len(system.split()) - serve.SYSTEM_WORDS) <= 2       # "a few hundred words"
    assert all([m["role"] for m in p] == ["system", "user"] for p, _ in a)
    users = [p[1]["content"] for p, _ in a]
    assert len(set(users)) == len(users) and all(4 <= len(u.split()) <= 12 for u in users)
    assert all(8 <= n <= 16 for _, n in a)
    assert a == serve.make_prompts(6, (4, 12), (8, 16), seed=3, dataset="chat", system_seed=0)
    assert [p[1] for p, _ in a] != [p[1] for p, _ in b]             # each rate its own user messages
    other = serve.make_prompts(1, (4, 12), (8, 16), seed=3, dataset="chat", system_seed=1)
    assert other[0][0][0]["content"] != system


def test_random_set_is_plain_text_with_the_same_lengths_as_chat():
    text = serve.make_prompts(5, (4, 12), (8, 16), seed=3)
    chat = serve.make_prompts(5, (4, 12), (8, 16), seed=3, dataset="chat")
    assert all(isinstance(p, str) for p, _ in text)
    assert [n for _, n in text] == [n for _, n in chat]              # output lengths: the same draw
    assert [p + "?" for p, _ in text] == [p[1]["content"] for p, _ in chat]


# ---- the command line ------------------------------------------------------------------------------

def test_several_rates_inf_sorted_and_defaults():
    args = serve.parse_args(["--rate", "4", "inf", "1", "0.5", "4", "--dataset", "chat"])
    assert args.rate == [0.5, 1.0, 4.0, math.inf] and args.dataset == ["chat"]
    assert [serve.rate_label(r) for r in args.rate] == ["0.5", "1", "4", "inf"]
    d = serve.parse_args([])
    assert math.inf in d.rate and d.dataset == ["random", "chat"]
    assert d.peers == ["nanopaged-in-process", "vllm"]
    assert serve.parse_args(["--peers", "none"]).peers == []
    assert serve.parse_args(["--peers", "vllm,transformers", "--vllm-python", "/x/python"]).vllm_python == "/x/python"


@pytest.mark.parametrize("argv", [["--rate", "abc"], ["--rate", "0"], ["--rate", "-2"], ["--rate", "nan"],
                                  ["--rate"], ["--dataset", "sharegpt"], ["--peers", "sglang"],
                                  ["--num-requests", "0"], ["--output-len", "9", "3"]])
def test_bad_values_are_usage_errors(argv, capsys):
    with pytest.raises(SystemExit) as e:
        serve.parse_args(argv)
    assert e.value.code == 2 and "usage:" in capsys.readouterr().err


def test_flag_value_last_one_wins():
    flags = ["--max-num-seqs", "8", "--block-size", "16", "--max-num-seqs=32"]
    assert serve.flag_value(flags, "--max-num-seqs", 256) == "32"
    assert serve.flag_value(flags, "--max-num-batched-tokens", 2048) == 2048


# ---- the streamed requests, against a stand-in client ----------------------------------------------

class StandIn:
    """The two endpoints of openai's AsyncOpenAI, streaming canned chunks: 'a', 'b', 'c' (the chat one
    after a role chunk with no text), then a usage chunk where `usage` is true."""

    def __init__(self, usage: bool):
        self.usage, self.calls = usage, []
        self.completions = NS(create=self.create)
        self.chat = NS(completions=NS(create=self.create))

    async def create(self, **kw):
        self.calls.append(kw)
        chat = "messages" in kw

        async def chunks():
            if chat:
                yield NS(choices=[NS(delta=NS(content=None, role="assistant"))], usage=None)
            for text in "abc":
                await asyncio.sleep(0.01)
                yield NS(choices=[NS(delta=NS(content=text)) if chat else NS(text=text)], usage=None)
            if self.usage:
                yield NS(choices=[], usage=NS(completion_tokens=7))
        return chunks()


@pytest.mark.parametrize("dataset", ["random", "chat"])
def test_stream_one_times_text_chunks_and_counts_tokens(dataset):
    prompt, max_tokens = serve.make_prompts(1, (4, 8), (5, 5), seed=0, dataset=dataset)[0]
    client = StandIn(usage=True)
    r = asyncio.run(serve.stream_one(client, "m", prompt, max_tokens, {}))
    assert r.ok and r.text == "abc" and len(r.chunk_times) == 3     # the role chunk and the usage carry no text
    assert r.chunk_times == sorted(r.chunk_times) and r.ttft_s >= 0.01
    assert (r.output_tokens, r.tokens_from_usage) == (7, True)
    call = client.calls[0]
    assert call["stream_options"] == {"include_usage": True} and call["temperature"] == 0
    assert call["max_tokens"] == 5 and ("messages" in call) == (dataset == "chat")
    plain = asyncio.run(serve.stream_one(StandIn(usage=False), "m", prompt, max_tokens, {}))
    assert (plain.output_tokens, plain.tokens_from_usage) == (3, False)


def test_same_texts_and_compare_texts():
    assert serve.same_texts(["a", "b", None, "d"], ["a", "x", None, "d"]) == 2    # two failures do not agree
    figs = {"completed": 3}
    servers_ = {"nanopaged": {"datasets": {"chat": {"1": {**figs, "texts": ["a", "b", "c"]}}}},
                "vllm": {"datasets": {"chat": {"1": {**figs, "texts": ["a", "b", "z"]}}}},
                "transformers": {"skipped": "why"}}
    same = serve.compare_texts(servers_, ["chat"])
    assert same == {"chat": {"vllm": {"identical": 2, "of": 3}}}
    assert servers_["vllm"]["datasets"]["chat"]["1"]["same_text_as_nanopaged"] == 2
    assert "texts" not in servers_["nanopaged"]["datasets"]["chat"]["1"]


# ---- the servers -----------------------------------------------------------------------------------

SMOLLM2_SHAPE = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 576,
                 "intermediate_size": 1536, "num_hidden_layers": 30, "num_attention_heads": 9,
                 "num_key_value_heads": 3, "head_dim": 64, "vocab_size": 49152, "rms_norm_eps": 1e-5,
                 "rope_theta": 100000.0, "max_position_embeddings": 8192, "tie_word_embeddings": True,
                 "eos_token_id": 2, "bos_token_id": 1}


def test_ready_line_and_vllm_settings_follow_nanopaged(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps(SMOLLM2_SHAPE))
    line = ("nanopaged: serving 'demo' at http://127.0.0.1:4321/v1 (1456 KV blocks of 16 tokens, max_model_len "
            "8192; 1 API server(s), engine core pid 99)")
    ready = serve.ready_details(line)
    assert ready == {"num_kv_blocks": 1456, "block_size": 16, "max_model_len": 8192}
    s = serve.vllm_settings(str(tmp_path), "float32", ready, ["--max-num-seqs", "64"])
    # 1456 x 16 slots x (2 x 30 layers x 3 heads x 64 x 4 bytes) = the same KV bytes as nanopaged's
    assert s["kv_cache_bytes"] == 1456 * 16 * 2 * 30 * 3 * 64 * 4 and s["kv_cache_gib"] == 1
    assert (s["max_num_seqs"], s["max_num_batched_tokens"], s["max_model_len"]) == (64, 2048, 8192)
    small = serve.vllm_settings(str(tmp_path), "float32", {**ready, "num_kv_blocks": 100}, [])
    assert small["max_model_len"] == 1408 and small["max_num_seqs"] == 256    # what 1,600 slots hold, 5% spared
    with pytest.raises(RuntimeError, match="no nanopaged settings"):
        serve.vllm_settings(str(tmp_path), "float32", serve.ready_details("nanopaged: serving 'x' at y"), [])


def test_a_server_that_does_not_start_says_why(tmp_path):
    fake = tmp_path / "python"
    fake.write_text("#!/bin/sh\necho 'loading the model'\necho 'ValueError: no such model' >&2\nexit 3\n")
    fake.chmod(0o755)
    settings = {"dtype": "float32", "max_model_len": 64, "max_num_seqs": 4, "max_num_batched_tokens": 64,
                "kv_cache_bytes": 1 << 20, "kv_cache_gib": 1}
    with pytest.raises(RuntimeError) as e:
        serve.start_vllm(fake, str(tmp_path), settings, timeout_s=30)
    assert "exited with 3" in str(e.value) and "ValueError: no such model" in str(e.value)


def test_run_reports_a_failed_start_as_skipped(monkeypatch, tmp_path):
    """run() with servers that never start: every one is a row saying why, then the targets say
    'not measured'; nothing raises."""
    def no_server(name, *a):
        raise RuntimeError(f"{name} exited with 1:\nthe tail of its log") if name != "vllm" else ValueError("odd")
    monkeypatch.setattr(serve, "start_server", no_server)
    args = serve.parse_args(["--model", str(tmp_path), "--rate", "inf", "--peers", "vllm", "--device", "cpu",
                             "--num-requests", "2"])
    result = serve.run(args)
    assert result["servers"]["nanopaged"]["skipped"].endswith("the tail of its log")
    assert result["servers"]["vllm"] == {"skipped": "ValueError: odd"}
    assert {t["status"] for d in result["targets"].values() for t in d.values()} == {"not measured"}
    report.print_serve(result)                  # and the report prints it


class FakeServer:
    def __init__(self, name: str):
        self.name, self.base_url, self.model_name = name, f"http://127.0.0.1:1/{name}", "m"
        self.about = ({"num_kv_blocks": 100, "block_size": 16, "max_model_len": 1408} if name == "nanopaged"
                      else {"version": "0.32.0", "cpu_binding": ["core ids=[0]"]})

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        pass


def test_run_end_to_end_with_stand_in_servers(monkeypatch, tmp_path, capsys):
    """run() over stand-in servers and a stand-in load (vLLM twice as slow, answering 'x' to the first
    prompt of each run): the warm-ups apart from the rates, identical answers counted, both targets decided."""
    started, seen = [], []

    def start(name, model, device, dtype, args, ready):
        started.append((name, dict(ready)))
        if name == "transformers":
            raise RuntimeError("transformers serve exited with 1:\nthe tail of its log")
        return FakeServer(name)

    async def load(base_url, model, prompts, rate, seed, extra_body=None):
        slow = 2.0 if base_url.endswith("vllm") else 1.0
        seen.append((base_url.rsplit("/", 1)[1], rate, len(prompts), isinstance(prompts[0][0], list)))
        results = [RequestResult(True, "x" if slow == 2 and i == 0 else f"answer {p!r:.20}",
                                 [slow * t for t in (0.5, 0.6, 0.7)], slow, 3, True)
                   for i, (p, _) in enumerate(prompts)]
        return results, slow * 2.0
    monkeypatch.setattr(serve, "start_server", start)
    monkeypatch.setattr(serve, "run_load", load)
    result = serve.main(["--model", str(tmp_path), "--rate", "inf", "2", "--peers", "vllm,transformers",
                         "--device", "cpu", "--num-requests", "3", "--json", str(tmp_path / "out.json")])
    assert [n for n, _ in started] == ["nanopaged", "vllm", "transformers"]
    assert started[1][1] == {"num_kv_blocks": 100, "block_size": 16, "max_model_len": 1408}   # vLLM matched to it
    # per server: a warm-up of one request then each rate, lowest first, per set (random, then chat)
    assert seen[:6] == [("nanopaged", math.inf, 1, False), ("nanopaged", 2.0, 3, False),
                        ("nanopaged", math.inf, 3, False), ("nanopaged", math.inf, 1, True),
                        ("nanopaged", 2.0, 3, True), ("nanopaged", math.inf, 3, True)]
    saved = json.loads((tmp_path / "out.json").read_text())
    assert saved["servers"]["transformers"]["skipped"].endswith("the tail of its log")
    for name in ("nanopaged", "vllm"):
        assert set(saved["servers"][name]["datasets"]["chat"]) == {"2", "inf"}
        assert set(saved["servers"][name]["warmup"]) == {"random", "chat"}
    assert saved["versions"]["vllm"] == "0.32.0" and "matrix_flags" in saved["machine"]
    assert saved["same_text"] == {d: {"vllm": {"identical": 4, "of": 6}} for d in ("random", "chat")}
    t = saved["targets"]["chat"]
    assert t["saturated_throughput_vs_vllm"]["status"] == "met" and t["saturated_throughput_vs_vllm"]["value"] == 2.0
    # vLLM's TTFT p99 is 1 s at every rate: under 2 s, so the second target is not reached
    assert t["ttft_p99_where_vllm_passes_2s"]["status"] == "not reached: raise the rates"
    out = capsys.readouterr().out
    assert "transformers skipped" in out and "raise the rates" in out and "vllm 0.32.0: core ids=[0]" in out
    assert result["targets"] == saved["targets"]


def test_the_chat8_set_cycles_through_8_system_prompts_and_hit_rates_come_from_metrics_deltas():
    from benchmarks.serve import hit_rate, make_prompts
    prompts = make_prompts(16, (4, 8), (4, 8), seed=1, dataset="chat8")
    systems = [p[0]["content"] for p, _ in prompts]
    assert len(set(systems)) == 8 and systems[:8] == systems[8:]
    assert all(p[1]["role"] == "user" for p, _ in prompts)
    assert hit_rate((10.0, 100.0), (40.0, 140.0)) == 0.75
    assert hit_rate(None, (1.0, 2.0)) is None and hit_rate((1.0, 2.0), (1.0, 2.0)) is None
