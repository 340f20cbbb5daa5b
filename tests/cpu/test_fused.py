"""The fused CPU decoder layer (cpu/fused.py): the same model as the reference layers,
chosen by the settings' rules, and answering as the reference does.

float32 keeps the order of most sums, so greedy tokens equal the reference's token for token on
every architecture (bias, Qwen3's q/k norms, GQA, tied embeddings), across chunked prefill,
prefix-cache hits and preemption; bfloat16 is held to vLLM's check_logprobs_close rule."""
import logging

import pytest
import torch

import nanopaged.cpu.build as cpu_ops_module
import nanopaged.cpu.choose as choose_module
from conftest import check_logprobs_close, make_prompts, nanopaged_greedy
from nanopaged import LLM, EngineConfig, SamplingParams
from nanopaged.cpu.build import available
from nanopaged.cpu.choose import choose
from nanopaged.cpu.fused import FusedLlamaModel, FusedRMSNorm, argmax_rows
from nanopaged.models.llama import LlamaModel
from nanopaged.sample.sampler import torch_argmax

needs_kernels = pytest.mark.skipif(available() is not None, reason=f"{available()}")


def greedy_with_logprobs(llm, prompts, max_tokens=12):
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True, logprobs=3)
    outs = [o.outputs[0] for _ in range(2)        # the second pass hits the prefix cache
            for o in llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)]
    return [o.token_ids for o in outs], [[max(d.values(), key=lambda lp: lp.logprob).logprob for d in o.logprobs]
                                         for o in outs]


@needs_kernels
@pytest.mark.parametrize("arch, settings", [("llama", {"block_size": 8}), ("qwen2", {"num_kv_blocks": 14}),
                                            ("qwen3", {}), ("mistral", {"max_num_seqs": 2})])
def test_fused_layers_give_the_references_tokens_in_float32(tiny_model_dirs, arch, settings):
    """Chunked prefill (24 tokens a step), decode rows beside prefill rows, prefix-cache hits on
    the second pass; num_kv_blocks=14 preempts, max_num_seqs=2 queues."""
    prompts = make_prompts(512, n=5, seed=11, min_len=5, max_len=45)
    results = {}
    for kernels in ("reference", "fused"):
        llm = LLM(tiny_model_dirs[arch], dtype="float32", cpu_kernels=kernels, max_num_batched_tokens=24,
                  **{"num_kv_blocks": 64, **settings})
        assert isinstance(llm.llm_engine.runner.model.model, FusedLlamaModel if kernels == "fused" else LlamaModel)
        results[kernels] = greedy_with_logprobs(llm, prompts)
    assert results["fused"][0] == results["reference"][0]
    torch.testing.assert_close(results["fused"][1], results["reference"][1], rtol=1e-4, atol=1e-4)
    assert len({tuple(t) for t in results["reference"][0]}) > 1


@needs_kernels
@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_the_fused_layers_norm_with_the_models_own_epsilon(tiny_model_dirs, tmp_path, arch):
    """The tiny models' hidden states have a mean square near 1, where rms_norm_eps (1e-5, 1e-6)
    changes nothing; with eps = 0.5 every norm of every layer (and Qwen3's q/k norms) depends on it,
    so a loop that took another epsilon, or none, than the model's answers otherwise."""
    import json
    import shutil
    folder = tmp_path / arch
    shutil.copytree(tiny_model_dirs[arch], folder)
    config = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**config, "rms_norm_eps": 0.5}))
    prompts = make_prompts(512, n=3, seed=5, min_len=5, max_len=30)
    results = {kernels: greedy_with_logprobs(LLM(str(folder), dtype="float32", cpu_kernels=kernels), prompts)
               for kernels in ("reference", "fused")}
    assert results["fused"][0] == results["reference"][0]
    torch.testing.assert_close(results["fused"][1], results["reference"][1], rtol=1e-4, atol=1e-4)


