"""The disk tier in the engine: a restarted engine reads its prefix back and generates the same tokens; a bad file
is never used; every key that changes K/V (adapter, salt, dtype, weights) names other files; two processes share a
folder; a folder that cannot be written degrades to reading only, with one warning, and no request fails."""
import errno
import gc
import json
import logging
import os
import shutil
import subprocess
import sys
import threading
import weakref
from pathlib import Path

import pytest

from nanopaged import LLM, LoRARequest, SamplingParams
from nanopaged.engine.extension import StepObserver
from nanopaged.entrypoints.serve import parse_args
from nanopaged.kv_disk.extension import KVDisk
from nanopaged.kv_disk.store import SUFFIX, DiskStore

GREEDY = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
SYSTEM = list(range(20, 84))                                  # four blocks of 16 shared by every prompt
PROMPTS = [SYSTEM + [100 + i, 200 + i, 300 + i] for i in range(3)]
ROOT = Path(__file__).resolve().parents[2]


def engine(model, folder, **settings):
    settings.setdefault("dtype", "float32")
    return LLM(model, num_kv_blocks=64, kv_cache_disk_dir=str(folder), **settings)


def tokens(llm, prompts=PROMPTS, **fields):
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], GREEDY, use_tqdm=False, **fields)
    return [list(o.outputs[0].token_ids) for o in outs]


def tier(llm) -> dict:
    """The tier's figures once every block handed to the writer is on disk."""
    ext = llm.llm_engine.find(KVDisk)
    assert ext.flush()
    return llm.get_stats()["kv_disk"]


def files(folder) -> list[Path]:
    return sorted(p for p in Path(folder).iterdir() if p.name.endswith(SUFFIX))


@pytest.mark.parametrize("dtype", ["float32", "auto"])
def test_a_restarted_engine_reads_its_prefix_from_disk_and_generates_the_same_tokens(tiny_model_dirs, tmp_path, dtype):
    model = tiny_model_dirs["llama"]
    want = tokens(LLM(model, dtype=dtype, num_kv_blocks=64))              # no tier at all
    cold = engine(model, tmp_path, dtype=dtype)
    assert tokens(cold) == want
    assert tier(cold)["blocks_written"] >= len(SYSTEM) // 16
    computed_cold = cold.get_stats()["num_prompt_tokens_computed"]
    del cold
    warm = engine(model, tmp_path, dtype=dtype)                            # a new pool: only the disk has them
    assert tokens(warm) == want
    figures = tier(warm)
    assert figures["blocks_read"] >= len(SYSTEM) // 16 and figures["hits"] >= 1
    assert warm.get_stats()["num_prompt_tokens_computed"] < computed_cold
    assert figures["blocks_written"] == 0                                  # nothing it read is written again


def fill(model, folder, **settings) -> list[list[int]]:
    llm = engine(model, folder, **settings)
    want = tokens(llm)
    assert tier(llm)["blocks_written"] > 0
    return want


