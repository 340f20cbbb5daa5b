"""The peers that run in environments of their own (vLLM, llama.cpp, CTranslate2), driven through the same
plumbing as on a machine that has them: benchmarks/peers.py writes the job, starts the side script under
another python, and reads its result back. No such engine is installed here, so small stand-ins of their Python
APIs take their place, and that python runs without site-packages (`python -S`): a side script that
needed anything of nanopaged's environment would fail here as it would in the peer's. And the
single-stream rule (benchmarks/decode_speed.py), computed from given timings."""
import pathlib
import sys
import textwrap
from types import SimpleNamespace

import pytest

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[2]))
import bench  # noqa: E402
from benchmarks import ctranslate2_peer, decode_speed, peers  # noqa: E402
from benchmarks.spec_prompts import build_workload  # noqa: E402
from benchmarks.trace import make_trace  # noqa: E402
from nanopaged.models.config import ModelConfig  # noqa: E402

# The stand-ins answer every prompt with its last token repeated, and count one draft of 3 tokens, 2 of
# them accepted, per prompt generated with a speculative_config.
VLLM = '''
from types import SimpleNamespace as NS

__version__ = "0.0-stand-in"
COUNTS = {"num_drafts": 0, "num_draft_tokens": 0, "num_accepted_tokens": 0}


class SamplingParams:
    def __init__(self, temperature, max_tokens, ignore_eos):
        self.max_tokens = max_tokens


class LLM:
    def __init__(self, model, **kwargs):
        self.kwargs = kwargs
        self.llm_engine = NS(vllm_config=NS(cache_config=NS(block_size=128)))

    def generate(self, prompts, params, use_tqdm=True):
        if self.kwargs.get("speculative_config"):
            for name, n in (("num_drafts", 1), ("num_draft_tokens", 3), ("num_accepted_tokens", 2)):
                COUNTS[name] += n * len(prompts)
        return [NS(outputs=[NS(token_ids=[p["prompt_token_ids"][-1]] * s.max_tokens)]) for p, s in zip(prompts, params)]

    def get_metrics(self):
        return [NS(name=f"vllm:spec_decode_{k}_total", value=v) for k, v in COUNTS.items()]
'''
VLLM_INPUTS = "def TokensPrompt(prompt_token_ids):\n    return {'prompt_token_ids': prompt_token_ids}\n"
LLAMA_CPP = '''
__version__ = "0.0-stand-in"
VOCAB = 16


class Llama:
    def __init__(self, model_path, **kwargs):
        self.scores = []

    def reset(self):
        pass

    def create_completion(self, prompt, max_tokens, temperature, logit_bias):
        return {"usage": {"completion_tokens": max_tokens}}

    def eval(self, ids):
        self.scores = [[0.0] * VOCAB for _ in ids]      # every token equally likely: perplexity VOCAB
'''

# CTranslate2's stand-in decodes row by row as the engine does: a row ends at max_length, when the callback
# returns True for its token, or at an end token. Each row answers its last prompt token, with EOS third:
# a caller that keeps the default end token gets rows cut short.
CTRANSLATE2 = '''
from types import SimpleNamespace as NS

__version__ = "0.0-stand-in"
VOCAB = [f"t{i}" for i in range(1024)]
EOS = 2


def get_supported_compute_types(device):
    return {"float32", "int8", "int8_float32"}


class Generator:
    def __init__(self, model_path, device, compute_type, intra_threads, inter_threads):
        self.compute_type = compute_type

    def generate_batch(self, start_tokens, max_length, end_token=None, include_prompt_in_result=True,
                       sampling_topk=1, callback=None):
        rows = [[] for _ in start_tokens]
        running = list(range(len(rows)))
        for step in range(max_length):
            for b in list(running):
                token = EOS if step == 2 else VOCAB.index(start_tokens[b][-1])
                if token == EOS and end_token != []:
                    running.remove(b)
                    continue
                rows[b].append(token)
                if callback is not None and callback(NS(batch_id=b, step=step, token_id=token)):
                    running.remove(b)
        return [NS(sequences_ids=[r]) for r in rows]
'''
CTRANSLATE2_CONVERTERS = '''
import json
import os

from ctranslate2 import VOCAB


class TransformersConverter:
    def __init__(self, model_name_or_path):
        self.model = model_name_or_path

    def convert(self, output_dir, quantization=None, force=False):
        os.makedirs(output_dir, exist_ok=force)
        with open(os.path.join(os.path.dirname(output_dir), "conversions.log"), "a") as log:
            log.write(str(quantization) + "\\n")
        open(os.path.join(output_dir, "model.bin"), "w").write(str(quantization))
        open(os.path.join(output_dir, "vocabulary.json"), "w").write(json.dumps(VOCAB))
        return output_dir
'''


