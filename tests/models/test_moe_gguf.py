"""GGUF files of mixtures of experts, as llama.cpp ships them (nanopaged/models/gguf.py): tiny random Qwen3-MoE,
Mixtral and OLMoE models written the way llama.cpp's converter writes them (each layer's experts stacked into one
tensor per projection, its tensor names from gguf's own name map, q's and k's rows permuted for its llama family,
the tokenizer in the metadata), with 4- and 8-bit tensors quantized by gguf itself. The folder converted from the
file answers token for token as the Hugging Face model built from the file's dequantized weights; with
quantization="gguf" each expert runs its own slice of the shipped blocks, close to the dequantized model by vLLM's
rule, and a type no kernel reads stays dequantized, listed; a mixture nanopaged does not compute is refused by name."""
import json
import re
import shutil

import numpy as np
import pytest
import torch

import nanopaged.cpu.quantized_linear as ql
from conftest import EOS_TOKEN_ID, _randomize, _tiny_tokenizer, check_logprobs_close, make_prompts, nanopaged_greedy
from nanopaged import LLM, SamplingParams
from nanopaged.models.moe import SparseMoeBlock

COMMON = dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
              max_position_embeddings=512, bos_token_id=1, eos_token_id=EOS_TOKEN_ID, pad_token_id=EOS_TOKEN_ID,
              tie_word_embeddings=False, dtype="float32")
# the GGUF architecture each model is written as (llama.cpp writes Mixtral as "llama"), and the type of each
# tensor (by its GGUF name, after "blk.N."); what is not named stays F32, as llama.cpp keeps norms and routers
LAYOUTS = {
    "qwen3_moe": ("qwen3moe", {"attn_q": "Q8_0", "attn_k": "Q8_0", "attn_v": "Q8_0", "attn_output": "Q8_0",
                               "ffn_gate_exps": "Q4_0", "ffn_up_exps": "Q4_0", "ffn_down_exps": "Q4_1",
                               "token_embd": "Q8_0", "output": "Q8_0"}),
    "mixtral": ("llama", {"attn_q": "Q4_0", "attn_k": "Q4_0", "attn_v": "Q4_0", "attn_output": "Q4_1",
                          "ffn_gate_exps": "Q8_0", "ffn_up_exps": "Q8_0", "ffn_down_exps": "Q4_0",
                          "token_embd": "F16", "output": "F16"}),
    "olmoe": ("olmoe", {"attn_q": "Q4_1", "attn_k": "Q4_1", "attn_v": "Q4_1", "attn_output": "Q4_1",
                        "ffn_gate_exps": "Q4_0", "ffn_up_exps": "Q4_0", "ffn_down_exps": "Q5_0",    # Q5_0: no kernel
                        "output": "Q8_0"}),
}


def configs(vocab_size):
    from transformers import MixtralConfig, OlmoeConfig, Qwen3MoeConfig
    return {
        # 8 experts, top-2 renormalised (llama.cpp's graph always renormalises Qwen3-MoE), head_dim 32 != 64 / 4
        "qwen3_moe": Qwen3MoeConfig(vocab_size=vocab_size, **COMMON, head_dim=32, intermediate_size=96,
                                    moe_intermediate_size=32, num_experts=8, num_experts_per_tok=2, norm_topk_prob=True,
                                    rope_theta=1_000_000.0),
        # 4 experts, top-2, weights kept in float32; q and k permuted in the file
        "mixtral": MixtralConfig(vocab_size=vocab_size, **COMMON, intermediate_size=32, num_local_experts=4,
                                 num_experts_per_tok=2, sliding_window=None),
        # 8 experts, top-4, not renormalised, q/k norm over the whole projection
        "olmoe": OlmoeConfig(vocab_size=vocab_size, **COMMON, intermediate_size=32, num_experts=8,
                             num_experts_per_tok=4),
    }


# ---- writing a file as llama.cpp's converter does -------------------------------------------
def gguf_names(arch: str, layers: int):
    """gguf's own map from Hugging Face names to GGUF ones (gguf-py: tensor_mapping.py), for `arch`."""
    import gguf
    return gguf.get_tensor_name_map({v: k for k, v in gguf.MODEL_ARCH_NAMES.items()}[arch], layers)


def gguf_name(names, hf_name: str) -> str:
    """The GGUF tensor a checkpoint tensor goes into; every expert's, its layer's stacked one
    ("experts.3.gate_proj" -> "experts.gate_proj" -> "blk.N.ffn_gate_exps")."""
    return names.get_name(re.sub(r"\.experts\.\d+\.", ".experts.", hf_name.removesuffix(".weight"))) + ".weight"


