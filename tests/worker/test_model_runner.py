"""The model runner (nanopaged/worker/model_runner.py): the scheduler's decision becomes tensors.

The runner owns the device side of PagedAttention: each new token's slot in the pool, each
request's block table, where its rows start in the flat batch, which rows sample, the one KV
cache tensor and its copy-on-write copies, and the fast path chosen once for the machine.
These tests build the inputs by hand from requests whose block tables are written out, so each
rule is checked against the arithmetic the docstring states, not against another run."""
import pytest
import torch
from torch import nn

from nanopaged import EngineConfig, SamplingParams
from nanopaged.core.request import Request
from nanopaged.core.scheduler import SchedulerOutput
from nanopaged.models.llama import LlamaForCausalLM
from nanopaged.worker.model_runner import ModelRunner


@pytest.fixture(scope="module")
def runner(tiny_model_dirs):
    config = EngineConfig(tiny_model_dirs["llama"], device="cpu", dtype="float32", block_size=4, num_kv_blocks=32,
                          cpu_kernels="reference", cpu_linear="reference", attention_backend="torch")
    return ModelRunner(config)


def request(name, prompt_len, block_ids, computed=0, output=(), drafts=(), **params):
    r = Request(name, list(range(10, 10 + prompt_len)), SamplingParams(**params), max_tokens=16,
                block_ids=list(block_ids), num_computed_tokens=computed)
    r.output_token_ids = list(output)
    r.spec_token_ids = list(drafts)
    return r


def step(*scheduled):
    return SchedulerOutput(scheduled=list(scheduled))


def test_each_new_token_goes_to_its_slot_through_the_block_table(runner):
    """slot = block_ids[pos // block_size] * block_size + pos % block_size, the paper's mapping."""
    a = request("a", 6, [7, 2])                    # a prompt across two blocks, in physical blocks 7 and 2
    b = request("b", 3, [5], computed=3, output=[99])   # a decode row at position 3
    inputs = runner.prepare_inputs(step((a, 6), (b, 1)))
    assert inputs.meta.slot_mapping.tolist() == [28, 29, 30, 31, 8, 9, 23]
    assert inputs.positions.tolist() == [0, 1, 2, 3, 4, 5, 3]
    assert inputs.input_ids.tolist() == [10, 11, 12, 13, 14, 15, 99]


def test_block_tables_are_padded_and_rows_are_located_by_query_start_loc(runner):
    a = request("a", 6, [7, 2])
    b = request("b", 3, [5], computed=3, output=[99])
    meta = runner.prepare_inputs(step((a, 6), (b, 1))).meta
    assert meta.block_tables.tolist() == [[7, 2], [5, 0]]
    assert meta.query_start_loc.tolist() == [0, 6, 7]
    assert meta.seq_lens.tolist() == [6, 4]
    assert (meta.query_lens_list, meta.seq_lens_list, meta.block_size) == ([6, 1], [6, 4], 4)


def test_a_chunk_in_the_middle_of_a_prompt_samples_nothing(runner):
    """Only a request whose step reaches the end of its known tokens has a next token to choose."""
    chunked = request("a", 10, [1, 2, 3])
    whole = request("b", 3, [4])
    inputs = runner.prepare_inputs(step((chunked, 4), (whole, 3)))
    assert inputs.sample_rows == [6]
    assert inputs.sample_requests == [whole]


def test_a_request_with_k_drafts_samples_from_its_last_k_plus_1_rows(runner):
    r = request("a", 4, [1, 2], computed=4, output=[50], drafts=[60, 61])
    inputs = runner.prepare_inputs(step((r, 3)))
    assert inputs.input_ids.tolist() == [50, 60, 61]
    assert inputs.sample_rows == [0, 1, 2] and inputs.sample_requests == [r, r, r]
    assert inputs.meta.slot_mapping.tolist() == [8, 9, 10]        # the drafts' K/V go to the next slots


def test_prompt_logprobs_rows_score_every_prompt_token_but_the_first(runner):
    """The logits at prompt position p score prompt token p + 1: a chunk [0, 4) of a 6-token prompt
    gives rows for positions 0..3, the last chunk [4, 6) one row (position 4) and a sample row."""
    r = request("a", 6, [1, 2], prompt_logprobs=2)
    first = runner.prepare_inputs(step((r, 4)))
    assert first.prompt_rows == [(r, 0, [0, 1, 2, 3])] and first.sample_rows == []
    r.num_computed_tokens = 4
    second = runner.prepare_inputs(step((r, 2)))
    assert second.prompt_rows == [(r, 4, [0])] and second.sample_rows == [1]


def test_copy_on_write_copies_a_blocks_k_and_v_in_every_layer(runner):
    cache = runner.kv_cache
    cache.zero_()
    cache[:, :, 3] = torch.arange(cache[:, :, 3].numel(), dtype=cache.dtype).reshape(cache[:, :, 3].shape)
    runner.copy_blocks([(3, 9)])
    assert torch.equal(cache[:, :, 9], cache[:, :, 3])
    assert not cache[:, :, 4].any()                   # nothing else is touched
    cache.zero_()


def test_the_kv_cache_is_one_tensor_cut_into_the_budgets_blocks(tiny_model_dirs):
    """(layers, K/V, blocks, block_size, kv_heads, head_dim); the budget divided by a block's bytes,
    and never more blocks than max_num_seqs requests of max_model_len tokens can use."""
    base = dict(device="cpu", dtype="float32", block_size=4, cpu_kernels="reference", cpu_linear="reference",
                attention_backend="torch", max_model_len=64, max_num_seqs=2)
    config = EngineConfig(tiny_model_dirs["llama"], kv_cache_memory_bytes=50_000, **base)
    runner = ModelRunner(config)
    m = config.model_config
    per_block = m.kv_bytes_per_token(4) * 4
    assert runner.num_kv_blocks == 50_000 // per_block == 24
    assert runner.kv_cache.shape == (m.num_hidden_layers, 2, runner.num_kv_blocks, 4, m.num_key_value_heads, m.head_dim)
    capped = ModelRunner(EngineConfig(tiny_model_dirs["llama"], kv_cache_memory_bytes=10**8, **base))
    assert capped.num_kv_blocks == 2 * (64 // 4)


def test_the_reference_settings_run_the_model_a_reader_studies(runner):
    """With every kernel setting at "reference" the runner's fast path changes nothing: the model is
    models/llama.py's, with nn.Linear layers, and the sampler keeps torch's argmax."""
    fast = runner.fast_path
    assert (fast.linear, fast.layers, fast.attention_backend, fast.argmax, fast.quantized) == (
        "reference", "reference", "torch", None, None)
    assert type(runner.model) is LlamaForCausalLM
    assert all(type(m) is nn.Linear for m in runner.model.modules() if isinstance(m, nn.Linear))


def test_execute_returns_logits_only_for_the_rows_that_sample(runner):
    chunked = request("a", 10, [1, 2, 3])
    whole = request("b", 3, [4])
    out = runner.execute(step((chunked, 4), (whole, 3)))
    assert out.requests == [whole]
    assert out.logits.shape == (1, runner.model_config.vocab_size)
    assert out.prompt_logits == []