@pytest.fixture(scope="module")
def side_python(tmp_path_factory) -> pathlib.Path:
    """A python for the side scripts: this one without site-packages (no torch, no transformers,
    no nanopaged dependencies), with the stand-ins on its path."""
    root = tmp_path_factory.mktemp("side")
    (root / "vllm").mkdir()
    (root / "vllm" / "__init__.py").write_text(VLLM)
    (root / "vllm" / "inputs.py").write_text(VLLM_INPUTS)
    (root / "llama_cpp.py").write_text(LLAMA_CPP)
    (root / "ctranslate2").mkdir()
    (root / "ctranslate2" / "__init__.py").write_text(CTRANSLATE2)
    (root / "ctranslate2" / "converters.py").write_text(CTRANSLATE2_CONVERTERS)
    python = root / "python"
    python.write_text(textwrap.dedent(f"""\
        #!/bin/sh
        PYTHONPATH="{root}:$PYTHONPATH" exec {sys.executable} -S "$@"
        """))
    python.chmod(0o755)
    return python


@pytest.fixture(scope="module")
def resolved() -> dict:
    return {"num_kv_blocks": 64, "block_size": 16, "max_model_len": 2048, "max_num_seqs": 8,
            "max_num_batched_tokens": 256, "dtype": "float32"}


def test_the_vllm_peer_runs_the_trace_in_its_own_environment(side_python, tiny_model_dirs, resolved):
    model_dir = tiny_model_dirs["llama"]
    trace = make_trace(3, (4, 8), (2, 5), seed=0, vocab_limit=512)
    config = SimpleNamespace(model_config=ModelConfig.from_folder(model_dir), dtype="float32")
    args = bench.parse_args(["--peers", "vllm", "--vllm-python", str(side_python)])
    one = {"prompt": trace.prompts[0], "output_tokens": 5}
    row = peers.run_peer("vllm", model_dir, trace, args, {}, config, resolved, one)
    assert "skipped" not in row, row.get("skipped")
    assert row["version"] == "0.0-stand-in" and row["output_tokens"] == trace.num_output_tokens
    assert row["token_ids"] == [[p[-1]] * n for p, n in zip(trace.prompts, trace.output_lens)]
    assert row["output_tokens_per_s"] > 0 and row["decode_tokens_per_s"] > 0
    # nanopaged's KV bytes, and the max_model_len those bytes hold (5% spare), in whole 128-token blocks
    assert row["kv_cache_bytes"] == 64 * 16 * config.model_config.kv_bytes_per_token(4)
    assert row["max_model_len"] == 896 < resolved["max_model_len"]


def test_the_llamacpp_peer_runs_the_trace_and_scores_the_text(side_python, tiny_model_dirs, resolved, tmp_path):
    (tmp_path / "model.gguf").write_bytes(b"")                      # run_llamacpp looks for the folder's GGUF
    trace = make_trace(2, (4, 8), (2, 5), seed=0, vocab_limit=512)
    config = SimpleNamespace(model_config=SimpleNamespace(eos_token_ids=[2]), dtype="float32")
    args = bench.parse_args(["--peers", "llama.cpp", "--llamacpp-python", str(side_python)])
    row = peers.run_peer("llama.cpp", str(tmp_path), trace, args, {}, config, resolved,
                         {"prompt": trace.prompts[0], "output_tokens": 4}, list(range(3, 13)))
    assert "skipped" not in row, row.get("skipped")
    assert row["output_tokens"] == trace.num_output_tokens and row["gguf"] == "model.gguf"
    assert row["decode_tokens_per_s"] > 0
    assert row["perplexity"] == pytest.approx(16)                   # the stand-in's uniform scores over 16 tokens