@pytest.mark.parametrize("damage, kind", [
    (lambda data: data[:len(data) // 2] + bytes([data[len(data) // 2] ^ 0x55]) + data[len(data) // 2 + 1:], "corrupt"),
    (lambda data: data[:len(data) - 100], "truncated"),
    (lambda data: data[:4] + (7).to_bytes(2, "little") + data[6:], "stale"),     # another format version
])
def test_a_damaged_file_is_never_used_counted_and_recomputed(tiny_model_dirs, tmp_path, damage, kind):
    model = tiny_model_dirs["llama"]
    want = fill(model, tmp_path)
    for path in files(tmp_path):
        path.write_bytes(damage(path.read_bytes()))
    llm = engine(model, tmp_path)
    assert tokens(llm) == want
    figures = tier(llm)
    assert figures["blocks_read"] == 0 and figures[f"dropped_{kind}"] >= 1
    assert figures["blocks_written"] >= 1                  # the first block, recomputed, is written anew
    again = engine(model, tmp_path)
    assert tokens(again) == want and tier(again)["blocks_read"] >= 1


def test_files_swapped_between_two_models_are_foreign(tiny_model_dirs, tmp_path):
    llama, qwen = tiny_model_dirs["llama"], tiny_model_dirs["qwen2"]
    want = fill(llama, tmp_path / "llama")
    fill(qwen, tmp_path / "qwen")
    theirs = {p.name.split("-")[0]: p for p in files(tmp_path / "qwen")}          # by block hash
    swapped = 0
    for path in files(tmp_path / "llama"):
        block_hash = path.name.split("-")[0]
        if block_hash in theirs:                       # the same tokens: the same chained hash in both
            shutil.copyfile(theirs[block_hash], path)
            swapped += 1
    assert swapped >= len(SYSTEM) // 16
    llm = engine(llama, tmp_path / "llama")
    assert tokens(llm) == want
    figures = tier(llm)
    assert figures["blocks_read"] == 0 and figures["dropped_foreign"] >= 1


def test_new_weights_in_the_same_folder_never_read_the_old_blocks(tiny_model_dirs, tmp_path):
    import torch
    from safetensors.torch import load_file, save_file
    model = tmp_path / "model"
    shutil.copytree(tiny_model_dirs["llama"], model)
    fill(model, tmp_path / "kv")
    old = files(tmp_path / "kv")
    weights = load_file(model / "model.safetensors")
    save_file({name: w + 0.01 * torch.ones_like(w) for name, w in weights.items()}, model / "model.safetensors",
              metadata={"format": "pt"})
    llm = engine(model, tmp_path / "kv")
    tokens(llm)
    assert tier(llm)["blocks_read"] == 0                   # other weights: another key, other names
    new = [p for p in files(tmp_path / "kv") if p not in old]
    assert new
    shutil.copyfile(old[0], new[0])                       # an old file under a new name is stale, not used
    llm = engine(model, tmp_path / "kv")
    tokens(llm)
    assert tier(llm)["dropped_stale"] == 1


def test_cache_salt_and_dtype_name_other_files(tiny_model_dirs, tmp_path):
    model = tiny_model_dirs["llama"]
    salted = [{"prompt_token_ids": p, "cache_salt": "tenant-a"} for p in PROMPTS]
    llm = engine(model, tmp_path)
    llm.generate(salted, GREEDY, use_tqdm=False)
    tier(llm)
    other = engine(model, tmp_path)
    tokens(other)                                                        # no salt: other hashes
    assert tier(other)["blocks_read"] == 0
    same = engine(model, tmp_path)
    same.generate(salted, GREEDY, use_tqdm=False)
    assert tier(same)["blocks_read"] >= 1
    in_bf16 = engine(model, tmp_path, dtype="bfloat16")
    tokens(in_bf16)                                                      # unsalted, float32's files exist now
    assert tier(in_bf16)["blocks_read"] == 0


def test_an_adapter_names_other_files_even_under_the_same_id_in_the_next_run(tiny_model_dirs, tiny_adapters,
                                                                              tmp_path):
    model, folders = tiny_model_dirs["llama"], tiny_adapters["llama"]
    first, second = sorted(folders)[:2]
    llm = engine(model, tmp_path, enable_lora=True)
    want = tokens(llm, lora_request=LoRARequest(first, 1, folders[first]))
    tier(llm)
    restarted = engine(model, tmp_path, enable_lora=True)
    tokens(restarted, lora_request=LoRARequest(second, 1, folders[second]))     # id 1 is another adapter now
    assert tier(restarted)["blocks_read"] == 0
    base = engine(model, tmp_path, enable_lora=True)
    tokens(base)
    assert tier(base)["blocks_read"] == 0
    again = engine(model, tmp_path, enable_lora=True)
    assert tokens(again, lora_request=LoRARequest(first, 1, folders[first])) == want
    assert tier(again)["blocks_read"] >= 1


WRITER = """
import json, sys
from nanopaged import LLM, SamplingParams
from nanopaged.kv_disk.extension import KVDisk
llm = LLM(sys.argv[1], dtype="float32", num_kv_blocks=64, kv_cache_disk_dir=sys.argv[2])
prompts = json.loads(sys.argv[3])
outs = llm.generate([{"prompt_token_ids": p} for p in prompts],
                    SamplingParams(temperature=0, max_tokens=6, ignore_eos=True), use_tqdm=False)
assert llm.llm_engine.find(KVDisk).flush()
print(json.dumps([list(o.outputs[0].token_ids) for o in outs]))
"""


def test_two_processes_writing_the_same_blocks_share_the_folder(tiny_model_dirs, tmp_path):
    model = tiny_model_dirs["llama"]
    env = {**os.environ, "PYTHONPATH": str(ROOT), "NANOPAGED_LOGGING_LEVEL": "WARNING"}
    command = [sys.executable, "-c", WRITER, model, str(tmp_path), json.dumps(PROMPTS)]
    runs = [subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
            for _ in range(2)]
    results = [run.communicate(timeout=600) for run in runs]
    assert all(run.returncode == 0 for run in runs), [err[-2000:] for _, err in results]
    outputs = [json.loads(out.strip().splitlines()[-1]) for out, _ in results]
    assert outputs[0] == outputs[1]
    assert not [p for p in tmp_path.iterdir() if p.name.endswith(".tmp")]
    llm = engine(model, tmp_path)
    assert tokens(llm) == outputs[0]
    figures = tier(llm)
    assert figures["blocks_read"] >= len(SYSTEM) // 16
    assert sum(figures[f"dropped_{kind}"] for kind in ("corrupt", "truncated", "foreign", "stale")) == 0


def test_the_folder_stays_within_kv_cache_disk_gb(tiny_model_dirs, tmp_path):
    model = tiny_model_dirs["llama"]
    probe = engine(model, tmp_path / "probe")
    tokens(probe, [SYSTEM])
    tier(probe)
    file_size = files(tmp_path / "probe")[0].stat().st_size
    bound = 6 * file_size
    llm = engine(model, tmp_path / "kv", kv_cache_disk_gb=bound / 2**30)
    prompts = [[i * 7 % 500 + 3 for i in range(k, k + 64)] + [5] for k in range(0, 400, 40)]   # 40 blocks in all
    tokens(llm, prompts)
    figures = tier(llm)
    assert figures["blocks_written"] > 6 and figures["files_evicted"] > 0
    assert sum(p.stat().st_size for p in files(tmp_path / "kv")) <= bound


class Warnings(logging.Handler):
    def __init__(self):
        super().__init__(logging.WARNING)
        self.messages = []

    def emit(self, record):
        self.messages.append(record.getMessage())


@pytest.fixture
def warnings():
    handler, logger = Warnings(), logging.getLogger("nanopaged.kv_disk.extension")
    logger.addHandler(handler)
    yield handler.messages
    logger.removeHandler(handler)


def test_a_full_disk_stops_writing_with_one_warning_and_fails_no_request(tiny_model_dirs, tmp_path, monkeypatch,
                                                                          warnings):
    model = tiny_model_dirs["llama"]
    want = tokens(LLM(model, dtype="float32", num_kv_blocks=64))

    def full(path, image, size, direct):
        path.write_bytes(b"half a block")
        raise OSError(errno.ENOSPC, "No space left on device")
    monkeypatch.setattr(DiskStore, "_write_file", staticmethod(full))
    llm = engine(model, tmp_path)
    assert tokens(llm) == want
    assert tokens(llm, [[p + 1 for p in prompt] for prompt in PROMPTS])      # more blocks to write: none tried
    figures = tier(llm)
    assert figures["blocks_written"] == 0 and figures["blocks_not_written"] >= 1 and not figures["writing"]
    assert figures["warnings"] == 1 and len(warnings) == 1 and "No space left" in warnings[0]
    assert not list(tmp_path.iterdir())                  # the half-written temporary file was removed


def test_a_read_only_folder_is_read_but_not_written_with_one_warning(tiny_model_dirs, tmp_path, monkeypatch, warnings):
    model = tiny_model_dirs["llama"]
    want = fill(model, tmp_path)
    before = {p: p.stat().st_size for p in files(tmp_path)}
    real_access = os.access
    monkeypatch.setattr(os, "access", lambda path, mode: mode != os.W_OK and real_access(path, mode))
    llm = engine(model, tmp_path)
    assert tokens(llm) == want
    assert tokens(llm, [[p + 1 for p in prompt] for prompt in PROMPTS])
    figures = tier(llm)
    assert figures["blocks_read"] >= 1 and figures["blocks_written"] == 0 and not figures["writing"]
    assert figures["warnings"] == 1 and len(warnings) == 1 and "not writable" in warnings[0]
    assert {p: p.stat().st_size for p in files(tmp_path)} == before


def test_a_folder_that_cannot_be_made_means_no_tier_with_one_warning(tiny_model_dirs, tmp_path, warnings):
    (tmp_path / "file").write_text("not a folder")
    llm = engine(tiny_model_dirs["llama"], tmp_path / "file" / "kv")
    assert len(tokens(llm)) == len(PROMPTS)
    figures = llm.get_stats()["kv_disk"]
    assert not figures["reading"] and not figures["writing"] and len(warnings) == 1


@pytest.mark.parametrize("settings, message", [
    ({"kv_cache_disk_gb": 0}, "kv_cache_disk_gb"),
    ({"enable_prefix_caching": False}, "enable_prefix_caching=False"),
    ({"tensor_parallel_size": 2}, "tensor_parallel_size=2"),
    ({"pipeline_parallel_size": 2}, "pipeline_parallel_size=2"),
])
def test_settings_the_tier_cannot_run_with_are_refused_before_loading(tiny_model_dirs, tmp_path, settings, message):
    with pytest.raises(ValueError, match=message):
        engine(tiny_model_dirs["llama"], tmp_path, **settings)


def test_serve_takes_the_tiers_flags():
    args = parse_args(["serve", "--kv-cache-disk-dir", "/var/cache/kv", "--kv-cache-disk-gb", "2.5"])
    assert (args.kv_cache_disk_dir, args.kv_cache_disk_gb) == ("/var/cache/kv", 2.5)


def test_preempted_requests_read_their_written_blocks_back_and_keep_their_tokens(tiny_model_dirs, tmp_path):
    """A pool too small for the batch: requests are preempted (recompute), and re-admitted ones find their full
    blocks on disk where the pool gave them away; every token is the same as without the tier. (The writer runs
    beside the steps; here each step waits for it, so the files exist when a request comes back.)"""
    model = tiny_model_dirs["llama"]
    prompts = [[(7 * i + 3 * k) % 500 + 3 for k in range(70)] for i in range(6)]
    params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    settings = dict(dtype="float32", num_kv_blocks=24, max_num_batched_tokens=64)

    def run(llm):
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
        return [list(o.outputs[0].token_ids) for o in outs]
    want = run(LLM(model, **settings))
    llm = LLM(model, kv_cache_disk_dir=str(tmp_path), **settings)
    llm.llm_engine.install(StepObserver(lambda record: llm.llm_engine.find(KVDisk).flush()))
    assert run(llm) == want
    assert llm.get_stats()["num_preemptions"] > 0 and tier(llm)["blocks_read"] > 0


def test_the_tiers_counters_reach_metrics(tiny_model_dirs, tmp_path):
    from nanopaged.entrypoints.core_messages import figures_of
    llm = engine(tiny_model_dirs["llama"], tmp_path)
    tokens(llm)
    tier(llm)
    counters = figures_of(llm.llm_engine, llm.stats).counters
    assert counters["kv_disk_blocks_written"][1] >= len(SYSTEM) // 16
    assert {"kv_disk_hits", "kv_disk_blocks_read", "kv_disk_bytes_read", "kv_disk_read_seconds",
            "kv_disk_bytes_written", "kv_disk_write_seconds", "kv_disk_dropped_corrupt"} <= counters.keys()


def test_the_writer_keeps_no_engine_alive_and_ends_with_it(tiny_model_dirs, tmp_path):
    """The writer thread holds the folder and its images, not the engine: an LLM let go is collected with its
    KV cache, and its writer finishes the queue and ends (it used to keep every engine of a process alive)."""
    llm = engine(tiny_model_dirs["llama"], tmp_path)
    tokens(llm)
    runner, writer = weakref.ref(llm.llm_engine.runner), llm.llm_engine.find(KVDisk).writer
    del llm
    gc.collect()
    assert runner() is None
    writer.thread.join(10)
    assert not writer.thread.is_alive() and not writer.pending
    assert len(files(tmp_path)) == writer.blocks_written >= len(SYSTEM) // 16


def test_a_block_waiting_for_the_writer_is_copied_once(tiny_model_dirs, tmp_path, monkeypatch):
    """While the writer is held up, the same prompts again (pool hits) name blocks already queued: none is
    copied or queued a second time, so the queue holds each block once and every one is written."""
    gate, write_image = threading.Event(), DiskStore.write_image
    monkeypatch.setattr(DiskStore, "write_image", lambda self, h, image: gate.wait(30) and write_image(self, h, image))
    llm = engine(tiny_model_dirs["llama"], tmp_path)
    want = tokens(llm)
    assert tokens(llm) == want
    queued = len(llm.llm_engine.find(KVDisk).writer.pending)
    gate.set()
    figures = tier(llm)
    assert queued >= len(SYSTEM) // 16
    assert figures["blocks_written"] == queued == len(files(tmp_path)) and figures["blocks_not_written"] == 0
