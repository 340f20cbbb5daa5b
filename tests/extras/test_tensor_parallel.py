"""Tensor parallelism over torch.distributed (gloo on CPU): N ranks compute what one process does.

Greedy tokens with tensor_parallel_size=2 equal tensor_parallel_size=1 on tiny Llama, Qwen2
and Qwen3 models (GQA), under a pool small enough to preempt, a token budget small enough
to chunk prompts, prefix-cache hits, n > 1 forks and prompt logprobs; each rank holds 1/N of
every sharded weight and of the KV cache; a worker's exception reaches the caller within
seconds, and no process or port outlives the LLM. docs/09_tensor_parallel.md.
"""
import gc
import multiprocessing
import signal
import socket
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
import torch.distributed as dist

from conftest import make_prompts, tokens_on_two_torchrun_nodes
from nanopaged import LLM, SamplingParams
from nanopaged.extras.tensor_parallel import TensorParallelError, TensorParallelRunner
from nanopaged.extras.tensor_parallel.rank_runner import RankRunner

# a hang guard, for a busy machine: each test starts ranks (processes importing torch), some several times
pytestmark = pytest.mark.timeout(600)

ROOT = Path(__file__).resolve().parents[2]
ARCHS = ["llama", "qwen2", "qwen3"]
MAX_TOKENS = 24
# preemption (24 blocks of 8 for 10 prompts of up to 60 tokens), chunked prefill (20 tokens a
# step), prefix caching on (the default)
TIGHT = {"block_size": 8, "num_kv_blocks": 24, "max_num_batched_tokens": 20, "max_num_seqs": 5}


def run_workload(llm) -> dict:
    """Everything the equality tests compare, from one LLM."""
    greedy = SamplingParams(temperature=0, max_tokens=MAX_TOKENS)
    prompts = [{"prompt_token_ids": p} for p in make_prompts(512, n=10, seed=1, min_len=3, max_len=60)]
    prefix = make_prompts(512, n=1, seed=2, min_len=40, max_len=40)[0]
    shared = [{"prompt_token_ids": prefix + p} for p in make_prompts(512, n=4, seed=3, min_len=2, max_len=9)]
    out = {"tight": [o.outputs[0].token_ids for o in llm.generate(prompts, greedy, use_tqdm=False)]}
    out["stats_tight"] = llm.get_stats()
    llm.reset_stats()
    llm.generate(shared[:1], greedy, use_tqdm=False)          # puts the prefix into the cache
    out["shared"] = [o.outputs[0].token_ids for o in llm.generate(shared, greedy, use_tqdm=False)]
    out["stats_shared"] = llm.get_stats()
    forks = llm.generate(prompts[:2], SamplingParams(n=2, temperature=0, max_tokens=8), use_tqdm=False)
    out["forks"] = [[c.token_ids for c in o.outputs] for o in forks]
    scored = llm.generate(prompts[:3], SamplingParams(temperature=0, max_tokens=2, prompt_logprobs=2),
                          use_tqdm=False)
    out["prompt_logprobs"] = [[None if d is None else {t: lp.logprob for t, lp in d.items()}
                               for d in o.prompt_logprobs] for o in scored]
    return out


@pytest.fixture(scope="module")
def results(tiny_model_dirs):
    """Per architecture: the workload at N = 1 and N = 2, and rank 0's parameter shapes and
    every rank's weight and KV bytes. One N = 2 LLM at a time (one process group per process),
    shut down before the next starts."""
    found = {}
    for arch in ARCHS:
        one = LLM(tiny_model_dirs[arch], dtype="float32", **TIGHT)
        two = LLM(tiny_model_dirs[arch], dtype="float32", tensor_parallel_size=2, **TIGHT)
        runner = two.llm_engine.runner
        found[arch] = {
            1: run_workload(one), 2: run_workload(two),
            "shapes": ({n: tuple(p.shape) for n, p in one.llm_engine.runner.model.named_parameters()},
                       {n: tuple(p.shape) for n, p in runner.model.named_parameters()}),
            "tp_dims": {n: getattr(runner.model.get_submodule(n.rpartition(".")[0]), "tp_dim", None)
                        for n, _ in runner.model.named_parameters()},
            "memory": runner.memory,
            "kv_bytes_1": one.llm_engine.runner.kv_cache.nbytes,
            "weight_bytes_1": sum(p.nbytes for p in one.llm_engine.runner.model.parameters()),
            "bytes_per_step": runner.bytes_sent / runner.steps_sent,
        }
        runner.shutdown()
    return found