def test_a_peer_without_its_environment_says_how_to_make_one(monkeypatch, tmp_path):
    monkeypatch.setenv("HOME", str(tmp_path))
    monkeypatch.delenv("NANOPAGED_VLLM_PYTHON", raising=False)
    monkeypatch.delenv("NANOPAGED_LLAMACPP_PYTHON", raising=False)
    monkeypatch.delenv("NANOPAGED_CTRANSLATE2_PYTHON", raising=False)
    args = bench.parse_args(["--peers", "vllm,llama.cpp,ctranslate2"])
    for name, script in (("vllm", "setup_vllm_peer.sh"), ("llama.cpp", "setup_llamacpp_peer.sh"),
                         ("ctranslate2", "setup_ctranslate2_peer.sh")):
        row = peers.run_peer(name, "unused", None, args, {}, None, {})
        assert script in row["skipped"]


def test_the_ctranslate2_peer_converts_once_per_compute_type_and_runs_the_trace(side_python, tiny_model_dirs,
                                                                               resolved, monkeypatch, tmp_path):
    monkeypatch.setenv("NANOPAGED_CACHE", str(tmp_path))
    trace = make_trace(5, (4, 8), (2, 6), seed=0, vocab_limit=512)
    args = bench.parse_args(["--peers", "ctranslate2", "--ctranslate2-python", str(side_python),
                             "--ctranslate2-compute-type", "auto,float32"])
    for _ in range(2):                                              # the second run finds the conversions
        row = peers.run_peer("ctranslate2", tiny_model_dirs["llama"], trace, args, {}, None,
                             {**resolved, "max_num_seqs": 2})
        assert "skipped" not in row, row.get("skipped")
        assert row["version"] == "0.0-stand-in" and row["output_tokens"] == trace.num_output_tokens
        assert set(row["sweep"]) == {"int8_float32", "float32"}    # auto: int8 weights, float32 activations
        assert row["num_calls"] == 3 and row["max_batch_size"] == 2  # 5 requests, at most 2 a call
        assert row["compute_type"] in row["sweep"] and row["output_tokens_per_s"] == max(row["sweep"].values())
    cache = tmp_path / "bench" / "ctranslate2"
    assert sorted(p.name.rsplit("-", 1)[1] for p in cache.iterdir() if p.is_dir()) == ["float32", "int8_float32"]
    assert (cache / "conversions.log").read_text().split() == ["int8_float32", "float32"]


def test_the_ctranslate2_peer_ends_every_request_at_its_own_length():
    """One generate_batch call takes one max_length; the callback ends each row at its own, and with no
    end token EOS is a token like any other (ignore_eos). A generator that ignores the callback fails."""
    engine = {}
    exec(CTRANSLATE2, engine)
    generator, vocab = engine["Generator"]("unused", "cpu", "int8", 1, 1), engine["VOCAB"]
    prompts, lens = [[5, 6], [7], [8, 9, 10], [11]], [4, 1, 6, 3]
    outputs, num_calls = ctranslate2_peer.generate_exact(generator, vocab, prompts, lens, max_batch_size=3)
    assert [len(o) for o in outputs] == lens and num_calls == 2
    assert outputs[2] == [10, 10, 2, 10, 10, 10]

    class NoCallback(engine["Generator"]):
        def generate_batch(self, start_tokens, **kwargs):
            return super().generate_batch(start_tokens, **{**kwargs, "callback": None})
    with pytest.raises(RuntimeError, match="other lengths than asked"):
        ctranslate2_peer.generate_exact(NoCallback("unused", "cpu", "int8", 1, 1), vocab, prompts, lens, 3)


def test_the_ctranslate2_job_and_the_figures_read_back(monkeypatch, resolved, tmp_path):
    monkeypatch.setenv("NANOPAGED_CACHE", str(tmp_path))
    trace = make_trace(4, (4, 8), (2, 6), seed=0, vocab_limit=512)
    jobs = []

    def side(python, script, job):
        jobs.append(job)
        run = {"output_tokens": 20, "num_calls": 1, "load_s": 0.5}
        return {"version": "9.9", "supported": ["float32", "int8"],
                "runs": [{**run, "compute_type": "int8", "wall_s": 2.0}, {**run, "compute_type": "float32", "wall_s": 4.0}]}
    monkeypatch.setattr(peers, "run_side", side)
    row = peers.run_ctranslate2("MODEL", trace, resolved, pathlib.Path("py"), ["auto", " float32"])
    job = jobs[0]
    assert job["prompts"] == trace.prompts and job["output_lens"] == trace.output_lens
    assert job["compute_types"] == ["auto", "float32"] and job["max_batch_size"] == resolved["max_num_seqs"]
    assert job["threads"] == peers.torch.get_num_threads()
    assert job["cache_dir"] == str(tmp_path / "bench" / "ctranslate2")
    assert row["compute_type"] == "int8" and row["output_tokens_per_s"] == 10.0 and row["wall_s"] == 2.0
    assert row["sweep"] == {"int8": 10.0, "float32": 5.0} and row["supported_compute_types"] == ["float32", "int8"]


