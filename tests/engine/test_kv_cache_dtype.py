"""kv_cache_dtype end to end: an 8-bit KV cache (vLLM's "fp8" = "fp8_e4m3" and "fp8_e5m2", and "int8" with
a scale per token and KV head) on every backend that reads one, on tiny random models.

Each backend (the torch reference; the `cpu` attention backend beside the reference layers, whose store
is store_kv; the fused layers, whose store is rotary_and_store) gives greedy answers close to its own
with the model's dtype by vLLM's rule (check_logprobs_close); the same memory budget holds twice the
blocks of a bfloat16 cache in fp8 (in int8 a little fewer: the scales); prefix-cache hits, copy-on-write
for n > 1 samples and tensor parallelism work on it; a request's answer alone equals its answer in a
batch; and a bad value, or a backend that cannot read an 8-bit cache, is refused by name before a weight
loads. The kernels: tests/cpu/test_kv_cache_kernels.py.
"""
import pytest
import torch

from conftest import check_logprobs_close, make_prompts, nanopaged_greedy
from nanopaged import LLM, EngineConfig, SamplingParams
from nanopaged.cpu.build import available
from nanopaged.cpu.choose import choose

FP8 = ["fp8", "fp8_e4m3", "fp8_e5m2"]
STORED_AS = {"fp8": "float8_e4m3fn", "fp8_e4m3": "float8_e4m3fn", "fp8_e5m2": "float8_e5m2", "int8": "int8"}
BACKENDS = {
    "torch": {"attention_backend": "torch", "cpu_kernels": "reference", "cpu_linear": "reference"},
    "cpu": {"attention_backend": "cpu", "cpu_kernels": "reference"},
    "fused": {"cpu_kernels": "fused"},
}
needs_kernels = pytest.mark.skipif(available() is not None, reason=f"{available()}")
PREFIX = list(range(100, 140))           # 40 tokens: two full blocks of 16 for the prefix cache


def backend(name):
    return pytest.param(name, marks=[] if name == "torch" else [needs_kernels])


def prompts(n=6, seed=0):
    return [PREFIX + p for p in make_prompts(512, n=n, seed=seed, min_len=3, max_len=30)]


@pytest.mark.parametrize("name", [backend(n) for n in BACKENDS])
def test_greedy_answers_with_an_8_bit_cache_stay_close_to_the_models_dtype(tiny_model_dirs, name):
    batch = prompts()
    want = nanopaged_greedy(LLM(tiny_model_dirs["qwen2"], **BACKENDS[name]), batch, 16)
    for kv_cache_dtype in ("fp8", "fp8_e5m2", "int8"):
        llm = LLM(tiny_model_dirs["qwen2"], kv_cache_dtype=kv_cache_dtype, **BACKENDS[name])
        assert llm.get_stats()["kv_cache_dtype"] == STORED_AS[kv_cache_dtype]
        got = nanopaged_greedy(llm, batch, 16)
        check_logprobs_close(want, got)
        assert any(a[0][:4] == b[0][:4] for a, b in zip(want, got))      # not close by accident: mostly the same
        again = nanopaged_greedy(llm, batch[::-1], 16)[::-1]             # the prefix now hits the cache
        assert llm.get_stats()["prefix_cache_hits"] > 0
        check_logprobs_close(got, again)


@pytest.mark.parametrize("kv_cache_dtype", FP8)
def test_the_same_budget_holds_twice_the_blocks_of_a_bfloat16_cache(tiny_model_dirs, kv_cache_dtype):
    budget = 1 << 20
    auto = LLM(tiny_model_dirs["llama"], dtype="bfloat16", kv_cache_memory_bytes=budget, attention_backend="torch")
    eight = LLM(tiny_model_dirs["llama"], dtype="bfloat16", kv_cache_memory_bytes=budget, attention_backend="torch",
                kv_cache_dtype=kv_cache_dtype)
    assert eight.get_stats()["num_kv_blocks"] == 2 * auto.get_stats()["num_kv_blocks"]
    assert eight.llm_engine.runner.kv_cache.nbytes == auto.llm_engine.runner.kv_cache.nbytes
    assert eight.llm_engine.runner.kv_cache.element_size() == 1


def test_an_int8_cache_spends_4_more_bytes_a_row_on_its_scale(tiny_model_dirs):
    budget = 1 << 20
    llm = LLM(tiny_model_dirs["llama"], dtype="bfloat16", kv_cache_memory_bytes=budget, kv_cache_dtype="int8",
              attention_backend="torch")
    m = llm.llm_engine.config.model_config
    assert llm.llm_engine.runner.kv_cache.shape[-1] == m.head_dim + 4
    block_bytes = 2 * m.num_hidden_layers * m.num_key_value_heads * (m.head_dim + 4) * 16
    assert llm.get_stats()["num_kv_blocks"] == budget // block_bytes


@pytest.mark.parametrize("kv_cache_dtype", ["fp8", "int8"])
@pytest.mark.parametrize("name", [backend(n) for n in BACKENDS])
def test_n_samples_share_blocks_and_copy_them_on_write(tiny_model_dirs, name, kv_cache_dtype):
    """Greedy n=3 samples fork after the prompt, sharing its partly filled last block: each copies it
    before writing, so each must answer as the request alone does."""
    batch = [{"prompt_token_ids": p} for p in prompts(3, seed=2)]
    llm = LLM(tiny_model_dirs["llama"], kv_cache_dtype=kv_cache_dtype, enable_prefix_caching=False, **BACKENDS[name])
    alone = [o.outputs[0].token_ids for o in llm.generate(batch, SamplingParams(temperature=0, max_tokens=12),
                                                           use_tqdm=False)]
    forked = llm.generate(batch, SamplingParams(n=3, temperature=0, max_tokens=12), use_tqdm=False)
    assert [[c.token_ids for c in o.outputs] for o in forked] == [[a] * 3 for a in alone]