@pytest.mark.parametrize("arch", ARCHS)
def test_greedy_tokens_with_two_ranks_equal_one_rank(results, arch):
    one, two = results[arch][1], results[arch][2]
    assert two["tight"] == one["tight"]
    assert two["shared"] == one["shared"]
    assert two["forks"] == one["forks"]
    assert two["stats_tight"]["num_preemptions"] > 0                 # the pool really was too small
    assert two["stats_tight"]["num_steps"] >= sum(map(len, make_prompts(512, n=10, seed=1))) / 20
    assert two["stats_shared"]["prefix_cache_hits"] > 0
    assert len({tuple(t) for t in two["tight"]}) > 5                  # not a vacuous comparison


@pytest.mark.parametrize("arch", ARCHS)
def test_prompt_logprobs_with_two_ranks_match_one_rank(results, arch):
    for a, b in zip(results[arch][1]["prompt_logprobs"], results[arch][2]["prompt_logprobs"]):
        assert (a[0], b[0]) == (None, None)
        for da, db in zip(a[1:], b[1:]):
            assert da.keys() == db.keys()
            assert all(abs(da[t] - db[t]) < 1e-4 for t in da)         # all-reduce order: float noise only


@pytest.mark.parametrize("arch", ARCHS)
def test_each_rank_holds_half_of_every_sharded_weight(results, arch):
    r = results[arch]
    full, rank0 = r["shapes"]
    assert full.keys() == rank0.keys()
    sharded_bytes = replicated_bytes = 0
    for name, shape in full.items():
        dim = r["tp_dims"][name]
        expected = list(shape)
        if dim is not None and (dim == 0 or name.endswith("weight")):
            expected[dim] //= 2
            sharded_bytes += 4 * shape[0] * (shape[1] if len(shape) > 1 else 1)
        else:
            replicated_bytes += 4 * shape[0]
        assert rank0[name] == tuple(expected), name
    (w0, kv0), (w1, kv1) = r["memory"]
    assert w0 == w1 == sharded_bytes // 2 + replicated_bytes
    assert sharded_bytes + replicated_bytes == r["weight_bytes_1"]
    assert kv0 == kv1 == r["kv_bytes_1"] // 2                        # same blocks, half the KV heads


def test_every_step_message_is_small(results):
    # the tight setting: at most 20 tokens and 5 requests a step; a few hundred bytes
    assert all(0 < results[a]["bytes_per_step"] < 2048 for a in ARCHS)


# ---- bad settings ---------------------------------------------------------------------
@pytest.mark.parametrize("size, message", [
    (0, "tensor_parallel_size must be in [1, inf], got 0"),
    (-2, "tensor_parallel_size must be in [1, inf], got -2"),
    (1.5, "tensor_parallel_size must be an integer, got 1.5"),
    (3, "tensor_parallel_size=3 must divide the model's num_attention_heads=4"),
    (4, "tensor_parallel_size=4 must divide the model's num_key_value_heads=2"),
])
def test_bad_sizes_raise_before_any_process_starts(tiny_model_dirs, size, message):
    with pytest.raises(ValueError) as e:
        LLM(tiny_model_dirs["llama"], dtype="float32", tensor_parallel_size=size)
    assert message in str(e.value)
    assert not multiprocessing.active_children() and not dist.is_initialized()


