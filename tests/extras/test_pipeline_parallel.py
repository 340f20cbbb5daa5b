"""Pipeline parallelism over torch.distributed (gloo on CPU): P stages of layers compute what one process does.

Greedy float32 tokens with pipeline_parallel_size=2 equal one process's on a tiny dense model (tied head:
stage 0 holds it with the embedding, and computes the logits of the rows the last stage sends back) and a
tiny mixture of experts (3 layers split by weight, a dense layer among them), under a pool small enough to
preempt, a token budget small enough to chunk prompts, and prefix-cache hits; with 2 x 2 ranks (tensor x
pipeline) too. Each rank's K/V holds its own layers only, and the ranks' weights add up to one process's
(no tensor held twice); two micro-batches really are in flight at once and no request waiting for its token
is in another one; torchrun launches it across two nodes; a rank that fails ends every process with its
error, and a worker that does not start is named as a pipeline's.
docs/09_tensor_parallel.md, "Pipeline parallelism".
"""
import itertools
import json
import multiprocessing
import random
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from conftest import EOS_TOKEN_ID, _randomize, _tiny_tokenizer, make_prompts, tokens_on_two_torchrun_nodes
from nanopaged import LLM, SamplingParams
from nanopaged.extras.pipeline_parallel.runner import PipelineParallelRunner
from nanopaged.extras.pipeline_parallel.stage_runner import StageRunner
from nanopaged.extras.pipeline_parallel.stages import part_weights, split_model, stage_layers, stage_rename
from nanopaged.models.config import ModelConfig
from nanopaged.extras.tensor_parallel import TensorParallelError

# a hang guard, for a busy machine: the module's first test starts two pipelines of two ranks
pytestmark = pytest.mark.timeout(900)

ROOT = Path(__file__).resolve().parents[2]
GREEDY = SamplingParams(temperature=0, max_tokens=16)
# preemption (24 blocks of 8 for 8 prompts of up to 60 tokens), chunked prefill (20 tokens a step)
TIGHT = {"block_size": 8, "num_kv_blocks": 24, "max_num_batched_tokens": 20, "max_num_seqs": 6, "dtype": "float32"}
PROMPTS = [{"prompt_token_ids": p} for p in make_prompts(512, n=8, seed=1, min_len=3, max_len=60)]
PREFIX = make_prompts(512, n=1, seed=2, min_len=40, max_len=40)[0]
SHARED = [{"prompt_token_ids": PREFIX + p} for p in make_prompts(512, n=4, seed=3, min_len=2, max_len=9)]


@pytest.fixture(scope="module")
def model_dirs(tiny_model_dirs, tmp_path_factory):
    """The tiny Llama (2 layers, tied head), and a tiny Qwen3-MoE: 3 layers, 8 experts, layer 1 dense."""
    from transformers import AutoModelForCausalLM, Qwen3MoeConfig
    tokenizer = _tiny_tokenizer()
    config = Qwen3MoeConfig(vocab_size=len(tokenizer), hidden_size=64, num_hidden_layers=3, num_attention_heads=4,
                            num_key_value_heads=2, head_dim=32, intermediate_size=96, moe_intermediate_size=32,
                            num_experts=8, num_experts_per_tok=2, norm_topk_prob=True, mlp_only_layers=[1],
                            max_position_embeddings=512, bos_token_id=1, eos_token_id=EOS_TOKEN_ID,
                            pad_token_id=EOS_TOKEN_ID, tie_word_embeddings=False, dtype="float32")
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    _randomize(model)
    folder = tmp_path_factory.mktemp("pp") / "qwen3_moe"
    model.save_pretrained(folder, safe_serialization=True)
    tokenizer.save_pretrained(folder)
    return {"llama": tiny_model_dirs["llama"], "qwen3_moe": str(folder)}


def run_workload(llm) -> dict:
    out = {"tight": [o.outputs[0].token_ids for o in llm.generate(PROMPTS, GREEDY, use_tqdm=False)]}
    out["stats_tight"] = llm.get_stats()
    llm.generate(SHARED[:1], GREEDY, use_tqdm=False)          # puts the prefix into the cache
    llm.reset_stats()
    out["shared"] = [o.outputs[0].token_ids for o in llm.generate(SHARED, GREEDY, use_tqdm=False)]
    out["stats_shared"] = llm.get_stats()
    return out