@pytest.mark.parametrize("kv_cache_dtype", ["fp8_e5m2", "int8"])
def test_copy_on_write_moves_every_byte_of_a_block(tiny_model_dirs, kv_cache_dtype):
    """Its K/V in every layer, an int8 block's scales with them."""
    llm = LLM(tiny_model_dirs["llama"], kv_cache_dtype=kv_cache_dtype, num_kv_blocks=8, attention_backend="torch")
    runner = llm.llm_engine.runner
    runner.kv_cache.view(torch.uint8).copy_(torch.randint(0, 256, runner.kv_cache.shape, dtype=torch.uint8))
    before = runner.kv_cache.view(torch.uint8).clone()
    runner.copy_blocks([(2, 5), (6, 1)])
    after = runner.kv_cache.view(torch.uint8)
    assert torch.equal(after[:, :, 5], before[:, :, 2]) and torch.equal(after[:, :, 1], before[:, :, 6])
    untouched = [0, 2, 3, 4, 6, 7]
    assert torch.equal(after[:, :, untouched], before[:, :, untouched])


@needs_kernels
@pytest.mark.parametrize("kv_cache_dtype", ["fp8", "int8"])
def test_alone_equals_in_a_batch_with_an_8_bit_cache(tiny_model_dirs, kv_cache_dtype):
    if not choose(EngineConfig(tiny_model_dirs["qwen3"], device="cpu")).batch_invariant:
        pytest.skip("batch invariance is not the default here (it needs AVX512-BF16 and the C++ kernels)")
    batch = [{"prompt_token_ids": p} for p in prompts(12, seed=3)]
    params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    cold = LLM(tiny_model_dirs["qwen3"], kv_cache_dtype=kv_cache_dtype, enable_prefix_caching=False)
    want = [cold.generate([p], params, use_tqdm=False)[0].outputs[0].token_ids for p in batch]
    llm = LLM(tiny_model_dirs["qwen3"], kv_cache_dtype=kv_cache_dtype, max_num_batched_tokens=48)
    assert [o.outputs[0].token_ids for o in llm.generate(batch, params, use_tqdm=False)] == want
    assert [o.outputs[0].token_ids for o in llm.generate(batch[::-1], params, use_tqdm=False)] == want[::-1]
    assert llm.get_stats()["prefix_cache_hits"] > 0 and llm.get_stats()["batch_invariant"]


@pytest.mark.timeout(180)
def test_two_ranks_answer_as_one_with_an_8_bit_cache(tiny_model_dirs):
    """int8, whose rows are the longest (codes and scale): each rank holds its KV heads' rows."""
    batch = [{"prompt_token_ids": p} for p in prompts(4, seed=4)]
    params = SamplingParams(temperature=0, max_tokens=12)
    settings = {"dtype": "float32", "kv_cache_dtype": "int8", "kv_cache_memory_bytes": 1 << 20}
    one = LLM(tiny_model_dirs["llama"], **settings)
    want = [o.outputs[0].token_ids for o in one.generate(batch, params, use_tqdm=False)]
    two = LLM(tiny_model_dirs["llama"], tensor_parallel_size=2, **settings)
    try:
        assert [o.outputs[0].token_ids for o in two.generate(batch, params, use_tqdm=False)] == want
        runner = two.llm_engine.runner
        m = one.llm_engine.config.model_config
        assert runner.kv_cache.dtype == torch.int8
        assert runner.kv_cache.shape[-2:] == (m.num_key_value_heads // 2, m.head_dim + 4)   # half the KV heads each
        assert runner.num_kv_blocks == (1 << 20) // runner.kv_cache[:, :, :1].numel()
    finally:
        two.llm_engine.runner.shutdown()


@pytest.mark.parametrize("value", ["fp16", "int4", "FP8", "float8_e4m3fn", None])
def test_a_bad_value_is_refused_by_name(tiny_model_dirs, value):
    match = r"kv_cache_dtype must be one of \['auto', 'fp8', 'fp8_e4m3', 'fp8_e5m2', 'int8'\], got "
    with pytest.raises(ValueError, match=match):
        EngineConfig(tiny_model_dirs["llama"], kv_cache_dtype=value)
    with pytest.raises(ValueError, match=match):
        LLM(tiny_model_dirs["llama"], kv_cache_dtype=value)


def test_a_backend_that_cannot_read_an_fp8_cache_is_refused_before_loading(tiny_model_dirs, monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "1")         # triton's interpreter would run on CPU tensors
    config = EngineConfig(tiny_model_dirs["llama"], device="cpu", attention_backend="triton", kv_cache_dtype="fp8")
    with pytest.raises(ValueError, match=r"kv_cache_dtype='fp8' runs on the torch and cpu attention backends, "
                                         r"not 'triton'"):
        choose(config)


def test_the_command_lines_take_it_by_vllms_flag():
    """`nanopaged serve --kv-cache-dtype fp8` and `bench.py --kv-cache-dtype int8` reach the engine's settings."""
    import bench
    from nanopaged.entrypoints.serve import engine_settings, parse_args
    assert engine_settings(parse_args(["serve", "--kv-cache-dtype", "fp8"]))["kv_cache_dtype"] == "fp8"
    assert "kv_cache_dtype" not in engine_settings(parse_args(["serve"]))
    assert bench.engine_settings(bench.parse_args(["--kv-cache-dtype", "int8"]))["kv_cache_dtype"] == "int8"
    with pytest.raises(SystemExit):
        bench.parse_args(["--kv-cache-dtype", "fp16"])