def test_more_ranks_than_cuda_devices_is_a_value_error(tiny_model_dirs, monkeypatch):
    import torch
    import nanopaged.config
    monkeypatch.setattr(nanopaged.config, "_cuda_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    with pytest.raises(ValueError, match=r"tensor_parallel_size=2 is larger than the 1 CUDA devices"):
        LLM(tiny_model_dirs["llama"], dtype="float32", device="cuda", tensor_parallel_size=2)
    assert not multiprocessing.active_children()


# ---- failure and shutdown --------------------------------------------------------------
class FailingRankRunner(RankRunner):
    """Rank 1 raises in its third step (spawned workers import this module to find the class)."""
    steps = 0

    def run(self, step):
        self.steps += 1
        if self.group.rank == 1 and self.steps == 3:
            raise RuntimeError("injected failure in rank 1")
        return super().run(step)


class LLMWithFailingWorker(LLM):
    def make_runner(self, config, stages):
        return TensorParallelRunner(config, rank_runner_class=FailingRankRunner)


def test_a_worker_exception_reaches_the_caller_within_seconds(tiny_model_dirs):
    llm = LLMWithFailingWorker(tiny_model_dirs["llama"], tensor_parallel_size=2)
    runner = llm.llm_engine.runner
    prompts = [{"prompt_token_ids": p} for p in make_prompts(512, n=4, seed=5)]
    start = time.monotonic()
    with pytest.raises(TensorParallelError, match="injected failure in rank 1"):
        llm.generate(prompts, SamplingParams(temperature=0, max_tokens=16), use_tqdm=False)
    # a hang guard, far from the 5-minute collective timeout that would otherwise end the wait; the
    # message above, the worker's own, is what shows the error travelled by the report, not a timeout
    assert time.monotonic() - start < 120
    assert all(not p.is_alive() for p in runner.workers.processes)
    assert not multiprocessing.active_children() and not dist.is_initialized()
    with pytest.raises(TensorParallelError, match="have stopped"):       # later calls: a clear error
        llm.generate(prompts, SamplingParams(temperature=0, max_tokens=4), use_tqdm=False)
    assert llm.get_stats()["kv_cache_usage"] == 0.0                       # the aborted requests' blocks came back


def test_deleting_the_llm_ends_the_workers_and_frees_the_port(tiny_model_dirs):
    llm = LLM(tiny_model_dirs["qwen2"], dtype="float32", tensor_parallel_size=2)
    runner = llm.llm_engine.runner
    processes, port = runner.workers.processes, runner.workers.store.port
    assert [p.is_alive() for p in processes] == [True]
    del llm, runner
    gc.collect()
    assert all(p.exitcode == 0 for p in processes)                       # stopped by the STOP message
    assert not multiprocessing.active_children() and not dist.is_initialized()
    with socket.socket() as s:                                           # nothing listens on it any more
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        s.bind(("127.0.0.1", port))


PROGRAM = textwrap.dedent("""
    import sys, time
    from nanopaged import LLM, SamplingParams
    llm = LLM(sys.argv[1], dtype="float32", tensor_parallel_size=2)
    out = llm.generate([{"prompt_token_ids": [5, 6, 7]}], SamplingParams(temperature=0, max_tokens=4), use_tqdm=False)
    print(*[p.pid for p in llm.llm_engine.runner.workers.processes], flush=True)
    if sys.argv[2] == "hang":
        time.sleep(600)
""")


def _gone(pid: int, within_s: float) -> bool:
    """The process has exited (a zombie waiting for a reaper counts as exited)."""
    deadline = time.monotonic() + within_s
    while time.monotonic() < deadline:
        try:
            state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
        except (FileNotFoundError, ProcessLookupError):
            return True
        if state in ("Z", "X"):
            return True
        time.sleep(0.1)
    return False


@pytest.mark.parametrize("how", ["exit", "hang"])
def test_no_worker_outlives_its_program(tiny_model_dirs, how):
    """`exit`: the program ends without deleting the LLM (atexit stops the workers); `hang`: it is
    killed with SIGKILL, no cleanup runs, and the workers see their driver's sockets close."""
    proc = subprocess.Popen([sys.executable, "-c", PROGRAM, tiny_model_dirs["llama"], how],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=ROOT)
    try:
        pids = [int(x) for x in proc.stdout.readline().split()]
        assert len(pids) == 1, proc.stderr.read() if proc.poll() is not None else "no pids"
        if how == "hang":
            proc.send_signal(signal.SIGKILL)
        assert proc.wait(timeout=120) == (0 if how == "exit" else -signal.SIGKILL)
        assert all(_gone(pid, within_s=60) for pid in pids)              # hang guards, for a loaded machine
    finally:
        if proc.poll() is None:
            proc.kill()


def test_a_script_without_a_main_guard_fails_fast_with_a_clear_error(tiny_model_dirs, tmp_path):
    """spawn re-imports the script in the worker, which would start workers of its own: the
    driver sees the worker die before joining and says what to do, instead of timing out."""
    script = tmp_path / "no_guard.py"
    script.write_text(PROGRAM)
    proc = subprocess.run([sys.executable, str(script), tiny_model_dirs["llama"], "exit"],
                          capture_output=True, text=True, timeout=240, cwd=ROOT)
    assert proc.returncode != 0
    # "exit code 1": the driver saw the worker die; the rendezvous' timeout would find it alive (None)
    assert "tensor-parallel worker rank 1 did not start (exit code 1)" in proc.stderr.splitlines()[-1]
    assert "if __name__ == '__main__':" in proc.stderr.splitlines()[-1]


TORCHRUN_PROGRAM = textwrap.dedent("""
    import sys
    from nanopaged import LLM, SamplingParams
    llm = LLM(sys.argv[1], dtype="float32", tensor_parallel_size=2)      # rank 1 serves steps in here, then exits
    outs = llm.generate([{"prompt_token_ids": p} for p in [[5, 6, 7], [9, 8, 7, 6, 5, 4]]],
                        SamplingParams(temperature=0, max_tokens=8), use_tqdm=False)
    print("TOKENS", [o.outputs[0].token_ids for o in outs], flush=True)
""")


def test_torchrun_starts_the_ranks_itself(tiny_model_dirs, tmp_path):
    """The multi-machine launch (docs/09_tensor_parallel.md), on one machine: torchrun runs the
    same script as every rank; rank 0 drives, rank 1 serves inside LLM() and exits."""
    script = tmp_path / "tp.py"
    script.write_text(TORCHRUN_PROGRAM)
    proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
                           str(script), tiny_model_dirs["llama"]],
                          capture_output=True, text=True, timeout=240, cwd=ROOT)     # a hang guard
    assert proc.returncode == 0, proc.stderr[-3000:]
    [line] = [x for x in proc.stdout.splitlines() if x.startswith("TOKENS")]
    one = LLM(tiny_model_dirs["llama"], dtype="float32").generate(
        [{"prompt_token_ids": p} for p in [[5, 6, 7], [9, 8, 7, 6, 5, 4]]],
        SamplingParams(temperature=0, max_tokens=8), use_tqdm=False)
    assert line == f"TOKENS {[o.outputs[0].token_ids for o in one]}"


def test_torchrun_across_two_nodes_equals_one_rank(tiny_model_dirs, tmp_path):
    """The multi-machine launch as it runs on two machines (docs/09_tensor_parallel.md): one torchrun
    per node, `--nnodes 2 --node-rank 0|1 --nproc-per-node 1`, meeting at the master's address (here
    loopback, each node a separate torchrun process); TP=2 across the nodes equals TP=1."""
    script = tmp_path / "tp.py"
    script.write_text(TORCHRUN_PROGRAM)
    line = tokens_on_two_torchrun_nodes(script, tiny_model_dirs["llama"])
    one = LLM(tiny_model_dirs["llama"], dtype="float32").generate(
        [{"prompt_token_ids": p} for p in [[5, 6, 7], [9, 8, 7, 6, 5, 4]]],
        SamplingParams(temperature=0, max_tokens=8), use_tqdm=False)
    assert line == f"TOKENS {[o.outputs[0].token_ids for o in one]}"