def test_auto_is_the_best_compute_type_the_cpu_supports():
    choose = ctranslate2_peer.choose_compute_type
    assert choose("auto", {"float32", "int8", "int8_float32"}) == "int8_float32"
    assert choose("auto", {"float32", "int8", "int8_float32", "int8_bfloat16", "bfloat16"}) == "int8_bfloat16"
    assert choose("float32", {"float32", "int8"}) == "float32"
    with pytest.raises(ValueError, match="supports float32, int8"):
        choose("int8_bfloat16", {"float32", "int8"})


def test_the_spec_workload_compares_vllm_without_and_with_its_ngram_and_suffix_speculation(side_python, tiny_model_dirs,
                                                                                           resolved):
    from benchmarks import spec
    from nanopaged.engine.input_processor import load_tokenizer
    model_dir = tiny_model_dirs["llama"]
    items = build_workload(load_tokenizer(model_dir), 2, max_tokens=6)
    args = bench.parse_args(["--workload", "spec", "--peers", "vllm", "--vllm-python", str(side_python),
                             "--ngram-k", "3", "--suffix-k", "16", "--concurrency", "1,2"])
    rows = spec.run_vllm_spec(args, model_dir, items, resolved)
    assert set(rows) == {"off", "ngram_k3", "suffix_k16"}
    assert rows["off"]["speculative_config"] is None and rows["ngram_k3"]["speculative_config"]["method"] == "ngram"
    assert rows["suffix_k16"]["speculative_config"]["method"] == "suffix"
    for c in ("1", "2"):
        off, ngram = rows["off"]["concurrency"][c], rows["ngram_k3"]["concurrency"][c]
        assert off["output_tokens"] == ngram["output_tokens"] == 2 * 6
        assert off["spec_decode"] is None
        assert ngram["speedup_vs_off"] == pytest.approx(ngram["output_tokens_per_s"] / off["output_tokens_per_s"])
        assert ngram["identical_to_off"] == 2
        # counted per run: one draft per prompt, 2 of its 3 tokens accepted
        assert ngram["spec_decode"]["num_drafts"] == 2 and ngram["spec_decode"]["mean_acceptance_length"] == 3.0


def test_decode_tokens_per_s_is_the_tokens_beyond_the_first_over_the_time_they_add(monkeypatch):
    """A stand-in clock: each call costs 1 s (the prefill) + 0.25 s a token, so decode runs at 4 tokens/s,
    whatever the prefill; every round times each engine in turn, after one warm-up each."""
    clock, calls = [0.0], []
    monkeypatch.setattr(decode_speed.time, "perf_counter", lambda: clock[0])

    def engine(name, seconds_per_token):
        def generate(tokens):
            calls.append((name, tokens))
            clock[0] += 1.0 + seconds_per_token * tokens
        return generate

    assert decode_speed.decode_tokens_per_s([engine("a", 0.25), engine("b", 0.5)], 9) == [4.0, 2.0]
    rounds = [("a", 1), ("a", 9), ("b", 1), ("b", 9)] * decode_speed.REPEATS
    assert calls == [("a", 9), ("b", 9)] + rounds
    assert decode_speed.tokens_per_s(9, one_s=1.25, n_s=3.25) == 4.0
    assert decode_speed.tokens_per_s(2, one_s=1.0, n_s=1.0) == pytest.approx(1e9)   # no time: no division by 0


def test_vllm_spec_counters_are_per_run():
    from benchmarks.vllm_peer import counters_since
    d = counters_since({"num_drafts": 12, "num_draft_tokens": 30, "num_accepted_tokens": 21},
                       {"num_drafts": 2, "num_draft_tokens": 0, "num_accepted_tokens": 1})
    assert d["num_drafts"] == 10 and d["mean_acceptance_length"] == 3.0 and d["draft_acceptance_rate"] == 20 / 30
    assert counters_since(None, {}) is None
