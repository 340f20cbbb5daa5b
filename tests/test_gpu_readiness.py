"""What a first run on a GPU would hit, checked here without one.

The KV-sizing forward stays inside the rotary tables; the KV budget counts the memory torch
does not track; `auto` never hands float32 to flash-attn; the Triton launch grids respect
CUDA's limits; and scripts/gpu_check.sh plans the run a bare GPU machine can do (its
--dry-run). tests/attention/test_triton_aot.py compiles the kernels for a real GPU; tests/test_gpu.py
runs on one.
"""
import os
import subprocess
from pathlib import Path

import pytest
import torch

from nanopaged import LLM
from nanopaged.attention.backends import resolve_attention_backend

ROOT = Path(__file__).resolve().parent.parent


def test_profiling_forward_keeps_positions_inside_the_rotary_tables(tiny_model_dirs):
    """The batch that sizes the KV cache on CUDA has max_num_batched_tokens tokens; with
    max_model_len smaller, one sequence that long would index past the cos/sin tables
    (on CUDA a device-side assert that poisons the process). It is cut into sequences."""
    llm = LLM(tiny_model_dirs["llama"], dtype="float32", max_model_len=40, max_num_batched_tokens=100, num_kv_blocks=8)
    runner = llm.llm_engine.runner
    assert runner.model.model.rotary.cos.shape[0] == 40
    with pytest.raises(IndexError, match="out of bounds"):      # what one sequence of 100 positions would do
        runner.model.model.rotary.cos[torch.arange(100)]
    scratch_bytes = runner.profile_forward()               # 100 tokens as 40 + 40 + 20
    bytes_per_block = runner.model_config.kv_bytes_per_token(4) * 16
    assert scratch_bytes == (3 + 3 + 2) * bytes_per_block


def test_kv_budget_counts_memory_torch_does_not_track(tiny_model_dirs, monkeypatch):
    """budget = total x gpu_memory_utilization - (total - free - reserved by torch) - peak."""
    llm = LLM(tiny_model_dirs["llama"], num_kv_blocks=8, gpu_memory_utilization=0.9)
    runner = llm.llm_engine.runner
    gib = 2**30
    for name in ("empty_cache", "reset_peak_memory_stats", "synchronize"):
        monkeypatch.setattr(torch.cuda, name, lambda: None)
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda: (30 * gib, 100 * gib))   # (free, total)
    monkeypatch.setattr(torch.cuda, "memory_reserved", lambda: 50 * gib)
    monkeypatch.setattr(torch.cuda, "max_memory_allocated", lambda: 20 * gib + 1234)
    monkeypatch.setattr(runner, "profile_forward", lambda: 1234)          # the scratch cache's bytes
    # 90 GiB may be used; 20 GiB are used outside torch (context, other processes); the peak
    # of the forward without its scratch KV cache is 20 GiB: 50 GiB are left for the KV cache.
    assert runner._free_gpu_memory() == 50 * gib


def test_auto_gives_flash_attn_only_half_precision(monkeypatch):
    import nanopaged.attention.backends as config
    monkeypatch.setattr(config, "_installed", lambda package: True)      # as if flash-attn were installed
    assert resolve_attention_backend("auto", "cuda", "bfloat16") == "flash"
    assert resolve_attention_backend("auto", "cuda", "float16") == "flash"
    assert resolve_attention_backend("auto", "cuda", "float32") == "triton"   # flash-attn has no float32
    assert resolve_attention_backend("auto", "cpu", "bfloat16") == "torch"


def test_launch_grids_beyond_cuda_limits_are_a_clear_error():
    pytest.importorskip("triton")
    from nanopaged.attention.triton_kernels import _check_grid
    _check_grid((2**31 - 1, 65535, 8))
    for grid in ((2**31, 1, 1), (1, 65536, 1), (1, 1, 65536)):
        with pytest.raises(ValueError, match=r"exceeds CUDA's limits"):
            _check_grid(grid)


def gpu_check(*args, out):
    env = {**os.environ, "OUT": str(out)}
    return subprocess.run(["bash", str(ROOT / "scripts" / "gpu_check.sh"), *args], env=env,
                          capture_output=True, text=True, timeout=60)


def test_gpu_check_plans_a_run_a_bare_gpu_machine_can_do(tmp_path):
    done = gpu_check("--dry-run", out=tmp_path / "out")
    assert done.returncode == 0, done.stderr
    lines = done.stdout.splitlines()
    assert f"gpu_check: log {tmp_path}/out/gpu_check.log" in lines
    assert f"gpu_check: bench json {tmp_path}/out/gpu_bench.json" in lines
    assert f"PYTHONPATH={ROOT}" in done.stdout and "TRITON_INTERPRET=0" in done.stdout
    assert "PIP_NO_INDEX=1" in done.stdout
    steps = [line.split(" | ") for line in lines if line.startswith("step: ")]
    assert [s[0] for s in steps][-1] == "step: kv sizing"           # the one that fills the GPU: last
    budget = int(done.stdout.split(" budget ")[1].split("s")[0])
    assert budget <= 8 * 60                          # all steps together, whatever each step's timeout
    for _, _, command in steps:
        assert command.startswith("python3 ") and "pip" not in command.split()
        for word in command.split():
            if word.startswith("tests/"):
                assert (ROOT / word).is_file(), word
    bench, overlap = steps[-3][2], steps[-2][2]
    assert f"--json {tmp_path}/out/gpu_bench.json" in bench and "--random-weights" in bench
    assert f"--json {tmp_path}/out/gpu_overlap.json" in overlap and "--workload overlap" in overlap
    assert not (tmp_path / "out").exists()                       # a dry run writes nothing


def test_gpu_check_refuses_unknown_arguments(tmp_path):
    done = gpu_check("--frobnicate", out=tmp_path)
    assert done.returncode == 2 and "usage" in done.stderr