@needs_kernels
@pytest.mark.skipif(not choose_module.bf16_matrix_units(), reason="this CPU has no bfloat16 matrix units")
@pytest.mark.parametrize("linear", ["auto", "packed"])
def test_fused_layers_answer_as_the_reference_in_bfloat16(demo_model_dir, linear):
    """On the real model, in bfloat16: the linears this CPU picks (nanopaged's dpbf16 runs in the C++
    loop; on AMX oneDNN's), and oneDNN's packed ones, which the loop calls back in Python. vLLM's rule."""
    prompts = make_prompts(2000, n=4, seed=3, min_len=8, max_len=40)
    fused = nanopaged_greedy(LLM(demo_model_dir, dtype="bfloat16", cpu_kernels="fused", cpu_linear=linear), prompts, 20)
    reference = nanopaged_greedy(LLM(demo_model_dir, dtype="bfloat16", cpu_kernels="reference",
                                     attention_backend="torch"), prompts, 20)
    check_logprobs_close(fused, reference)
    assert sum(a[0] == b[0] for a, b in zip(fused, reference)) >= 2     # mostly identical, not merely close


@needs_kernels
def test_the_swap_keeps_the_weights_it_found(tiny_model_dirs):
    """No copy of a weight: the C++ loop's description points at the reference modules' own tensors,
    and any linear it has no kernel for (nn.Linear in float32) is the module itself, called back."""
    llm = LLM(tiny_model_dirs["qwen3"], dtype="float32", cpu_kernels="fused")
    model = llm.llm_engine.runner.model
    assert isinstance(model.model, FusedLlamaModel) and isinstance(model.model.norm, FusedRMSNorm)
    layer, described = model.model.layers[1], model.model.decoder.layers[1]
    assert described.input_norm.data_ptr() == layer.input_layernorm.weight.data_ptr()
    assert described.q_norm.data_ptr() == layer.self_attn.q_norm.weight.data_ptr()
    kinds = cpu_ops_module.cpu_ops().LinearKind
    assert described.qkv.kind == kinds.CALLBACK and described.qkv.fn is layer.self_attn.qkv_proj
    assert llm.get_stats()["cpu_kernels"] == "fused" and llm.get_stats()["attention_backend"] == "cpu"


@needs_kernels
def test_the_fused_engine_samples_with_the_kernels_argmax(tiny_model_dirs):
    """The runner hands the sampler the C++ argmax (torch's answer, NaN and ties included:
    tests/cpu/test_cpu_ops.py); the reference runs torch's, and so do other dtypes."""
    fused = LLM(tiny_model_dirs["llama"], dtype="float32", cpu_kernels="fused")
    reference = LLM(tiny_model_dirs["llama"], dtype="float32", cpu_kernels="reference")
    assert fused.llm_engine.sampler.argmax is argmax_rows
    assert reference.llm_engine.sampler.argmax is torch_argmax
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    assert ([o.outputs[0].token_ids for o in fused.generate(["a b c", "hello"], params, use_tqdm=False)] ==
            [o.outputs[0].token_ids for o in reference.generate(["a b c", "hello"], params, use_tqdm=False)])
    x = torch.randn(3, 100).bfloat16()
    assert torch.equal(argmax_rows(x), x.argmax(dim=-1))


def chosen(model_dir, **settings):
    path = choose(EngineConfig(model_dir, **settings))
    return path.linear, path.layers, path.attention_backend


def test_auto_fuses_only_beside_packed_linears(monkeypatch, tiny_model_dirs):
    """auto: fused where the linears are packed (bfloat16 on a CPU with bfloat16 matrix units),
    the torch reference elsewhere (float32 is held to Hugging Face token for token)."""
    model = tiny_model_dirs["llama"]
    monkeypatch.setattr(cpu_ops_module, "available", lambda: None)
    monkeypatch.setattr(choose_module, "bf16_matrix_units", lambda: ["amx_bf16"])
    monkeypatch.setattr(choose_module, "own_kernel_builds", lambda name: False)
    assert chosen(model, device="cpu", dtype="bfloat16") == ("packed", "fused", "cpu")
    monkeypatch.setattr(choose_module, "own_kernel_builds", lambda name: True)
    monkeypatch.setattr(choose_module, "bf16_matrix_units", lambda: ["avx512_bf16"])
    assert chosen(model, device="cpu", dtype="bfloat16") == ("dpbf16", "fused", "cpu")
    assert chosen(model, device="cpu", dtype="float32") == ("reference", "reference", "torch")
    # a chosen backend is kept
    assert chosen(model, device="cpu", dtype="bfloat16", attention_backend="torch")[1:] == ("reference", "torch")
    with pytest.raises(ValueError, match=r"cpu_kernels='fused' attends with the cpu backend's kernel; got "
                                         r"attention_backend='torch'"):
        chosen(model, device="cpu", dtype="bfloat16", attention_backend="torch", cpu_kernels="fused")
    # fused on request in float32, and beside the reference linears
    assert chosen(model, device="cpu", dtype="float32", cpu_kernels="fused") == ("reference", "fused", "cpu")