def llama_permute(w: np.ndarray, heads: int) -> np.ndarray:
    """llama.cpp's convert_hf_to_gguf.py: LlamaModel.permute, each head's two rotary halves interleaved."""
    return w.reshape(heads, 2, w.shape[0] // heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def add_vocab(writer, folder) -> None:
    """The tokenizer as llama.cpp's _set_vocab_gpt2 writes it: tokens by id, the special ones as control
    tokens, the merges, special ids and chat template (gguf.SpecialVocab)."""
    import gguf
    from transformers import AutoTokenizer
    tokenizer = AutoTokenizer.from_pretrained(folder)
    by_id = {i: t for t, i in tokenizer.get_vocab().items()}
    added = tokenizer.get_added_vocab()
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("default")
    writer.add_token_list([by_id[i] for i in range(len(by_id))])
    writer.add_token_types([gguf.TokenType.CONTROL if by_id[i] in added else gguf.TokenType.NORMAL
                            for i in range(len(by_id))])
    gguf.SpecialVocab(folder, load_merges=True).add_to_gguf(writer)


def write_gguf(path, folder, arch: str, types: dict) -> None:
    """The folder's model as one GGUF file: llama.cpp's metadata, its names, experts stacked, its types."""
    import gguf
    from safetensors.torch import load_file
    cfg = json.loads((folder / "config.json").read_text())
    heads, kv_heads = cfg["num_attention_heads"], cfg["num_key_value_heads"]
    writer = gguf.GGUFWriter(str(path), arch)
    writer.add_block_count(cfg["num_hidden_layers"])
    writer.add_context_length(cfg["max_position_embeddings"])
    writer.add_embedding_length(cfg["hidden_size"])
    writer.add_feed_forward_length(cfg["intermediate_size"])
    writer.add_head_count(heads)
    writer.add_head_count_kv(kv_heads)
    writer.add_rope_freq_base(cfg["rope_parameters"]["rope_theta"])
    writer.add_layer_norm_rms_eps(cfg["rms_norm_eps"])
    writer.add_expert_count(cfg.get("num_experts") or cfg["num_local_experts"])
    writer.add_expert_used_count(cfg["num_experts_per_tok"])
    if cfg.get("head_dim"):
        writer.add_key_length(cfg["head_dim"])
        writer.add_value_length(cfg["head_dim"])
    if "moe_intermediate_size" in cfg:
        writer.add_expert_feed_forward_length(cfg["moe_intermediate_size"])
    add_vocab(writer, folder)
    names, stacked = gguf_names(arch, cfg["num_hidden_layers"]), {}
    for name, w in load_file(folder / "model.safetensors").items():
        target = gguf_name(names, name)
        w = w.float().numpy()
        if arch == "llama" and target.endswith(("attn_q.weight", "attn_k.weight")):
            w = llama_permute(w, heads if "attn_q" in target else kv_heads)
        if ".experts." in name:
            stacked.setdefault(target, {})[int(name.split(".experts.")[1].split(".")[0])] = w
            continue
        add_tensor(writer, target, w, types)
    for target, experts in stacked.items():
        add_tensor(writer, target, np.stack([experts[e] for e in sorted(experts)]), types)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def add_tensor(writer, name: str, w: np.ndarray, types: dict) -> None:
    import gguf
    from gguf.quants import quantize
    kind = getattr(gguf.GGMLQuantizationType, types.get(name.split(".")[-2], "F32"))
    if kind == gguf.GGMLQuantizationType.F16:
        writer.add_tensor(name, w.astype(np.float16))
    elif kind == gguf.GGMLQuantizationType.F32:
        writer.add_tensor(name, w)
    else:
        writer.add_tensor(name, quantize(w, kind), raw_dtype=kind)


def dequantized(w: torch.Tensor, kind: str) -> torch.Tensor:
    """What the file's `kind` keeps of w: gguf's own quantize, then dequantize (rows quantize alone, so
    llama.cpp's row permutation and the experts' stacking change nothing)."""
    import gguf
    from gguf.quants import dequantize, quantize
    if kind in ("F32", "F16"):
        return w if kind == "F32" else w.half().float()
    t = getattr(gguf.GGMLQuantizationType, kind)
    return torch.from_numpy(dequantize(quantize(w.numpy(), t), t).copy())


def decisive(model) -> None:
    """Random weights whose choices stand apart by more than bfloat16's rounding moves them: a tiny random
    model is flat enough that reduced precision alone swaps a token's experts or its top tokens, where vLLM's
    rule cannot tell a fault from noise. Smaller matrices (less chaotic layers) and a router ten times as
    large (its top-k no near-tie)."""
    _randomize(model, std=0.08)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("mlp.gate.weight"):
                p.mul_(10)


@pytest.fixture(scope="module")
def moe_ggufs(tmp_path_factory):
    """{name: (the GGUF file, the folder it was converted into, the Hugging Face folder of its dequantized
    weights)}: the file written from a tiny random model, converted as `LLM("x.gguf")` converts it; the
    reference built from the model's own names, apart from the converter."""
    from safetensors.torch import load_file, save_file
    from transformers import AutoModelForCausalLM
    from nanopaged.models.demo_model import gguf_folder
    tokenizer, root, made = _tiny_tokenizer(), tmp_path_factory.mktemp("moe-gguf"), {}
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("NANOPAGED_CACHE", str(root / "cache"))
        for name, config in configs(len(tokenizer)).items():
            torch.manual_seed(0)
            model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
            decisive(model)
            model.save_pretrained(root / name)
            tokenizer.save_pretrained(root / name)
            arch, types = LAYOUTS[name]
            path = root / f"{name}.gguf"
            write_gguf(path, root / name, arch, types)
            reference = root / f"{name}-dequantized"
            shutil.copytree(root / name, reference)
            names = gguf_names(arch, config.num_hidden_layers)
            weights = {k: dequantized(w, types.get(gguf_name(names, k).split(".")[-2], "F32"))
                       for k, w in load_file(root / name / "model.safetensors").items()}
            save_file(weights, reference / "model.safetensors", metadata={"format": "pt"})
            made[name] = (path, gguf_folder(path), reference)
    return made


def small(folder, **kwargs):
    """An engine on a small KV cache (zeroing the default 1 GiB costs seconds here)."""
    return LLM(str(folder), num_kv_blocks=64, **kwargs)


# ---- the converted folder --------------------------------------------------------------------
@pytest.mark.parametrize("name", ["qwen3_moe", "mixtral", "olmoe"])
def test_the_converted_folder_answers_as_the_files_dequantized_weights(moe_ggufs, hf_greedy, name):
    """Float32, token for token, against transformers running the weights the file holds; the folder holds
    the checkpoint under the names the model ships with (each expert its own tensors), and a config that
    routes as the model did."""
    from safetensors import safe_open
    from nanopaged.models.config import ModelConfig
    _, folder, reference = moe_ggufs[name]
    assert ModelConfig.from_folder(folder) == ModelConfig.from_folder(reference)
    with safe_open(str(folder / "model.safetensors"), "pt") as ours, \
            safe_open(str(reference / "model.safetensors"), "pt") as theirs:
        assert set(ours.keys()) == set(theirs.keys())
    prompts = make_prompts(512, n=6, seed=11)
    llm = small(folder, dtype="float32")
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], SamplingParams(temperature=0, max_tokens=12),
                        use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == hf_greedy(str(reference), prompts, 12)