class Watch:
    """Wraps a runner's submit and collect: how many batches were in flight, and whether a request whose
    token was still computing was ever submitted again."""

    def __init__(self, runner) -> None:
        self.in_flight, self.most, self.again = [], 0, 0
        self.submit, self.collect = runner.submit, runner.collect
        runner.submit, runner.collect = self.watched_submit, self.watched_collect

    def watched_submit(self, out, inputs):
        waiting = set().union(*self.in_flight) if self.in_flight else set()
        self.again += sum(r in waiting for r, _ in out.scheduled)
        self.in_flight.append(set(inputs.sample_requests))
        self.most = max(self.most, len(self.in_flight))
        return self.submit(out, inputs)

    def watched_collect(self, handle):
        self.in_flight.pop(0)
        return self.collect(handle)


@pytest.fixture(scope="module")
def results(model_dirs):
    found = {}
    for arch, folder in model_dirs.items():
        one = LLM(folder, **TIGHT)
        two = LLM(folder, pipeline_parallel_size=2, **TIGHT)
        runner = two.llm_engine.runner
        watch = Watch(runner)
        found[arch] = {1: run_workload(one), 2: run_workload(two), "watch": watch,
                       "kv_shape_1": tuple(one.llm_engine.runner.kv_cache.shape),
                       "kv_shape_rank0": tuple(runner.kv_cache.shape),
                       "weights_1": sum(p.nbytes for p in one.llm_engine.runner.model.parameters()),
                       "pipeline": two.get_stats()["pipeline_parallel"]}
        runner.shutdown()
    return found


@pytest.mark.parametrize("arch", ["llama", "qwen3_moe"])
def test_greedy_tokens_with_two_stages_equal_one_process(results, arch):
    one, two = results[arch][1], results[arch][2]
    assert two["tight"] == one["tight"]
    assert two["shared"] == one["shared"]
    assert two["stats_tight"]["num_preemptions"] > 0                   # the pool really was too small
    assert two["stats_tight"]["num_steps"] >= sum(len(p["prompt_token_ids"]) for p in PROMPTS) / 20   # chunked
    assert two["stats_shared"]["prefix_cache_hits"] > 0
    assert len({tuple(t) for t in two["tight"]}) > 5                    # not a vacuous comparison


def stage_weights(stages, layers, first, last) -> list[int]:
    return [sum(layers[i] for i in r) + (first if s == 0 else 0) + (last if s == len(stages) - 1 else 0)
            for s, r in enumerate(stages)]


def test_the_demo_models_layers_split_by_weight_so_the_first_stage_with_the_head_takes_fewer():
    """SmolLM2-135M's shape: its tied embedding (49,152 x 576) is a fifth of the weights and sits on stage 0."""
    shape = json.loads((ROOT / "benchmarks/data/model_shapes.json").read_text())["dense"]["smollm2-135m-8h"]
    cfg = ModelConfig.from_dict({**shape, "architectures": ["LlamaForCausalLM"]})
    stages = split_model(cfg, 2)
    assert [i for r in stages for i in r] == list(range(30))                 # every layer in one stage, in order
    assert len(stages[0]) < len(stages[1])
    weights = stage_weights(stages, *part_weights(cfg))
    assert max(weights) / sum(weights) < 0.51                                # vLLM's 15 + 15: about 0.6


def test_the_split_has_the_smallest_largest_stage_of_every_split():
    """Against every choice of cut points, on small random models (uneven layers: a mixture's dense ones)."""
    rng = random.Random(0)
    for _ in range(200):
        num_layers = rng.randint(1, 9)
        stages_n = rng.randint(1, num_layers)
        layers = [rng.choice([10, 10, 30]) for _ in range(num_layers)]
        first, last = rng.randint(0, 60), rng.randint(0, 5)
        stages = stage_layers(layers, first, last, stages_n)
        assert [i for r in stages for i in r] == list(range(num_layers)) and all(len(r) for r in stages)
        every = [stage_weights([range(a, b) for a, b in zip((0, *cuts), (*cuts, num_layers))], layers, first, last)
                 for cuts in itertools.combinations(range(1, num_layers), stages_n - 1)]
        assert max(stage_weights(stages, layers, first, last)) == min(map(max, every))