def test_the_settings_name_the_kernels_and_only_the_runner_chooses(tiny_model_dirs):
    """EngineConfig keeps what the user named ("auto" stays "auto"): it compiles nothing; the
    runner's FastPath says what runs, and get_stats reports that."""
    cfg = EngineConfig(tiny_model_dirs["llama"], device="cpu", dtype="float32")
    assert (cfg.cpu_linear, cfg.cpu_kernels, cfg.attention_backend) == ("auto", "auto", "auto")
    stats = LLM(tiny_model_dirs["llama"], device="cpu", dtype="float32", cpu_kernels="reference").get_stats()
    assert (stats["cpu_linear"], stats["cpu_kernels"], stats["attention_backend"]) == ("reference", "reference", "torch")


def test_without_the_kernels_auto_runs_the_reference_and_fused_is_refused(monkeypatch, tiny_model_dirs):
    why = "building nanopaged's CPU kernels needs a C++ compiler (c++ or g++ on the PATH)"
    model = tiny_model_dirs["llama"]
    monkeypatch.setattr(cpu_ops_module, "available", lambda: why)
    monkeypatch.setattr(choose_module, "bf16_matrix_units", lambda: ["amx_bf16"])
    assert chosen(model, device="cpu", dtype="bfloat16") == ("packed", "reference", "torch")
    with pytest.raises(ValueError, match=r"cpu_kernels='fused': building nanopaged's CPU kernels needs a C\+\+"):
        chosen(model, device="cpu", cpu_kernels="fused")
    with pytest.raises(ValueError, match=r"cpu_kernels='fused': building nanopaged's CPU kernels needs a C\+\+"):
        LLM(model, device="cpu", cpu_kernels="fused")        # refused before a weight loads
    with pytest.raises(ValueError, match=r"cpu_kernels must be one of \['auto', 'fused', 'reference'\], got 'fast'"):
        EngineConfig(model, cpu_kernels="fast")


def test_a_failed_build_is_a_warning_and_the_reference(monkeypatch, caplog):
    """A compiler that fails (another gcc, a broken torch install) must not stop the engine."""
    def broken(*args, **kwargs):
        raise RuntimeError("Error building extension 'nanopaged_cpu_ops': c++: internal compiler error")
    monkeypatch.setattr(cpu_ops_module, "missing_tools", lambda: None)
    monkeypatch.setattr(cpu_ops_module, "build", broken)
    cpu_ops_module.cpu_ops.cache_clear()
    cpu_ops_module.available.cache_clear()
    logging.getLogger("nanopaged").addHandler(caplog.handler)          # nanopaged's log does not propagate
    try:
        with caplog.at_level(logging.WARNING, logger="nanopaged.cpu.build"):
            assert "did not build" in cpu_ops_module.available()
        assert "internal compiler error" in caplog.text
    finally:
        logging.getLogger("nanopaged").removeHandler(caplog.handler)
        monkeypatch.undo()
        cpu_ops_module.cpu_ops.cache_clear()
        cpu_ops_module.available.cache_clear()


def test_fused_off_the_cpu_is_refused(tiny_model_dirs):
    with pytest.raises(ValueError, match=r"cpu_kernels='fused' runs on CPU \(device is 'cuda'\)"):
        choose_module.choose_layers("fused", "cuda", "reference", "auto")