# ---- quantization="gguf": the shipped blocks -------------------------------------------------
def expert_blocks(found: dict, module: str) -> torch.Tensor:
    """The values a module's shipped blocks stand for: w = (q - 8) scale + zero, or q scale."""
    codes, scale, *zero = found[module]
    rows, cols = codes.shape
    q = codes.float().reshape(rows, cols // 32, 32) - (8 if zero else 0)
    w = q * scale[..., None] + (zero[0][..., None] if zero else 0)
    return w.reshape(rows, cols)


@pytest.mark.parametrize("name", ["qwen3_moe", "mixtral", "olmoe"])
def test_each_expert_runs_its_slice_of_the_shipped_blocks(moe_ggufs, name):
    """Each expert's gate_up and down, and the attention (q and k unpermuted for Mixtral), are the file's blocks,
    which stand for exactly the weights the folder holds; in bfloat16 every expert runs on the 4-/8-bit kernel its
    type asks for, a type with no kernel stays dequantized and is listed, and the answers stay close to the
    dequantized bfloat16 model's by vLLM's rule."""
    from safetensors.torch import load_file
    from nanopaged.models.config import ModelConfig
    from nanopaged.models.demo_model import find_gguf
    from nanopaged.models.gguf import load_gguf_linears
    _, folder, _ = moe_ggufs[name]
    types, cfg = LAYOUTS[name][1], ModelConfig.from_folder(folder)
    found, _ = load_gguf_linears(find_gguf(str(folder)), cfg)
    written, last = load_file(folder / "model.safetensors"), cfg.moe.num_experts - 1
    expert = f"model.layers.1.{'block_sparse_moe' if name == 'mixtral' else 'mlp'}.experts.{last}"
    gate, up, down = ("w1", "w3", "w2") if name == "mixtral" else ("gate_proj", "up_proj", "down_proj")
    shipped_as = {f"mlp.experts.{last}.gate_up_proj": (f"{expert}.{gate}", f"{expert}.{up}"),
                  f"mlp.experts.{last}.down_proj": (f"{expert}.{down}",),
                  "self_attn.qkv_proj": tuple(f"model.layers.1.self_attn.{p}_proj" for p in "qkv")}
    for module, tensors in shipped_as.items():
        if f"model.layers.1.{module}" in found:                 # not a type no kernel reads
            assert torch.equal(expert_blocks(found, f"model.layers.1.{module}"),
                               torch.cat([written[f"{t}.weight"] for t in tensors])), module

    llm = small(folder, dtype="bfloat16", quantization="gguf", cpu_kernels="reference")
    stats = llm.get_stats()["quantization"]
    kernel = {"Q4_0": ql.Int4Linear, "Q4_1": ql.Int4Linear,
              "Q8_0": ql.Q8Linear if ql.nanopaged_kernels() is not None else None}
    blocks = [m for m in llm.llm_engine.runner.model.modules() if isinstance(m, SparseMoeBlock)]
    assert len(blocks) == cfg.num_hidden_layers
    for block in blocks:
        for expert in block.experts:
            for linear, part in ((expert.gate_up_proj, "ffn_gate_exps"), (expert.down_proj, "ffn_down_exps")):
                want = kernel.get(types[part])
                assert isinstance(linear, want) if want else not isinstance(linear, ql.QuantizedLinear)
        assert not isinstance(block.gate, ql.QuantizedLinear)          # the router stays dense
    if types["ffn_down_exps"] == "Q5_0":
        assert stats["left_dense"][:2] == ["model.layers.0.mlp.experts.*.down_proj (Q5_0)",
                                           "model.layers.1.mlp.experts.*.down_proj (Q5_0)"]
    prompts = make_prompts(512, n=4, seed=12)
    check_logprobs_close(nanopaged_greedy(llm, prompts, 8),
                         nanopaged_greedy(small(folder, dtype="bfloat16", cpu_kernels="reference"), prompts, 8))


def test_without_nanopaged_kernels_q8_0_experts_stay_dense_and_are_listed_once_a_layer(moe_ggufs, monkeypatch):
    """An AVX2-only host has no 8-bit kernel: Mixtral's Q8_0 gate/up experts keep the dequantized weights,
    listed once a layer (the stacked tensor has one type), while its Q4_0 down experts still run 4-bit."""
    monkeypatch.setattr(ql, "nanopaged_kernels", lambda: None)
    llm = small(moe_ggufs["mixtral"][1], dtype="float32", quantization="gguf")
    listed = [n for n in llm.get_stats()["quantization"]["left_dense"] if ".experts." in n]
    assert listed == [f"model.layers.{i}.mlp.experts.*.gate_up_proj ({ql.NO_Q8_KERNEL})" for i in (0, 1)]
    for block in (m for m in llm.llm_engine.runner.model.modules() if isinstance(m, SparseMoeBlock)):
        assert all(not isinstance(e.gate_up_proj, ql.QuantizedLinear) and isinstance(e.down_proj, ql.Int4Linear)
                   for e in block.experts)


# ---- what nanopaged does not compute ------------------------------------------------------
@pytest.mark.parametrize("arch, metadata, named", [
    ("qwen2moe", {}, r"GGUF architecture 'qwen2moe' is a mixture of experts nanopaged does not compute"),
    ("deepseek2", {}, r"GGUF architecture 'deepseek2'"),
    ("qwen3moe", {"expert_gating_func": 2}, r"qwen3moe.expert_gating_func=2 asks for a router scored other than"),
    ("olmoe", {"expert_shared_count": 1}, r"olmoe.expert_shared_count=1 asks for shared experts"),
])
def test_a_mixture_nanopaged_does_not_compute_is_refused_by_name(tmp_path, monkeypatch, arch, metadata, named):
    """Before any weight is read or any folder written: `LLM("x.gguf")` names the architecture or the setting."""
    import gguf
    monkeypatch.setenv("NANOPAGED_CACHE", str(tmp_path / "cache"))
    path = tmp_path / f"{arch}.gguf"
    writer = gguf.GGUFWriter(str(path), arch)
    for key, value in metadata.items():
        writer.add_uint32(f"{arch}.{key}", value)
    writer.add_tensor("blk.0.ffn_gate_exps.weight", np.zeros((4, 32, 64), np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    with pytest.raises(ValueError, match=named):
        LLM(str(path))
    assert not (tmp_path / "cache" / arch).exists()