def test_equal_layers_without_extras_split_evenly():
    assert [len(r) for r in stage_layers([1] * 30, 0, 0, 2)] == [15, 15]
    assert sorted(len(r) for r in stage_layers([1] * 30, 0, 0, 4)) == [7, 7, 8, 8]


def test_a_stage_reads_its_own_layers_renumbered_and_the_first_holds_the_head():
    last = stage_rename(range(15, 30), first=False, last=True)
    assert last("model.layers.16.mlp.down_proj.weight") == "model.layers.1.mlp.down_proj.weight"
    assert last("model.layers.14.mlp.down_proj.weight") is None                  # stage 0's
    assert last("model.embed_tokens.weight") is None and last("lm_head.weight") is None
    assert last("model.norm.weight") == "model.norm.weight"
    first = stage_rename(range(0, 15), first=True, last=False)
    assert first("model.embed_tokens.weight") == "model.embed_tokens.weight"
    assert first("lm_head.weight") == "lm_head.weight"
    assert first("model.norm.weight") is None


@pytest.mark.parametrize("arch", ["llama", "qwen3_moe"])
def test_each_rank_holds_the_kv_of_its_own_layers_only(results, arch):
    r = results[arch]
    layers, _, blocks, *rest = r["kv_shape_1"]
    stages = r["pipeline"]["stages"]
    # the mixture: stage 0's embedding and untied head outweigh a layer, so it takes one layer of three
    assert stages == [[0, 1], [1, layers]]
    assert r["kv_shape_rank0"] == (stages[0][1], 2, blocks, *rest)              # rank 0: stage 0's layers
    kv = [m["kv_cache_bytes"] for m in r["pipeline"]["memory_per_rank"]]
    per_layer = 4 * 2 * blocks * torch.Size(rest).numel()                          # float32, K and V
    assert kv == [(b - a) * per_layer for a, b in stages]
    weights = [m["weight_bytes"] for m in r["pipeline"]["memory_per_rank"]]
    assert all(w < r["weights_1"] for w in weights)


@pytest.mark.parametrize("arch", ["llama", "qwen3_moe"])
def test_no_tensor_is_held_twice_not_even_a_tied_head(results, arch):
    """Stage 0 holds the embedding and the head (tied: the one tensor), the last stage the final norm."""
    weights = [m["weight_bytes"] for m in results[arch]["pipeline"]["memory_per_rank"]]
    assert sum(weights) == results[arch]["weights_1"]


@pytest.mark.parametrize("arch", ["llama", "qwen3_moe"])
def test_two_micro_batches_are_in_flight_and_no_request_is_in_both(results, arch):
    watch, figures = results[arch]["watch"], results[arch]["pipeline"]
    assert watch.most == 2 and figures["max_batches_in_flight"] == 2
    assert watch.again == 0                      # a request waits for its token before it is scheduled again
    assert figures["bytes_between_stages_per_batch"] > 0 and len(figures["bubble"]) == 2


def test_two_by_two_ranks_equal_one_process(model_dirs):
    """Tensor x pipeline: 4 processes, each stage's layers split across its 2 ranks."""
    one = LLM(model_dirs["llama"], **TIGHT)
    four = LLM(model_dirs["llama"], pipeline_parallel_size=2, tensor_parallel_size=2, **TIGHT)
    try:
        got = [o.outputs[0].token_ids for o in four.generate(PROMPTS, GREEDY, use_tqdm=False)]
        memory = four.get_stats()["pipeline_parallel"]["memory_per_rank"]
    finally:
        four.llm_engine.runner.shutdown()
    assert got == [o.outputs[0].token_ids for o in one.generate(PROMPTS, GREEDY, use_tqdm=False)]
    assert len(memory) == 4 and memory[0] == memory[1]                   # stage 0's two ranks hold equal halves


@pytest.mark.parametrize("settings, message", [
    ({"pipeline_parallel_size": 3}, "pipeline_parallel_size=3 is more than the model's 2 layers"),
    ({"pipeline_parallel_size": 2, "async_scheduling": True}, "async_scheduling=True cannot run"),
    ({"pipeline_parallel_size": 2, "enable_lora": True}, "cannot run with enable_lora=True"),
    ({"pipeline_parallel_size": 2, "speculative_config": {"method": "ngram", "num_speculative_tokens": 2}},
     "cannot run with speculative_config"),
])
def test_what_cannot_run_in_stages_is_refused_before_any_process_starts(model_dirs, settings, message):
    with pytest.raises(ValueError, match=message):
        LLM(model_dirs["llama"], **settings)
    assert not multiprocessing.active_children() and not dist.is_initialized()


# ---- failure -----------------------------------------------------------------------------------------
class FailingStageRunner(StageRunner):
    """Rank 1 (the last stage) raises in its third batch (spawned workers import this module to find it)."""
    batches = 0

    def run_stage(self, step, hidden, kv_cache=None):
        self.batches += 1
        if self.group.stage == 1 and self.batches == 3:
            raise RuntimeError("injected failure in stage 1")
        return super().run_stage(step, hidden, kv_cache)


class LLMWithFailingStage(LLM):
    def make_runner(self, config, stages):
        return PipelineParallelRunner(config, rank_runner_class=FailingStageRunner)


def test_a_rank_that_fails_ends_every_process_with_its_error(model_dirs):
    llm = LLMWithFailingStage(model_dirs["llama"], pipeline_parallel_size=2)
    runner = llm.llm_engine.runner
    start = time.monotonic()
    with pytest.raises(TensorParallelError, match="injected failure in stage 1"):
        llm.generate(PROMPTS, SamplingParams(temperature=0, max_tokens=16), use_tqdm=False)
    assert time.monotonic() - start < 120                # a hang guard, far from the collectives' 5-minute timeout
    assert all(not p.is_alive() for p in runner.workers.processes)
    assert not multiprocessing.active_children() and not dist.is_initialized()
    with pytest.raises(TensorParallelError, match="have stopped"):
        llm.generate(PROMPTS[:1], SamplingParams(temperature=0, max_tokens=4), use_tqdm=False)
    assert llm.get_stats()["kv_cache_usage"] == 0.0      # both batches in flight were aborted, their blocks back


def test_a_pipeline_worker_that_does_not_start_is_named_as_one(model_dirs, tmp_path):
    """A script without a main guard: spawn re-imports it in the worker, which dies before joining."""
    script = tmp_path / "no_guard.py"
    script.write_text("import sys\nfrom nanopaged import LLM\nLLM(sys.argv[1], pipeline_parallel_size=2)\n")
    proc = subprocess.run([sys.executable, str(script), model_dirs["llama"]], capture_output=True, text=True,
                          timeout=240, cwd=ROOT)
    assert proc.returncode != 0
    assert "pipeline-parallel worker rank 1 did not start" in proc.stderr.splitlines()[-1]


# ---- torchrun across two nodes -----------------------------------------------------------------------
TORCHRUN_PROGRAM = textwrap.dedent("""
    import sys
    from nanopaged import LLM, SamplingParams
    llm = LLM(sys.argv[1], dtype="float32", pipeline_parallel_size=2)     # rank 1 serves batches in here, then exits
    outs = llm.generate([{"prompt_token_ids": p} for p in [[5, 6, 7], [9, 8, 7, 6, 5, 4]]],
                        SamplingParams(temperature=0, max_tokens=8), use_tqdm=False)
    print("TOKENS", [o.outputs[0].token_ids for o in outs], flush=True)
""")


def test_torchrun_across_two_nodes_equals_one_process(model_dirs, tmp_path):
    """One torchrun per node, `--nnodes 2 --node-rank 0|1 --nproc-per-node 1`, meeting at the master's
    address (here loopback, each node a separate torchrun process): stage 0 on node 0, stage 1 on node 1."""
    script = tmp_path / "pp.py"
    script.write_text(TORCHRUN_PROGRAM)
    line = tokens_on_two_torchrun_nodes(script, model_dirs["llama"])
    one = LLM(model_dirs["llama"], dtype="float32").generate(
        [{"prompt_token_ids": p} for p in [[5, 6, 7], [9, 8, 7, 6, 5, 4]]],
        SamplingParams(temperature=0, max_tokens=8), use_tqdm=False)
    assert line == f"TOKENS {[o.outputs[0].token_ids for o in one]}"
